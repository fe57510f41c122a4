//! TriMul on a row-sharded pair tensor across GPUs (issue 29), on NVIDIA GPUs through NCCL.
//!
//! Rank `r` of `R` holds rows `[r0, r1)` of the first pair index of x and receives the same
//! rows of y ([`crate::plan::shard::row_split`]: as even as possible): the layout
//! context-parallel models keep the pair representation in. Its input and output stages touch
//! only its own positions; the contraction exchanges, chunk by chunk under the GEMMs, right's
//! rows (outgoing) or partial sums of t (incoming). `docs/multi-gpu.md` has the design and the
//! measurements.
//!
//! - [`ShardedLayer`]: one rank, given a [`Communicator`]; its forward takes the rank's rows
//!   (device addresses, or host slices).
//! - [`ShardedGroup`]: every rank of this host in one process, one thread per GPU: a whole x
//!   in, a whole y out (what `trimul check --gpus` and `trimul bench --gpus` run).

use std::ops::Range;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUstream;
use rayon::prelude::*;

use crate::backend::cuda::{
    min_max_over_ranks, CudaBackend, CudaPrepared, DeviceBuffer, EventPair, ShardWorkspace, AGREE,
};
use crate::backend::Backend;
use crate::collective::Communicator;
use crate::device_io::{HostWords, HostWordsMut};
use crate::error::{BackendKind, Error, Result};
use crate::layer::Layer;
use crate::plan::shard::{RankPlan, ShardOptions, CHUNK_MATRICES};
use crate::problem::{Precision, Problem};
use crate::weights::Weights;

/// One rank's side of sharded forwards over one communicator: its GPU, the communicator, and
/// one workspace per problem (shape) it has run, shared by every layer of that shape. What a
/// model with many TriMul layers keeps per GPU (the Python package keeps one per process group
/// and device); its forwards take any layer's weights prepared on this GPU.
pub struct ShardedRank {
    backend: CudaBackend,
    comm: Communicator,
    options: ShardOptions,
    workspaces: Vec<ShardWorkspace>,
    /// The workspace of the last forward enqueued: the next forward waits for it.
    last: Option<usize>,
    /// Room for the ranks' agreement on a new workspace's budget (its minimum) and whether any
    /// rank failed to plan it (the maximum): 3 × [`AGREE`] u64.
    agree: DeviceBuffer<u64>,
}

impl ShardedRank {
    /// The rank of `comm` on the GPU the communicator is bound to, each workspace planned to
    /// fit the memory free when it is made.
    pub fn new(comm: Communicator) -> Result<Self> {
        Self::with_options(comm, ShardOptions::default())
    }

    /// As [`ShardedRank::new`], with the plans' choices `options` fixed instead of left to
    /// memory (every rank must be given the same).
    pub fn with_options(comm: Communicator, options: ShardOptions) -> Result<Self> {
        let backend = CudaBackend::new(comm.device())?;
        let agree = backend.alloc_buffer(3 * AGREE)?;
        Ok(ShardedRank { backend, comm, options, workspaces: Vec::new(), last: None, agree })
    }

    /// This rank's number in the communicator.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// How many ranks the communicator has.
    pub fn ranks(&self) -> usize {
        self.comm.ranks()
    }

    /// The rank's GPU.
    pub fn backend(&self) -> &CudaBackend {
        &self.backend
    }

    /// The rows of the first pair index this rank holds of a pair tensor of `n` rows.
    pub fn rows(&self, n: usize) -> Result<Range<usize>> {
        crate::plan::shard::row_split(n, self.comm.ranks())?
            .get(self.comm.rank())
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("rank {} of {}", self.comm.rank(), self.comm.ranks())))
    }

    /// Device bytes the workspaces hold.
    pub fn workspace_bytes(&self) -> u64 {
        self.workspaces.iter().map(ShardWorkspace::bytes).sum()
    }

    /// Waits (at most `timeout`, as [`ShardedRank::wait`]) for the last forward, then frees
    /// every workspace; the next forward of each problem plans anew. The workspaces are freed
    /// even where the wait fails (an NCCL error, the deadline: the communicator is then aborted,
    /// which ends its waiting kernels), and that error is returned.
    pub fn release_workspaces(&mut self, timeout: Duration) -> Result<()> {
        let waited = if self.comm.is_aborted() { Ok(()) } else { self.wait(timeout) };
        self.workspaces.clear();
        self.last = None;
        waited
    }

    /// The workspace of `problem`, made now if this rank has none yet; its index. With `agree`
    /// the ranks first agree, in one small all-reduce, on the smallest of their budgets (so that
    /// they plan alike) and on whether any of them cannot plan (then every rank fails here,
    /// before any exchange of the forward): every rank must then make the same call.
    fn workspace_for(&mut self, prepared: &CudaPrepared, problem: &Problem, agree: bool) -> Result<usize> {
        if let Some(i) = self.workspaces.iter().position(|w| w.problem() == problem) {
            return Ok(i);
        }
        let (rank, ranks) = (self.comm.rank(), self.comm.ranks());
        let mine = self.backend.shard_budget(prepared, problem, ranks, self.options);
        let budget = if agree {
            let values = [*mine.as_ref().unwrap_or(&0), u64::from(mine.is_err())];
            self.backend.bind_to_thread()?;
            let ([budget, _], [_, failed]) =
                min_max_over_ranks(&mut self.comm, &mut self.agree, values, self.backend.stream())?;
            let mine = mine?;
            if failed != 0 {
                return Err(Error::InvalidArgument(format!(
                    "another rank could not plan its workspace of this problem (that rank raised the reason); \
                     no rank runs it (rank {rank} had {} free for it)",
                    crate::units::fmt_bytes(mine)
                )));
            }
            budget
        } else {
            mine?
        };
        let ws = self.backend.shard_workspace_within(prepared, problem, rank, ranks, self.options, budget)?;
        self.workspaces.push(ws);
        Ok(self.workspaces.len() - 1)
    }

    /// The plan of this rank's part of `problem` (planned now if it has not run yet: then, as a
    /// forward's, a collective call every rank makes).
    pub fn plan_for(&mut self, layer: &Layer<CudaBackend>, problem: &Problem) -> Result<&RankPlan> {
        self.check_layer(layer)?;
        let i = self.workspace_for(layer.prepared(), problem, true)?;
        Ok(self.workspaces[i].plan())
    }

    fn check_layer(&self, layer: &Layer<CudaBackend>) -> Result<()> {
        if layer.backend().ordinal() != self.comm.device() {
            return Err(Error::InvalidArgument(format!(
                "the layer's weights are on GPU {}, rank {}'s communicator on GPU {}",
                layer.backend().ordinal(),
                self.comm.rank(),
                self.comm.device()
            )));
        }
        Ok(())
    }

    /// Enqueues this rank's part of the forward of `problem` (the global problem: every row;
    /// [`Layer::problem`] gives it, direction and eps the layer's) with `layer`'s weights on
    /// `stream`, a `CUstream` of the rank's GPU as the one-GPU device API takes it (0 is the
    /// legacy default stream, PyTorch's default one), planning the shape's workspace on its
    /// first use. Every rank of the communicator must enqueue the same
    /// forwards (same shapes, same order), each rank from its own thread or process.
    ///
    /// # Safety
    /// As [`ShardedLayer::forward_device`]: `x` and `y` hold the rank's rows of the problem
    /// (`[B, r1 − r0, N, C]` in its I/O precision; equal when it is in place, else not
    /// overlapping), `mask` its rows of the mask (`[B, r1 − r0, N]` f32, or 0 unmasked), device
    /// allocations on this rank's GPU alive until `stream` has run the forward.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn forward_layer(
        &mut self,
        layer: &Layer<CudaBackend>,
        problem: &Problem,
        x: u64,
        mask: u64,
        y: u64,
        stream: u64,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let options = layer.options();
        if (problem.direction, problem.eps) != (options.direction, options.eps) {
            return Err(Error::InvalidArgument(format!(
                "a problem of direction {} and eps {} for a layer made for {} and {}",
                problem.direction, problem.eps, options.direction, options.eps
            )));
        }
        // SAFETY: this function's contract.
        unsafe { self.forward_prepared(layer.prepared(), problem, x, mask, y, stream as CUstream, true) }
    }

    /// As [`ShardedRank::forward_layer`], with weights prepared on this rank's GPU; `agree`: a
    /// workspace made now is planned within a budget the ranks agree on (see
    /// [`ShardedRank::workspace_for`]).
    #[allow(clippy::too_many_arguments)]
    unsafe fn forward_prepared(
        &mut self,
        prepared: &CudaPrepared,
        problem: &Problem,
        x: u64,
        mask: u64,
        y: u64,
        stream: CUstream,
        agree: bool,
    ) -> Result<()> {
        self.comm.check_live()?;
        self.comm.check_stream(stream)?;
        problem.validate()?;
        let i = self.workspace_for(prepared, problem, agree)?;
        self.backend.bind_to_thread()?;
        if let Some(last) = self.last.filter(|&l| l != i) {
            self.workspaces[last].order_before(stream)?;
        }
        // SAFETY: the caller's contract; the workspace is this rank's for `problem`.
        let enqueued = unsafe {
            self.backend.enqueue_shard(prepared, &mut self.workspaces[i], &mut self.comm, x, mask, y, stream)
        };
        // The last forward is the last one that enqueued work (a call refused before its first
        // launch leaves the one before it the last, to wait for and to order after).
        if enqueued.is_ok() || self.workspaces[i].failed_after_launch() {
            self.last = Some(i);
        }
        enqueued
    }

    /// Waits for this rank's last forward, at most `timeout`. NCCL has no deadline for enqueued
    /// exchanges: a peer that failed or stopped leaves this rank's exchanges waiting on the GPU
    /// forever. If NCCL reports an error or the time runs out, this rank's communicator is
    /// aborted (its waiting exchanges end) and the error returned; the rank refuses further
    /// forwards.
    ///
    /// Only once the ranks have exchanged before (NCCL 2.22 and later connect in the first
    /// exchange, on the host) does a lost peer show here. A peer lost before that blocks the
    /// first forward's enqueueing itself on a blocking communicator ([`Communicator::join`]);
    /// on one joined with a deadline ([`Communicator::join_within`]) that forward fails after
    /// the deadline instead.
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            match self.progress() {
                Ok(true) => return Ok(()),
                Ok(false) if start.elapsed() < timeout => std::thread::sleep(Duration::from_micros(100)),
                Ok(false) => {
                    self.comm.abort();
                    return Err(lost_peer(&[self.comm.rank()], timeout));
                }
                Err(e) => {
                    self.comm.abort();
                    return Err(e);
                }
            }
        }
    }

    /// Whether the last forward has finished (each forward waits for the one before, so every
    /// earlier one has too); an error where NCCL or the GPU reports one.
    fn progress(&self) -> Result<bool> {
        self.comm.async_error()?;
        match self.last {
            Some(i) => self.workspaces[i].forward_finished(),
            None => Ok(true),
        }
    }

    /// Whether the last forward got as far as an exchange before it failed or finished.
    fn exchange_started(&self) -> bool {
        self.last.is_some_and(|i| self.workspaces[i].exchange_started())
    }
}

/// One rank of a sharded forward of one problem with one set of weights: a [`ShardedRank`] with
/// its weights prepared, and device buffers of the rank's rows for the host path.
pub struct ShardedLayer {
    rank: ShardedRank,
    prepared: CudaPrepared,
    /// The index of the problem's workspace in `rank`.
    ws: usize,
    /// The host path's device copies of the rank's x, mask and y, kept across calls.
    io: Option<RankBuffers>,
    /// Whether x (and the mask) have been uploaded into `io`.
    uploaded: bool,
    /// The events around the last timed forward.
    timed: Option<EventPair>,
}

struct RankBuffers {
    x: DeviceBuffer<u8>,
    mask: Option<DeviceBuffer<f32>>,
    y: Option<DeviceBuffer<u8>>,
}

impl RankBuffers {
    /// The device buffers of `positions` of `problem`'s x, mask and y (none for y in place).
    fn alloc(backend: &CudaBackend, problem: &Problem, positions: usize) -> Result<Self> {
        let bytes = positions * problem.config.c * problem.io.io_bytes();
        Ok(RankBuffers {
            x: backend.alloc_buffer(bytes)?,
            mask: if problem.masked { Some(backend.alloc_buffer(positions)?) } else { None },
            y: if problem.in_place { None } else { Some(backend.alloc_buffer(bytes)?) },
        })
    }
}

impl ShardedLayer {
    /// Rank `comm.rank()` of a sharded forward of `problem` (the global problem: every row),
    /// on the GPU the communicator is bound to, with `weights` prepared there. Its plan fits
    /// the memory free now: allocate the rank's x, mask and y first (or use
    /// [`ShardedLayer::for_uploads`], whose buffers come first).
    pub fn new(weights: &Weights, problem: &Problem, comm: Communicator) -> Result<Self> {
        Self::with_options(weights, problem, comm, ShardOptions::default())
    }

    /// As [`ShardedLayer::new`], with the plan's choices `options` fixed instead of left to
    /// memory (every rank must be given the same).
    pub fn with_options(
        weights: &Weights,
        problem: &Problem,
        comm: Communicator,
        options: ShardOptions,
    ) -> Result<Self> {
        Self::build(weights, problem, comm, options, false)
    }

    /// As [`ShardedLayer::with_options`] for the host path ([`ShardedLayer::upload`],
    /// [`ShardedLayer::download`]): the device buffers of the rank's x, mask and y are allocated
    /// before the workspace is planned around them.
    pub fn for_uploads(
        weights: &Weights,
        problem: &Problem,
        comm: Communicator,
        options: ShardOptions,
    ) -> Result<Self> {
        Self::build(weights, problem, comm, options, true)
    }

    fn build(
        weights: &Weights,
        problem: &Problem,
        comm: Communicator,
        options: ShardOptions,
        host_io: bool,
    ) -> Result<Self> {
        problem.validate()?;
        let mut rank = ShardedRank::with_options(comm, options)?;
        let prepared = rank.backend.prepare(weights)?;
        let io = if host_io {
            let rows = rank.rows(problem.shape.n)?;
            Some(RankBuffers::alloc(&rank.backend, problem, problem.shape.batch * rows.len() * problem.shape.n)?)
        } else {
            None
        };
        // Planned on each rank's own (`ShardedGroup` builds its ranks one after another in one
        // thread, and re-plans them alike where they differ).
        let ws = rank.workspace_for(&prepared, problem, false)?;
        Ok(ShardedLayer { rank, prepared, ws, io, uploaded: false, timed: None })
    }

    fn workspace(&self) -> &ShardWorkspace {
        &self.rank.workspaces[self.ws]
    }

    /// The rank's plan: its hidden passes, steps and buffers.
    pub fn plan(&self) -> &RankPlan {
        self.workspace().plan()
    }

    /// The rows of the first pair index this rank holds.
    pub fn rows(&self) -> Range<usize> {
        self.workspace().rows()
    }

    /// The global problem.
    pub fn problem(&self) -> &Problem {
        self.workspace().problem()
    }

    /// The rank's GPU.
    pub fn backend(&self) -> &CudaBackend {
        &self.rank.backend
    }

    /// Elements of this rank's x (and y): `B·(r1 − r0)·N·C`.
    pub fn x_len(&self) -> usize {
        self.mask_len() * self.problem().config.c
    }

    /// Elements of this rank's mask: `B·(r1 − r0)·N`.
    pub fn mask_len(&self) -> usize {
        let p = self.problem();
        p.shape.batch * self.rows().len() * p.shape.n
    }

    /// Enqueues this rank's forward on `stream` (0: the backend's own stream). Every rank of
    /// the communicator must enqueue the same forwards in the same order, each rank from its
    /// own thread (NCCL's rule for blocking communicators: one thread enqueueing for several
    /// ranks would block in the first exchange). Consecutive forwards are ordered even on
    /// different streams.
    ///
    /// # Safety
    /// `x` and `y` are device allocations of [`ShardedLayer::x_len`] elements in the problem's
    /// I/O precision on this rank's GPU (equal when the problem is in place, else not
    /// overlapping), `mask` of [`ShardedLayer::mask_len`] f32 (or 0 unmasked), alive until the
    /// stream has run the forward.
    pub unsafe fn forward_device(&mut self, x: u64, mask: u64, y: u64, stream: u64) -> Result<()> {
        let problem = *self.problem();
        let stream = if stream == 0 { self.rank.backend.stream() } else { stream as CUstream };
        // SAFETY: this function's contract.
        unsafe { self.rank.forward_prepared(&self.prepared, &problem, x, mask, y, stream, false) }
    }

    /// Uploads this rank's rows of x (f32, rounded to the problem's I/O precision) and mask to
    /// device buffers kept for the next calls.
    pub fn upload(&mut self, x: &[f32], mask: Option<&[f32]>) -> Result<()> {
        as_words(x, self.problem().io, |w| self.upload_words(w, mask))
    }

    /// As [`ShardedLayer::upload`], x as the I/O precision holds it (f32 values, or the bits of
    /// bf16 or f16 ones).
    pub fn upload_words(&mut self, x: HostWords<'_>, mask: Option<&[f32]>) -> Result<()> {
        let (x_len, mask_len) = (self.x_len(), self.mask_len());
        self.check_upload(&x, x_len, mask, mask_len)?;
        self.ensure_buffers()?;
        self.uploaded = false;
        let stream = self.rank.backend.stream();
        let io = self.io.as_mut().ok_or_else(|| Error::Internal("no device buffers".into()))?;
        // SAFETY: the host slices outlive the copies: the stream is synchronised below.
        unsafe {
            io.x.upload_host_at(0, x, stream)?;
            if let (Some(buf), Some(m)) = (io.mask.as_mut(), mask) {
                buf.upload_host_at(0, HostWords::F32(m), stream)?;
            }
        }
        self.rank.backend.synchronize()?;
        self.uploaded = true;
        Ok(())
    }

    fn check_upload(&self, x: &HostWords<'_>, x_len: usize, mask: Option<&[f32]>, mask_len: usize) -> Result<()> {
        let problem = self.problem();
        let rank = self.rank.rank();
        let (len, half) = match x {
            HostWords::F32(v) => (v.len(), false),
            HostWords::Half(v) => (v.len(), true),
        };
        if half == (problem.io == Precision::F32Io) {
            return Err(Error::InvalidArgument(format!(
                "x as {} words for a problem of {} I/O",
                if half { "16-bit" } else { "f32" },
                problem.io
            )));
        }
        if len != x_len {
            return Err(Error::Shape(format!("rank {rank} holds {x_len} elements of x, {len} given")));
        }
        match mask {
            Some(m) if !problem.masked => {
                Err(Error::InvalidArgument(format!("a mask of {} elements for an unmasked problem", m.len())))
            }
            Some(m) if m.len() != mask_len => {
                Err(Error::Shape(format!("rank {rank} holds {mask_len} mask elements, {} given", m.len())))
            }
            None if problem.masked => Err(Error::InvalidArgument("the problem is masked; no mask given".into())),
            _ => Ok(()),
        }
    }

    /// The host path's device buffers of the rank's x, mask and y (allocated once).
    fn ensure_buffers(&mut self) -> Result<()> {
        if self.io.is_none() {
            self.io = Some(RankBuffers::alloc(&self.rank.backend, self.problem(), self.mask_len())?);
        }
        Ok(())
    }

    /// The forward of the rows [`ShardedLayer::upload`] put on the device (in place: over them).
    pub fn forward_uploaded(&mut self) -> Result<()> {
        let io = self
            .io
            .as_ref()
            .filter(|_| self.uploaded)
            .ok_or_else(|| Error::InvalidArgument("no rows uploaded".into()))?;
        let (x, mask) = (io.x.ptr(), io.mask.as_ref().map_or(0, |m| m.ptr()));
        let y = io.y.as_ref().map_or(x, |y| y.ptr());
        // SAFETY: the buffers were sized for this rank's rows and live in `self`.
        unsafe { self.forward_device(x, mask, y, 0) }
    }

    /// Waits for the forward and returns this rank's rows of y as f32.
    pub fn download(&self) -> Result<Vec<f32>> {
        self.download_positions(0..self.mask_len())
    }

    /// Waits for the forward and returns y at this rank's local positions `positions` (its
    /// rows one after another, `[B, r, N]`), `[positions, C]` as f32.
    pub fn download_positions(&self, positions: Range<usize>) -> Result<Vec<f32>> {
        let io = self
            .io
            .as_ref()
            .filter(|_| self.uploaded)
            .ok_or_else(|| Error::InvalidArgument("no rows uploaded".into()))?;
        if positions.end > self.mask_len() || positions.start > positions.end {
            return Err(Error::Shape(format!("positions {positions:?} of a rank holding {}", self.mask_len())));
        }
        let problem = self.problem();
        let (c, width) = (problem.config.c, problem.io.io_bytes());
        let (offset, len) = ((positions.start * c * width) as u64, positions.len() * c);
        let y = io.y.as_ref().unwrap_or(&io.x);
        let stream = self.rank.backend.stream();
        if problem.io == Precision::F32Io {
            let mut out = vec![0f32; len];
            y.download_host_at(offset, HostWordsMut::F32(&mut out), stream)?;
            Ok(out)
        } else {
            let mut bits = vec![0u16; len];
            y.download_host_at(offset, HostWordsMut::Half(&mut bits), stream)?;
            Ok(bits.par_iter().map(|&b| problem.io.decode_half(b)).collect())
        }
    }

    /// Waits for this rank's last forward, at most `timeout` (see [`ShardedRank::wait`]).
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        self.rank.wait(timeout)
    }

    /// Enqueues the forward of the uploaded rows between two events on this rank's stream
    /// (read with [`ShardedLayer::take_elapsed_ms`]).
    fn forward_uploaded_timed(&mut self) -> Result<()> {
        self.rank.backend.bind_to_thread()?;
        let events = EventPair::new()?;
        events.record_start(self.rank.backend.stream())?;
        self.forward_uploaded()?;
        events.record_stop(self.rank.backend.stream())?;
        self.timed = Some(events);
        Ok(())
    }

    /// Waits for the last timed forward and returns its device milliseconds.
    fn take_elapsed_ms(&mut self) -> Result<f64> {
        self.rank.backend.bind_to_thread()?;
        let events = self.timed.take().ok_or_else(|| Error::Internal("no timed forward to read".into()))?;
        events.elapsed_ms()
    }
}

/// Every rank of a sharded forward on the GPUs of this host, in one process (one thread per
/// GPU while a forward runs).
pub struct ShardedGroup {
    layers: Vec<ShardedLayer>,
    problem: Problem,
    /// How long a forward may take on every rank before a peer counts as lost.
    timeout: Duration,
}

/// How long [`ShardedGroup`] and [`ShardedLayer::wait`] wait by default for a forward before a
/// peer counts as lost (N = 16384 takes about 1.5 s on two GPUs).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl ShardedGroup {
    /// A sharded forward of `problem` over `gpus` (CUDA device numbers, rank order), with
    /// `weights` prepared on each, each rank's plan the widest that fits its GPU.
    ///
    /// `TRIMUL_SHARD_CHUNK_MATRICES` sets how many of the `B·H` matrices each exchange step moves
    /// (default [`CHUNK_MATRICES`]), to measure others.
    pub fn on_local_gpus(weights: &Weights, problem: &Problem, gpus: &[usize]) -> Result<Self> {
        let chunk = std::env::var("TRIMUL_SHARD_CHUNK_MATRICES")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(CHUNK_MATRICES);
        Self::with_options(weights, problem, gpus, ShardOptions { chunk_matrices: chunk, ..ShardOptions::default() })
    }

    /// As [`ShardedGroup::on_local_gpus`] with the plan's choices `options` fixed (the same
    /// for every rank). Where `options` leaves the pass width to memory and the GPUs' free
    /// memory gives different widths, every rank is planned again with the narrowest.
    pub fn with_options(weights: &Weights, problem: &Problem, gpus: &[usize], options: ShardOptions) -> Result<Self> {
        problem.validate()?;
        let build = |options: ShardOptions| -> Result<Vec<ShardedLayer>> {
            Communicator::for_local_gpus(gpus)?
                .into_iter()
                .map(|comm| ShardedLayer::for_uploads(weights, problem, comm, options))
                .collect()
        };
        let mut layers = build(options)?;
        // Every rank must run the same passes (the exchanges pair up call by call): GPUs with
        // different free memory can plan differently, and then every rank takes the narrowest.
        let narrowest = layers.iter().map(|l| l.plan().pass).min().unwrap_or(0);
        if layers.iter().any(|l| l.plan().pass != narrowest) {
            let options = ShardOptions { hidden_pass: Some(narrowest), ..options };
            drop(layers);
            layers = build(options)?;
        }
        Ok(ShardedGroup { layers, problem: *problem, timeout: DEFAULT_TIMEOUT })
    }

    /// How long a forward may take on every rank before a peer counts as lost
    /// ([`DEFAULT_TIMEOUT`] unless set): then every communicator is aborted and the call waiting
    /// for the forward returns an error instead of hanging.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Waits until every rank's last forward has finished, at most the group's timeout; on an
    /// error or the timeout aborts every communicator and returns the error (see
    /// [`ShardedLayer::wait`]).
    fn wait_for_every_rank(&mut self) -> Result<()> {
        let start = Instant::now();
        let failed = loop {
            let mut waiting = Vec::new();
            let mut error = None;
            for (rank, layer) in self.layers.iter().enumerate() {
                match layer.rank.progress() {
                    Ok(true) => {}
                    Ok(false) => waiting.push(rank),
                    Err(e) => {
                        error = Some(e);
                        break;
                    }
                }
            }
            match error {
                Some(e) => break e,
                None if waiting.is_empty() => return Ok(()),
                None if start.elapsed() >= self.timeout => break lost_peer(&waiting, self.timeout),
                None => std::thread::sleep(Duration::from_micros(100)),
            }
        };
        for layer in &mut self.layers {
            layer.rank.comm.abort();
        }
        Err(failed)
    }

    /// The ranks.
    pub fn layers(&self) -> &[ShardedLayer] {
        &self.layers
    }

    /// Fills every output and intermediate with NaN before each forward, so an element nobody
    /// writes fails a check (see [`CudaBackend::set_poison`]).
    pub fn set_poison(&self, on: bool) {
        for l in &self.layers {
            l.rank.backend.set_poison(on);
        }
    }

    /// Enqueues the forward of the uploaded rows on every rank; on any rank's failure aborts
    /// every communicator (see [`ShardedGroup::forward`]).
    fn enqueue_on_every_rank(&mut self) -> Result<()> {
        self.enqueue_on_every_rank_with(ShardedLayer::forward_uploaded)
    }

    fn enqueue_on_every_rank_with(&mut self, enqueue: fn(&mut ShardedLayer) -> Result<()>) -> Result<()> {
        if let Some(layer) = self.layers.iter().find(|l| l.rank.comm.is_aborted()) {
            return Err(Error::InvalidArgument(format!(
                "this group's communicators were aborted after rank {}'s earlier failure; make a new group",
                layer.rank.rank()
            )));
        }
        if let Some(layer) = self.layers.iter().find(|l| !l.uploaded) {
            return Err(Error::InvalidArgument(format!("rank {} has no rows uploaded", layer.rank.rank())));
        }
        let enqueued = self.on_every_rank(enqueue);
        // A rank that failed before its first exchange leaves nobody waiting if every rank
        // did; once any rank has enqueued an exchange, the others would wait for the failed one.
        if enqueued.is_err() && self.layers.iter().any(|l| l.rank.exchange_started()) {
            for layer in &mut self.layers {
                layer.rank.comm.abort();
            }
        }
        enqueued.map(drop)
    }

    /// Uploads each rank's rows of the whole `x` (`[B, N, N, C]` f32) and `mask` (`[B, N, N]`).
    pub fn upload(&mut self, x: &[f32], mask: Option<&[f32]>) -> Result<()> {
        as_words(x, self.problem.io, |w| self.upload_words(w, mask))
    }

    /// As [`ShardedGroup::upload`], the whole x as the I/O precision holds it (f32 values, or
    /// the bits of bf16 or f16 ones): at N = 16384 in bf16, 64 GiB of host memory, which the
    /// f32 form would double.
    pub fn upload_words(&mut self, x: HostWords<'_>, mask: Option<&[f32]>) -> Result<()> {
        let p = self.problem;
        let len = match x {
            HostWords::F32(v) => v.len(),
            HostWords::Half(v) => v.len(),
        };
        if len != p.x_len() {
            return Err(Error::Shape(format!("x has {len} elements, the problem {}", p.x_len())));
        }
        if let Some(m) = mask.filter(|m| m.len() != p.mask_len()) {
            return Err(Error::Shape(format!("the mask has {} elements, the problem {}", m.len(), p.mask_len())));
        }
        let (b, n, c) = (p.shape.batch, p.shape.n, p.config.c);
        for layer in &mut self.layers {
            let rows = layer.rows();
            let span = |bi: usize, width: usize| (bi * n + rows.start) * n * width..(bi * n + rows.end) * n * width;
            if b == 1 {
                // The rank's rows are one contiguous run: no copy.
                let xs = match x {
                    HostWords::F32(v) => HostWords::F32(&v[span(0, c)]),
                    HostWords::Half(v) => HostWords::Half(&v[span(0, c)]),
                };
                layer.upload_words(xs, mask.map(|m| &m[span(0, 1)]))?;
            } else {
                let pick_mask = mask.map(|m| (0..b).flat_map(|bi| m[span(bi, 1)].to_vec()).collect::<Vec<f32>>());
                match x {
                    HostWords::F32(v) => {
                        let xs: Vec<f32> = (0..b).flat_map(|bi| v[span(bi, c)].to_vec()).collect();
                        layer.upload_words(HostWords::F32(&xs), pick_mask.as_deref())?;
                    }
                    HostWords::Half(v) => {
                        let xs: Vec<u16> = (0..b).flat_map(|bi| v[span(bi, c)].to_vec()).collect();
                        layer.upload_words(HostWords::Half(&xs), pick_mask.as_deref())?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The forward of the uploaded rows on every rank, waited for (see
    /// [`ShardedGroup::forward`] and [`ShardedGroup::set_timeout`]).
    pub fn forward_uploaded(&mut self) -> Result<()> {
        self.enqueue_on_every_rank()?;
        self.wait_for_every_rank()
    }

    /// y's row `i` of batch `b` (`[N, C]` f32) after [`ShardedGroup::forward_uploaded`], from
    /// the rank that holds it.
    pub fn y_row(&self, b: usize, i: usize) -> Result<Vec<f32>> {
        let n = self.problem.shape.n;
        if b >= self.problem.shape.batch || i >= n {
            return Err(Error::Shape(format!("row {i} of batch {b} of B = {}, N = {n}", self.problem.shape.batch)));
        }
        let layer = self
            .layers
            .iter()
            .find(|l| l.rows().contains(&i))
            .ok_or_else(|| Error::Internal(format!("no rank holds row {i}")))?;
        let rows = layer.rows();
        let first = (b * rows.len() + i - rows.start) * n;
        layer.download_positions(first..first + n)
    }

    /// One forward of the whole x and mask; returns the whole y (`[B, N, N, C]` f32, rounded
    /// to the problem's I/O precision).
    ///
    /// Everything that can fail on one rank alone (shapes, uploads, memory) happens before
    /// any rank enqueues an exchange. If a rank still fails while enqueueing, every
    /// communicator is aborted before anyone waits, so the error comes back instead of a
    /// hang, and the group refuses further forwards.
    pub fn forward(&mut self, x: &[f32], mask: Option<&[f32]>) -> Result<Vec<f32>> {
        self.upload(x, mask)?;
        self.enqueue_on_every_rank()?;
        self.wait_for_every_rank()?;
        let parts = self.on_every_rank(|layer| layer.download())?;
        let p = self.problem;
        let (b, n, c) = (p.shape.batch, p.shape.n, p.config.c);
        let mut y = vec![0f32; p.x_len()];
        for (layer, part) in self.layers.iter().zip(parts) {
            let rows = layer.rows();
            let per_batch = rows.len() * n * c;
            for bi in 0..b {
                let at = (bi * n + rows.start) * n * c;
                y[at..at + per_batch].copy_from_slice(&part[bi * per_batch..(bi + 1) * per_batch]);
            }
        }
        Ok(y)
    }

    /// Times the forward of the uploaded rows: per call, the longest of the ranks' device times
    /// (each from its own start to its own end; the exchanges tie them together), after
    /// `warmup` untimed calls. Each call is enqueued on every rank, then waited for.
    pub fn time(&mut self, warmup: usize, repeats: usize) -> Result<Vec<f64>> {
        let mut out = Vec::with_capacity(repeats);
        for call in 0..warmup + repeats {
            self.enqueue_on_every_rank_with(ShardedLayer::forward_uploaded_timed)?;
            self.wait_for_every_rank()?;
            let ms = self.on_every_rank(ShardedLayer::take_elapsed_ms)?;
            if call >= warmup {
                out.push(ms.into_iter().fold(0.0, f64::max));
            }
        }
        Ok(out)
    }

    /// One forward of the uploaded rows with a per-stage timeline on every rank (device
    /// events): each rank's stages and their milliseconds.
    pub fn stage_times(&mut self) -> Result<Vec<Vec<(String, f64)>>> {
        for layer in &self.layers {
            layer.rank.backend.record_stages();
        }
        self.enqueue_on_every_rank()?;
        self.wait_for_every_rank()?;
        self.on_every_rank(|layer| layer.rank.backend.stage_times())
    }

    /// Runs `work` on every rank at once, one thread each (NCCL needs every rank enqueueing
    /// its part of an exchange together), and returns the ranks' results in order, or the first
    /// rank's error.
    fn on_every_rank<T: Send>(&mut self, work: impl Fn(&mut ShardedLayer) -> Result<T> + Sync) -> Result<Vec<T>> {
        let results: Vec<Result<T>> = std::thread::scope(|s| {
            let handles: Vec<_> = self.layers.iter_mut().map(|layer| s.spawn(|| work(layer))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a rank's thread panicked".into()))))
                .collect()
        });
        results.into_iter().collect()
    }
}

/// `x` as `io` holds it, handed to `f`: as it is for f32 I/O, else its 16-bit words.
fn as_words<R>(x: &[f32], io: Precision, f: impl FnOnce(HostWords<'_>) -> R) -> R {
    if io == Precision::F32Io {
        f(HostWords::F32(x))
    } else {
        let bits: Vec<u16> = x.par_iter().map(|&v| io.encode_half(v)).collect();
        f(HostWords::Half(&bits))
    }
}

/// The error of a forward that had not finished within `timeout` on the ranks `waiting`.
fn lost_peer(waiting: &[usize], timeout: Duration) -> Error {
    let ranks: Vec<String> = waiting.iter().map(usize::to_string).collect();
    Error::driver(
        BackendKind::Cuda,
        "the sharded forward's exchanges",
        format!(
            "rank{} {} had not finished after {:.1} s: a peer failed or stopped; the communicators were aborted",
            if waiting.len() == 1 { "" } else { "s" },
            ranks.join(", "),
            timeout.as_secs_f64()
        ),
    )
}

/// Test support: enqueues the uploaded rows' forward on every rank but `lost`, as if that
/// rank's process had died, then waits as [`ShardedGroup::forward_uploaded`] does.
#[doc(hidden)]
impl ShardedGroup {
    pub fn forward_losing_rank(&mut self, lost: usize) -> Result<()> {
        let enqueued: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .layers
                .iter_mut()
                .enumerate()
                .filter(|(rank, _)| *rank != lost)
                .map(|(_, layer)| s.spawn(move || layer.forward_uploaded()))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(Error::Internal("a rank's thread panicked".into()))))
                .collect()
        });
        enqueued.into_iter().collect::<Result<Vec<()>>>()?;
        self.wait_for_every_rank()
    }
}
