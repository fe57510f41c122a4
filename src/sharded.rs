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

use rayon::prelude::*;

use crate::backend::cuda::{CudaBackend, CudaPrepared, DeviceBuffer, EventPair, ShardWorkspace};
use crate::backend::Backend;
use crate::collective::Communicator;
use crate::error::{Error, Result};
use crate::plan::shard::CHUNK_MATRICES;
use crate::problem::{Precision, Problem};
use crate::weights::Weights;

/// One rank of a sharded forward: its GPU, the prepared weights and its workspace.
pub struct ShardedLayer {
    backend: CudaBackend,
    prepared: CudaPrepared,
    ws: ShardWorkspace,
    comm: Communicator,
    /// The host path's device copies of the rank's x, mask and y, kept across calls.
    io: Option<RankBuffers>,
    /// The events around the last timed forward.
    timed: Option<EventPair>,
}

struct RankBuffers {
    x: DeviceBuffer<u8>,
    mask: Option<DeviceBuffer<f32>>,
    y: Option<DeviceBuffer<u8>>,
}

impl ShardedLayer {
    /// Rank `comm.rank()` of a sharded forward of `problem` (the global problem: every row),
    /// on the GPU the communicator is bound to, with `weights` prepared there.
    pub fn new(weights: &Weights, problem: &Problem, comm: Communicator) -> Result<Self> {
        Self::with_chunk_matrices(weights, problem, comm, CHUNK_MATRICES)
    }

    /// As [`ShardedLayer::new`], the contraction's exchanges in chunks of `chunk_matrices` of
    /// the `B·H` matrices (every rank must use the same number).
    pub fn with_chunk_matrices(
        weights: &Weights,
        problem: &Problem,
        comm: Communicator,
        chunk_matrices: usize,
    ) -> Result<Self> {
        let backend = CudaBackend::new(comm.device())?;
        let prepared = backend.prepare(weights)?;
        let ws = backend.shard_workspace(&prepared, problem, comm.rank(), comm.ranks(), chunk_matrices)?;
        Ok(ShardedLayer { backend, prepared, ws, comm, io: None, timed: None })
    }

    /// The rows of the first pair index this rank holds.
    pub fn rows(&self) -> Range<usize> {
        self.ws.rows()
    }

    /// The global problem.
    pub fn problem(&self) -> &Problem {
        self.ws.problem()
    }

    /// The rank's GPU.
    pub fn backend(&self) -> &CudaBackend {
        &self.backend
    }

    /// Elements of this rank's x (and y): `B·(r1 − r0)·N·C`.
    pub fn x_len(&self) -> usize {
        let p = self.ws.problem();
        p.shape.batch * self.rows().len() * p.shape.n * p.config.c
    }

    /// Elements of this rank's mask: `B·(r1 − r0)·N`.
    pub fn mask_len(&self) -> usize {
        let p = self.ws.problem();
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
        let stream = if stream == 0 { self.backend.stream() } else { stream as cudarc::driver::sys::CUstream };
        self.backend.enqueue_shard(&self.prepared, &mut self.ws, &mut self.comm, x, mask, y, stream)
    }

    /// Uploads this rank's rows of x (f32, rounded to the problem's I/O precision) and mask to
    /// device buffers kept for the next calls.
    pub fn upload(&mut self, x: &[f32], mask: Option<&[f32]>) -> Result<()> {
        let (x_len, mask_len) = (self.x_len(), self.mask_len());
        let problem = *self.ws.problem();
        if x.len() != x_len {
            return Err(Error::Shape(format!(
                "rank {} holds {x_len} elements of x, {} given",
                self.comm.rank(),
                x.len()
            )));
        }
        match mask {
            Some(m) if !problem.masked => {
                return Err(Error::InvalidArgument(format!("a mask of {} elements for an unmasked problem", m.len())))
            }
            Some(m) if m.len() != mask_len => {
                return Err(Error::Shape(format!(
                    "rank {} holds {mask_len} mask elements, {} given",
                    self.comm.rank(),
                    m.len()
                )))
            }
            None if problem.masked => {
                return Err(Error::InvalidArgument("the problem is masked; no mask given".into()))
            }
            _ => {}
        }
        let stream = self.backend.stream();
        let bytes = encode(x, problem.io);
        let io = match self.io.take() {
            Some(io) => io,
            None => RankBuffers {
                x: self.backend.alloc_buffer(bytes.len())?,
                mask: if problem.masked { Some(self.backend.alloc_buffer(mask_len)?) } else { None },
                y: if problem.in_place { None } else { Some(self.backend.alloc_buffer(bytes.len())?) },
            },
        };
        let io = self.io.insert(io);
        io.x.upload(&bytes, stream)?;
        if let (Some(buf), Some(m)) = (io.mask.as_mut(), mask) {
            buf.upload(m, stream)?;
        }
        Ok(())
    }

    /// The forward of the rows [`ShardedLayer::upload`] put on the device (in place: over them).
    pub fn forward_uploaded(&mut self) -> Result<()> {
        let io = self.io.as_ref().ok_or_else(|| Error::InvalidArgument("no rows uploaded".into()))?;
        let (x, mask) = (io.x.ptr(), io.mask.as_ref().map_or(0, |m| m.ptr()));
        let y = io.y.as_ref().map_or(x, |y| y.ptr());
        // SAFETY: the buffers were sized for this rank's rows in `upload` and live in `self`.
        unsafe { self.forward_device(x, mask, y, 0) }
    }

    /// Waits for the forward and returns this rank's rows of y as f32.
    pub fn download(&self) -> Result<Vec<f32>> {
        let io = self.io.as_ref().ok_or_else(|| Error::InvalidArgument("no rows uploaded".into()))?;
        let mut bytes = vec![0u8; io.x.len()];
        io.y.as_ref().unwrap_or(&io.x).download(&mut bytes, self.backend.stream())?;
        Ok(decode(&bytes, self.ws.problem().io))
    }

    /// Enqueues the forward of the uploaded rows between two events on this rank's stream
    /// (read with [`ShardedLayer::take_elapsed_ms`]).
    fn forward_uploaded_timed(&mut self) -> Result<()> {
        self.backend.bind_to_thread()?;
        let events = EventPair::new()?;
        events.record_start(self.backend.stream())?;
        self.forward_uploaded()?;
        events.record_stop(self.backend.stream())?;
        self.timed = Some(events);
        Ok(())
    }

    /// Waits for the last timed forward and returns its device milliseconds.
    fn take_elapsed_ms(&mut self) -> Result<f64> {
        self.backend.bind_to_thread()?;
        let events = self.timed.take().ok_or_else(|| Error::Internal("no timed forward to read".into()))?;
        events.elapsed_ms()
    }
}

fn encode(x: &[f32], io: Precision) -> Vec<u8> {
    let width = io.io_bytes();
    let mut out = vec![0u8; x.len() * width];
    out.par_chunks_mut(width).zip(x.par_iter()).for_each(|(o, &v)| match io {
        Precision::F32Io => o.copy_from_slice(&v.to_le_bytes()),
        _ => o.copy_from_slice(&io.encode_half(v).to_le_bytes()),
    });
    out
}

fn decode(bytes: &[u8], io: Precision) -> Vec<f32> {
    bytes
        .par_chunks_exact(io.io_bytes())
        .map(|b| match io {
            Precision::F32Io => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            _ => io.decode_half(u16::from_le_bytes([b[0], b[1]])),
        })
        .collect()
}

/// Every rank of a sharded forward on the GPUs of this host, in one process (one thread per
/// GPU while a forward runs).
pub struct ShardedGroup {
    layers: Vec<ShardedLayer>,
    problem: Problem,
}

impl ShardedGroup {
    /// A sharded forward of `problem` over `gpus` (CUDA device numbers, rank order), with
    /// `weights` prepared on each.
    ///
    /// `TRIMUL_SHARD_CHUNK_MATRICES` sets how many of the `B·H` matrices each exchange step moves
    /// (default [`CHUNK_MATRICES`]), to measure others.
    pub fn on_local_gpus(weights: &Weights, problem: &Problem, gpus: &[usize]) -> Result<Self> {
        problem.validate()?;
        let chunk = std::env::var("TRIMUL_SHARD_CHUNK_MATRICES")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(CHUNK_MATRICES);
        let comms = Communicator::for_local_gpus(gpus)?;
        let layers = comms
            .into_iter()
            .map(|comm| ShardedLayer::with_chunk_matrices(weights, problem, comm, chunk))
            .collect::<Result<_>>()?;
        Ok(ShardedGroup { layers, problem: *problem })
    }

    /// The ranks.
    pub fn layers(&self) -> &[ShardedLayer] {
        &self.layers
    }

    /// Fills every output and intermediate with NaN before each forward, so an element nobody
    /// writes fails a check (see [`CudaBackend::set_poison`]).
    pub fn set_poison(&self, on: bool) {
        for l in &self.layers {
            l.backend.set_poison(on);
        }
    }

    /// Enqueues the forward of the uploaded rows on every rank; on any rank's failure aborts
    /// every communicator (see [`ShardedGroup::forward`]).
    fn enqueue_on_every_rank(&mut self) -> Result<()> {
        self.enqueue_on_every_rank_with(ShardedLayer::forward_uploaded)
    }

    fn enqueue_on_every_rank_with(&mut self, enqueue: fn(&mut ShardedLayer) -> Result<()>) -> Result<()> {
        if let Some(layer) = self.layers.iter().find(|l| l.comm.is_aborted()) {
            return Err(Error::InvalidArgument(format!(
                "this group's communicators were aborted after rank {}'s earlier failure; make a new group",
                layer.comm.rank()
            )));
        }
        if let Some(layer) = self.layers.iter().find(|l| l.io.is_none()) {
            return Err(Error::InvalidArgument(format!("rank {} has no rows uploaded", layer.comm.rank())));
        }
        let enqueued = self.on_every_rank(enqueue);
        // A rank that failed before its first exchange leaves nobody waiting if every rank
        // did; once any rank has enqueued an exchange, the others would wait for the failed one.
        if enqueued.is_err() && self.layers.iter().any(|l| l.ws.exchange_started()) {
            for layer in &mut self.layers {
                layer.comm.abort();
            }
        }
        enqueued.map(drop)
    }

    /// Uploads each rank's rows of the whole `x` (`[B, N, N, C]` f32) and `mask` (`[B, N, N]`).
    pub fn upload(&mut self, x: &[f32], mask: Option<&[f32]>) -> Result<()> {
        let p = self.problem;
        if x.len() != p.x_len() {
            return Err(Error::Shape(format!("x has {} elements, the problem {}", x.len(), p.x_len())));
        }
        if let Some(m) = mask.filter(|m| m.len() != p.mask_len()) {
            return Err(Error::Shape(format!("the mask has {} elements, the problem {}", m.len(), p.mask_len())));
        }
        let (b, n, c) = (p.shape.batch, p.shape.n, p.config.c);
        for layer in &mut self.layers {
            let rows = layer.rows();
            let pick = |v: &[f32], width: usize| -> Vec<f32> {
                (0..b)
                    .flat_map(|bi| {
                        v[(bi * n + rows.start) * n * width..(bi * n + rows.end) * n * width].iter().copied()
                    })
                    .collect()
            };
            layer.upload(&pick(x, c), mask.map(|m| pick(m, 1)).as_deref())?;
        }
        Ok(())
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
            layer.backend.record_stages();
        }
        self.enqueue_on_every_rank()?;
        self.on_every_rank(|layer| layer.backend.stage_times())
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
