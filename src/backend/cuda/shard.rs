//! One rank's forward on a row-sharded pair tensor (issue 29; `plan::shard` has the layout, the
//! exchanges and the memory arithmetic, `collective` the communicator).
//!
//! The rank holds rows `[r0, r1)` of x and y for every batch, `[B, r1 − r0, N, C]`, and keeps
//! only those rows of each `N × N` matrix of left, right and t (the kernels' `mat_rows`, their
//! pointers moved back by `r0·N` elements so that they still index by global position). Its
//! input and output stages are the one-pass forward's fused kernels over its own positions (per
//! batch, the positions `(b·N + r0)·N .. (b·N + r1)·N`). Per hidden pass ([`RankPlan`]), the
//! input stage makes left and right of the pass's channels, and the contraction runs in steps of
//! matrices so that the exchanges (NCCL, on a second stream) run under GEMMs:
//!
//! - **outgoing**: each rank broadcasts its rows of right, one call per step and rank, into the
//!   others' exchange buffers; the compute stream first runs every step's GEMM of the rank's own
//!   column block (no exchange needed), then each step's peer blocks once its broadcast is done.
//! - **incoming**: per step, the partial t over the rank's rows of the contracted index, its own
//!   row block straight into its t and each peer's into the exchange buffer; each block is then
//!   summed into its owner's t (an f16 reduction: one more rounding per rank than on one GPU)
//!   under the next step's GEMMs.
//!
//! The output stage reads the gate the last pass stored, or, where the plan has no room for it,
//! makes the gate from x per row chunk first (the chunked plan's way).
//!
//! Consecutive forwards on one workspace are ordered even on different streams: each waits for
//! the previous one's end. Every rank must enqueue the same forwards in the same order, each
//! rank from its own thread (NCCL: one thread driving several ranks would have to group their
//! calls together).
//!
//! The kernels address x, the mask and y by global position too; the rank's buffers hold only
//! its rows, so each batch's launch gets base addresses moved back by the positions before its
//! first own one (wrapping arithmetic: the kernels only form addresses of positions in the
//! launch, which are inside the rank's buffers).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys::{self as cusys, CUdeviceptr, CUevent, CUstream};
use cudarc::driver::CudaStream;

use super::blas::{Elem, MatmulPlan};
use super::context::{CudaBackend, MAX_GEMM_WORKSPACE, POISON_BYTE};
use super::driver::{DeviceBuffer, DriverResult};
use super::workspace::CudaPrepared;
use crate::backend::check_prepared_for;
use crate::backend::gemm::GemmSpec;
use crate::backend::params::{to_i32, Addresses, CommonParams, InputParams, OutputParams};
use crate::collective::{Communicator, Transfer};
use crate::error::{BackendKind, Error, Result};
use crate::plan::budget::margin;
use crate::plan::shard::{RankPlan, ShardOptions, Step};
use crate::problem::{Direction, Problem};

/// Device memory a rank keeps free besides the plan's buffers, the cuBLASLt workspace and
/// [`margin`]: NCCL's own buffers, allocated on its first exchange.
const NCCL_RESERVE: u64 = 1 << 30;

/// The buffers, GEMM plans, second stream and events of one rank's sharded forward of one
/// problem. Made by [`CudaBackend::shard_workspace`].
pub struct ShardWorkspace {
    problem: Problem,
    plan: RankPlan,
    /// The pass's rows of left and right, `[B, hc, r, N]` each.
    left: DeviceBuffer<u16>,
    right: DeviceBuffer<u16>,
    /// Per other rank, its rows of the pass's matrices: right (outgoing) or this rank's partial
    /// sums of them (incoming).
    exchange: DeviceBuffer<u16>,
    /// The rank's rows of t, every channel, `[B, H, r, N]`.
    t: DeviceBuffer<u16>,
    /// The gate of every own position, or of one output chunk.
    gate: DeviceBuffer<u16>,
    gemm_ws: DeviceBuffer<u8>,
    /// One plan per distinct step GEMM: `(spec, alignment)`.
    gemms: HashMap<(GemmSpec, u32), MatmulPlan>,
    exchange_stream: Arc<CudaStream>,
    /// One event per step of a pass, "the pass's input stage is done", "the pass's exchanges
    /// are done" and the forward's end (the next forward's stream waits for it).
    step_done: Vec<CUevent>,
    input_done: CUevent,
    pass_exchanged: CUevent,
    forward_done: CUevent,
    /// Whether the current forward has enqueued an exchange: a failure after that leaves the
    /// peers waiting for this rank (`sharded::ShardedGroup` then aborts the communicators).
    exchanged: bool,
    /// Whether the last forward failed after its first launch (its end event then marks where
    /// its enqueued work ends, and waiting for it is an error).
    failed: bool,
    /// Whether the ranks have checked, at this workspace's first forward, that they planned
    /// the same passes and steps; and the 3 × [`AGREE`] u64 that check reduces.
    agreed: bool,
    agree: DeviceBuffer<u64>,
}

/// How many u64 the ranks reduce when they agree on something: a plan's pass width and
/// exchange step (the exchanges pair up call by call), or a new workspace's budget and whether
/// any rank failed to plan it. [`min_max_over_ranks`] takes a buffer of 3 × `AGREE`.
pub(crate) const AGREE: usize = 2;

/// Every rank's `values`, reduced to their element-wise minimum and maximum through `buf` (3 ×
/// [`AGREE`] u64 on this rank's device) on `stream`, waited for: a collective call that every
/// rank of `comm` makes.
pub(crate) fn min_max_over_ranks(
    comm: &mut Communicator,
    buf: &mut DeviceBuffer<u64>,
    values: [u64; AGREE],
    stream: CUstream,
) -> Result<([u64; AGREE], [u64; AGREE])> {
    buf.upload(&[values, [0; AGREE], [0; AGREE]].concat(), stream)?;
    let at = |k: u64| buf.ptr() + k * (AGREE * 8) as u64;
    // SAFETY: three runs of AGREE u64 inside `buf`, waited for by the download.
    unsafe { comm.min_max_u64(at(0), at(1), at(2), AGREE, stream)? };
    let mut all = [0u64; 3 * AGREE];
    buf.download(&mut all, stream)?;
    let run = |k: usize| -> [u64; AGREE] { std::array::from_fn(|i| all[k * AGREE + i]) };
    Ok((run(1), run(2)))
}

// SAFETY: the events are plain driver handles usable from any thread with the context bound;
// every method that records or waits on them takes `&mut self`.
unsafe impl Send for ShardWorkspace {}

impl Drop for ShardWorkspace {
    fn drop(&mut self) {
        let _ = self.exchange_stream.context().bind_to_thread();
        let last = [&self.input_done, &self.pass_exchanged, &self.forward_done];
        for &ev in self.step_done.iter().chain(last) {
            // SAFETY: created in `shard_workspace` in this context, destroyed once.
            let _ = unsafe { cu::event::destroy(ev) };
        }
    }
}

impl ShardWorkspace {
    /// The global problem this rank's part of is planned for.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// This rank's rows of the first pair index.
    pub fn rows(&self) -> Range<usize> {
        self.plan.rows()
    }

    /// The plan: passes, steps and buffers.
    pub fn plan(&self) -> &RankPlan {
        &self.plan
    }

    /// Whether the last forward enqueued on this workspace got as far as an exchange (see
    /// [`CudaBackend::enqueue_shard`]): if it then failed, the peers wait for this rank.
    pub fn exchange_started(&self) -> bool {
        self.exchanged
    }

    /// Whether the last forward enqueued on this workspace has finished on the GPU (its last
    /// event; true when none was enqueued), without waiting.
    pub fn forward_finished(&self) -> Result<bool> {
        if self.failed {
            return Err(Error::InvalidArgument(
                "this rank's last sharded forward failed while it was being enqueued".into(),
            ));
        }
        self.exchange_stream.context().bind_to_thread().ctx("cuCtxSetCurrent")?;
        // SAFETY: a live event of this context (a never-recorded event reports complete).
        match unsafe { cu::event::query(self.forward_done) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == cusys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(Error::driver(BackendKind::Cuda, "cuEventQuery", format!("{e:?}"))),
        }
    }

    /// Whether the last forward failed after its first launch (its end event still marks where
    /// its work ends).
    pub(crate) fn failed_after_launch(&self) -> bool {
        self.failed
    }

    /// Makes `stream` wait for the last forward enqueued on this workspace: forwards of one
    /// communicator on several workspaces run one after another.
    pub(crate) fn order_before(&self, stream: CUstream) -> Result<()> {
        // SAFETY: live handles of this context (a never-recorded event is complete).
        unsafe { cu::stream::wait_event(stream, self.forward_done, cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .ctx("cuStreamWaitEvent")
    }

    /// Device bytes the workspace holds.
    pub fn bytes(&self) -> u64 {
        [self.left.bytes(), self.right.bytes(), self.exchange.bytes(), self.t.bytes(), self.gate.bytes()]
            .iter()
            .sum::<u64>()
            + self.gemm_ws.bytes()
    }
}

/// Every step GEMM of `plan` with the element offsets of its operands from the step's first
/// matrices, keyed by the block's rank: outgoing, the column block of each rank (the own one
/// included); incoming, each rank's row block of the partial t.
fn step_gemms(plan: &RankPlan, direction: Direction, count: usize) -> Vec<(usize, GemmSpec, [usize; 3], u32)> {
    let own = plan.rows().len();
    plan.split
        .iter()
        .enumerate()
        .map(|(p, block)| {
            let (spec, offsets) = GemmSpec::shard_step(direction, plan.n, own, block.clone(), count);
            // Every matrix and region starts at a multiple of N halves; the column offsets
            // (`offsets`) add theirs.
            let at = offsets.iter().map(|&o| 2 * o as u64).fold(2 * plan.n as u64, gcd);
            (p, spec, offsets, alignment(at))
        })
        .collect()
}

impl CudaBackend {
    /// The workspace for rank `rank` of `ranks` of a sharded forward of `problem` (the global
    /// problem: every row), planned to fit the device's free memory (less [`margin`], the
    /// cuBLASLt workspace and room for NCCL) and `options.memory_limit`: every rank must get
    /// the same `options`. Refuses,
    /// before allocating, what the sharded forward does not take: layers without the fused input
    /// and output kernels on this GPU, and plans that do not fit.
    pub fn shard_workspace(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        rank: usize,
        ranks: usize,
        options: ShardOptions,
    ) -> Result<ShardWorkspace> {
        let budget = self.shard_budget(prep, problem, ranks, options)?;
        self.shard_workspace_within(prep, problem, rank, ranks, options, budget)
    }

    /// The bytes a rank's workspace of `problem` may take on this GPU now: its free memory less
    /// [`margin`], the cuBLASLt workspace and room for NCCL, within `options.memory_limit`.
    /// Refuses what the sharded forward does not take (as [`CudaBackend::shard_workspace`]).
    pub fn shard_budget(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        ranks: usize,
        options: ShardOptions,
    ) -> Result<u64> {
        check_prepared_for(&prep.config, problem)?;
        let tuning = self.tuning_for(problem);
        if self.fused_kernel_for(prep, problem, tuning).is_none() || self.fused_output_fits(problem).is_none() {
            return Err(Error::Unsupported {
                what: format!(
                    "a sharded forward of C = {}, H = {} on {} (it runs the fused input and output kernels \
                     only, which this shape or GPU does not take)",
                    problem.config.c, problem.config.h, self.inner.info.name
                ),
                backend: BackendKind::Cuda,
            });
        }
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let (free, total) = cu::mem_get_info().ctx("cuMemGetInfo")?;
        let fixed = MAX_GEMM_WORKSPACE as u64 + NCCL_RESERVE;
        let mut budget = (free as u64).saturating_sub(margin(total as u64)).saturating_sub(fixed);
        if let Some(limit) = options.memory_limit {
            // The limit counts the rank's x, mask and y and the prepared weights too.
            let weights = prep.tensors.bytes()
                + prep.fused.as_ref().map_or(0, |f| f.w.bytes() + f.bias.as_ref().map_or(0, |b| b.bytes()));
            budget = budget.min(RankPlan::budget_within(problem, ranks, limit, weights + fixed)?);
        }
        Ok(budget)
    }

    /// As [`CudaBackend::shard_workspace`], planned within `budget` bytes
    /// ([`CudaBackend::shard_budget`]; ranks given the same budget plan alike).
    pub fn shard_workspace_within(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        rank: usize,
        ranks: usize,
        options: ShardOptions,
        budget: u64,
    ) -> Result<ShardWorkspace> {
        check_prepared_for(&prep.config, problem)?;
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let plan = RankPlan::new(problem, ranks, rank, options, budget)?;
        let mut gemms = HashMap::new();
        let mut counts: Vec<usize> =
            plan.passes().iter().flat_map(|p| plan.steps(p.len())).map(|s| s.channels.len()).collect();
        counts.sort_unstable();
        counts.dedup();
        for count in counts {
            for (_, spec, _, align) in step_gemms(&plan, problem.direction, count) {
                if let std::collections::hash_map::Entry::Vacant(e) = gemms.entry((spec, align)) {
                    e.insert(MatmulPlan::new_aligned(&self.inner.blas, spec, Elem::F16, MAX_GEMM_WORKSPACE, align)?);
                }
            }
        }
        let steps = plan.steps(plan.pass).len();
        let event = || cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING).ctx("cuEventCreate");
        Ok(ShardWorkspace {
            problem: *problem,
            left: self.alloc_buffer(plan.pair_len())?,
            right: self.alloc_buffer(plan.pair_len())?,
            exchange: self.alloc_buffer(plan.exchange_len())?,
            t: self.alloc_buffer(plan.t_len())?,
            gate: self.alloc_buffer(plan.gate_len())?,
            gemm_ws: self.alloc_buffer(MAX_GEMM_WORKSPACE)?,
            step_done: (0..steps).map(|_| event()).collect::<Result<_>>()?,
            input_done: event()?,
            pass_exchanged: event()?,
            forward_done: event()?,
            exchanged: false,
            failed: false,
            agreed: false,
            agree: self.alloc_buffer(3 * AGREE)?,
            gemms,
            plan,
            exchange_stream: self.inner.ctx.new_stream().ctx("cuStreamCreate")?,
        })
    }

    /// Enqueues this rank's part of a sharded forward on `stream`: `x` and `y` hold the rank's
    /// rows (`[B, r1 − r0, N, C]` in the problem's I/O precision), `mask` (or 0) its rows of the
    /// mask (`[B, r1 − r0, N]` f32). Every rank of `comm` must enqueue the same forward; the
    /// exchanges make each rank's stream wait for the others.
    ///
    /// # Safety
    /// The buffers are device allocations of those sizes in this backend's context, alive until
    /// `stream` has run the work; `x` and `y` do not overlap unless equal (in place).
    ///
    /// If it fails after its first launch, the work it did enqueue still ends at the forward's
    /// end event, and waiting for the forward ([`ShardWorkspace::forward_finished`]) is an
    /// error.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn enqueue_shard(
        &self,
        prep: &CudaPrepared,
        ws: &mut ShardWorkspace,
        comm: &mut Communicator,
        x: CUdeviceptr,
        mask: CUdeviceptr,
        y: CUdeviceptr,
        stream: CUstream,
    ) -> Result<()> {
        ws.exchanged = false;
        ws.failed = false;
        let mut launched = false;
        // SAFETY: this function's contract.
        let result = unsafe { self.enqueue_shard_steps(prep, ws, comm, [x, mask, y], stream, &mut launched) };
        if result.is_err() && launched {
            ws.failed = true;
            // The end event after everything enqueued, the exchange stream's work included, so
            // that the next forward waits for it.
            let exchange = ws.exchange_stream.cu_stream();
            // SAFETY: live handles of this context.
            unsafe {
                let _ = cu::event::record(ws.input_done, exchange);
                let _ = cu::stream::wait_event(stream, ws.input_done, cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT);
                let _ = cu::event::record(ws.forward_done, stream);
            }
        }
        result
    }

    /// The body of [`CudaBackend::enqueue_shard`]; sets `launched` once it has enqueued work.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue_shard`].
    unsafe fn enqueue_shard_steps(
        &self,
        prep: &CudaPrepared,
        ws: &mut ShardWorkspace,
        comm: &mut Communicator,
        [x, mask, y]: [CUdeviceptr; 3],
        stream: CUstream,
        launched: &mut bool,
    ) -> Result<()> {
        let problem = ws.problem;
        comm.check_live()?;
        // Any prepared weights of the problem's configuration: the workspace depends on the
        // problem only, so the layers of a model share one per shape.
        check_prepared_for(&prep.config, &problem)?;
        if (comm.rank(), comm.ranks()) != (ws.plan.rank, ws.plan.split.len()) {
            return Err(Error::InvalidArgument(format!(
                "the workspace is rank {} of {}, the communicator rank {} of {}",
                ws.plan.rank,
                ws.plan.split.len(),
                comm.rank(),
                comm.ranks()
            )));
        }
        if x == 0 || y == 0 || (problem.masked && mask == 0) || (!problem.masked && mask != 0) {
            return Err(Error::InvalidArgument(
                "x and y must be device addresses, and a mask is given exactly when the problem is masked".into(),
            ));
        }
        if (x == y) != problem.in_place {
            return Err(Error::InvalidArgument("an in-place sharded forward needs y = x, out of place y ≠ x".into()));
        }
        let inner = &self.inner;
        inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let tuning = self.tuning_for(&problem);
        let (input, output) = match (self.fused_kernel_for(prep, &problem, tuning), self.fused_output_fits(&problem)) {
            (Some(i), Some(o)) => (i, o),
            _ => {
                return Err(Error::Unsupported {
                    what: format!(
                        "a sharded forward of these weights on {} (they do not take the fused input kernel)",
                        inner.info.name
                    ),
                    backend: BackendKind::Cuda,
                })
            }
        };
        let f = prep.fused.as_ref().ok_or_else(|| Error::Internal("no fused input weights".into()))?;
        let (b, n, c, h, g) =
            (problem.shape.batch, problem.shape.n, problem.config.c, problem.config.h, problem.config.gate_width());
        let plan = ws.plan.clone();
        let rows = plan.rows();
        let (r0, r) = (rows.start, rows.len());
        let rank = plan.rank;
        let io = problem.io.io_bytes() as u64;
        let wait = |s: CUstream, ev: CUevent| {
            // SAFETY: both are live handles of this context (waiting on a never-recorded event
            // returns at once).
            unsafe { cu::stream::wait_event(s, ev, cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                .ctx("cuStreamWaitEvent")
        };
        let record = |ev: CUevent, s: CUstream| {
            // SAFETY: as above.
            unsafe { cu::event::record(ev, s) }.ctx("cuEventRecord")
        };
        // The previous forward on this workspace, maybe on another stream, must be done with
        // every buffer before this one writes them.
        wait(stream, ws.forward_done)?;
        *launched = true;
        if !ws.agreed {
            // Every rank's pass width and step, reduced to their minimum and maximum: equal on
            // every rank exactly when the plans agree, so every rank gets the same answer.
            let mine = [ws.plan.pass as u64, ws.plan.chunk as u64];
            let (min, max) = min_max_over_ranks(comm, &mut ws.agree, mine, stream)?;
            if min != max {
                return Err(Error::InvalidArgument(format!(
                    "the ranks planned different passes (from {} to {} channels; exchange steps of {} to {} \
                     matrices): give every rank the same ShardOptions (hidden_pass, chunk_matrices)",
                    min[0], max[0], min[1], max[1]
                )));
            }
            ws.agreed = true;
        }
        if inner.poison.load(std::sync::atomic::Ordering::Relaxed) {
            for buf in [&mut ws.left, &mut ws.right, &mut ws.exchange, &mut ws.t, &mut ws.gate] {
                buf.memset_async(POISON_BYTE, stream)?;
            }
            if !problem.in_place {
                // SAFETY: y holds the rank's `B·r·N·C` elements (the caller's contract).
                cu::memset_d8_async(y, POISON_BYTE, b * r * n * c * io as usize, stream).ctx("cuMemsetD8Async(y)")?;
            }
        }
        // Per batch: the first own position (global) and the rank-local position it is stored at.
        let batches: Vec<(u64, u64)> = (0..b).map(|bi| (((bi * n + r0) * n) as u64, (bi * r * n) as u64)).collect();
        let at = |ptr: u64, (global, local): (u64, u64), elem: u64| {
            if ptr == 0 {
                0
            } else {
                ptr.wrapping_add(local * elem).wrapping_sub(global * elem)
            }
        };
        let weights = prep.tensors.addresses();
        let addresses = |pos| Addresses {
            x: at(x, pos, c as u64 * io),
            mask: at(mask, pos, 4),
            y: at(y, pos, c as u64 * io),
            ..weights
        };
        let count = r * n;
        let stored_gate = plan.output_rows.is_none();
        let gate_of = |local: u64| ws.gate.ptr() + local * g as u64 * 2;
        // The compact buffers' pointers as the kernels take them: moved back by r0·N halves.
        let shift = (r0 * n * 2) as u64;
        let n_gating = f.layout.h_pad / 32;
        let gate_chunks_end = to_i32(n_gating + f.layout.g_pad / 128, "last gate column chunk")?;
        let fused = |pos: (u64, u64)| -> Result<CommonParams> {
            CommonParams::new(&problem, addresses(pos))?
                .with_fused(&f.layout, f.w.ptr(), f.bias.as_ref().map_or(0, |bias| bias.ptr()))?
                .with_matrix_rows(r)
        };
        let passes = plan.passes();
        let exchange = ws.exchange_stream.cu_stream();
        let (left, right, xbuf, t, gemm_ws, gemm_ws_len) =
            (ws.left.ptr(), ws.right.ptr(), ws.exchange.ptr(), ws.t.ptr(), ws.gemm_ws.ptr(), ws.gemm_ws.len());
        let half = |elems: usize| 2 * elems as u64;

        self.mark("start", stream)?;
        for (pi, pass) in passes.iter().enumerate() {
            let hc = pass.len();
            let last = pi + 1 == passes.len();
            // 1. The input stage over the rank's positions: LN_C, projections, gating; the pass's
            // channels of left and right at the rank's rows, and the gate with the last pass
            // when the plan stores it.
            for &pos in &batches {
                let with_gate = stored_gate && last;
                let kp = InputParams {
                    common: fused(pos)?.over(pos.0 as usize, count)?,
                    left: left.wrapping_sub(shift),
                    right: right.wrapping_sub(shift),
                    gate: if with_gate { gate_of(pos.1) } else { 0 },
                    buf_row0: pos.0 as i64,
                    chunk_begin: to_i32(pass.start / 32, "first column chunk")?,
                    chunk_end: match (with_gate, pass.start) {
                        (true, 0) => 0,
                        (true, _) => gate_chunks_end,
                        (false, _) => to_i32(pass.end.div_ceil(32), "last column chunk")?,
                    },
                    lr_h0: to_i32(pass.start, "first channel of a pass")?,
                    lr_h: to_i32(hc, "channels of a pass")?,
                    ..InputParams::default()
                };
                // SAFETY: the addresses cover the launch's positions (the caller's buffers and
                // `ws`'s compact ones, moved back by the positions before the first own one).
                input.launch(count, stream, &kp)?;
            }
            if passes.len() == 1 {
                self.mark("input (LN, projections, gating)", stream)?;
            }
            // The previous pass's sums (incoming) read the exchange buffer and t: done before
            // this pass's GEMMs write them. (Its broadcasts, outgoing, read right, which the
            // input stage above rewrote: the compute stream waited for each of them already.)
            wait(stream, ws.pass_exchanged)?;

            // 2. The contraction in steps, each step's exchange on the second stream.
            let steps = plan.steps(hc);
            if steps.len() > ws.step_done.len() {
                return Err(Error::Internal(format!("{} steps for {} events", steps.len(), ws.step_done.len())));
            }
            let gemms = step_gemms(&plan, problem.direction, plan.chunk.min(hc));
            let tail = (hc % plan.chunk != 0 && hc > plan.chunk)
                .then(|| step_gemms(&plan, problem.direction, hc % plan.chunk));
            // Element offsets of a step's first matrix: in left and right (this rank's rows),
            // in rank p's region of the exchange buffer, and in t.
            let mine = |s: &Step| (s.b * hc + s.channels.start) * r * n;
            let theirs =
                |s: &Step, p: usize| plan.exchange_offset(p) + (s.b * hc + s.channels.start) * plan.split[p].len() * n;
            let t_at = |s: &Step| (s.b * h + pass.start + s.channels.start) * r * n;
            let mut run = |s: &Step, p: usize, a: u64, bb: u64, d: u64| -> Result<()> {
                let list = if s.channels.len() == plan.chunk.min(hc) { Some(&gemms) } else { tail.as_ref() };
                let &(_, spec, [oa, ob, od], align) = list
                    .and_then(|l| l.get(p))
                    .filter(|g| g.1.batch == s.channels.len())
                    .ok_or_else(|| Error::Internal(format!("no GEMM for a step of {} matrices", s.channels.len())))?;
                let gemm = ws
                    .gemms
                    .get_mut(&(spec, align))
                    .ok_or_else(|| Error::Internal("a step GEMM has no plan".into()))?;
                // SAFETY: the operands are the step's matrices inside `ws`'s buffers (and t's
                // column or row block), which live until the stream has run them.
                unsafe {
                    gemm.run(&inner.blas, a + half(oa), bb + half(ob), d + half(od), 0, gemm_ws, gemm_ws_len, stream)
                }
            };
            // One step's exchange: per rank p, the step's matrices of p's rows, from and to the
            // addresses `ends(p)` gives (send, receive).
            let transfers = |s: &Step, ends: &dyn Fn(usize) -> (u64, u64)| -> Vec<Transfer> {
                let sized = |(p, block): (usize, &Range<usize>)| {
                    let (send, recv) = ends(p);
                    Transfer { send, recv, count: s.channels.len() * block.len() * n, root: p }
                };
                plan.split.iter().enumerate().map(sized).collect()
            };
            record(ws.input_done, stream)?;
            // From here on a failure leaves the peers waiting for this rank's exchanges.
            ws.exchanged = true;
            match problem.direction {
                Direction::Outgoing => {
                    wait(exchange, ws.input_done)?;
                    for (s, &done) in steps.iter().zip(&ws.step_done) {
                        let transfers = transfers(s, &|p| match p == rank {
                            true => (right + half(mine(s)), right + half(mine(s))),
                            false => (0, xbuf + half(theirs(s, p))),
                        });
                        // SAFETY: the root's rows of the step's matrices of right go into the
                        // others' regions of the exchange buffer, both inside `ws`'s buffers;
                        // the exchange stream waited for the input stage.
                        unsafe { comm.broadcast(&transfers, exchange)? };
                        record(done, exchange)?;
                    }
                    // Every step's own column block first (no exchange needed), so the
                    // broadcasts run under them; then the peers' blocks, each step's once its
                    // broadcast is done.
                    for s in &steps {
                        run(s, rank, right + half(mine(s)), left + half(mine(s)), t + half(t_at(s)))?;
                    }
                    for (s, &done) in steps.iter().zip(&ws.step_done) {
                        wait(stream, done)?;
                        for p in (0..plan.split.len()).filter(|&p| p != rank) {
                            run(s, p, xbuf + half(theirs(s, p)), left + half(mine(s)), t + half(t_at(s)))?;
                        }
                    }
                    record(ws.pass_exchanged, stream)?;
                }
                Direction::Incoming => {
                    for (s, &done) in steps.iter().zip(&ws.step_done) {
                        // The partial rows of every rank's block: its own into t, the others'
                        // into their regions of the exchange buffer.
                        for p in 0..plan.split.len() {
                            let d = if p == rank { t + half(t_at(s)) } else { xbuf + half(theirs(s, p)) };
                            run(s, p, right + half(mine(s)), left + half(mine(s)), d)?;
                        }
                        record(done, stream)?;
                        wait(exchange, done)?;
                        let transfers = transfers(s, &|p| match p == rank {
                            true => (t + half(t_at(s)), t + half(t_at(s))),
                            false => (xbuf + half(theirs(s, p)), t + half(t_at(s))),
                        });
                        // SAFETY: every rank's partial rows of the step, inside `ws`'s buffers,
                        // summed into the owner's t (in place there), after the step's GEMMs.
                        unsafe { comm.sum_to_roots(&transfers, exchange)? };
                    }
                    record(ws.pass_exchanged, exchange)?;
                }
            }
            if passes.len() == 1 {
                self.mark("contraction and exchange", stream)?;
            }
        }
        // Incoming: t is whole once the last sums are in.
        wait(stream, ws.pass_exchanged)?;
        if passes.len() > 1 {
            self.mark("hidden passes (input, contraction, exchange)", stream)?;
        }

        // 3. The output stage over the rank's positions: per batch the stored gate, or per row
        // chunk the gate made from x first.
        for &pos in &batches {
            for (first, rows) in plan.output_chunks() {
                let row0 = pos.0 as usize + first;
                let common = CommonParams::new(&problem, addresses(pos))?.with_matrix_rows(r)?.over(row0, rows)?;
                let (gate, buf_row0) = if stored_gate {
                    (gate_of(pos.1), pos.0 as i64)
                } else {
                    let kp = InputParams {
                        common: fused(pos)?.over(row0, rows)?,
                        gate: ws.gate.ptr(),
                        buf_row0: row0 as i64,
                        chunk_begin: to_i32(n_gating, "first gate column chunk")?,
                        chunk_end: gate_chunks_end,
                        ..InputParams::default()
                    };
                    // SAFETY: as for the input stage; the gate buffer holds one chunk's rows.
                    input.launch(rows, stream, &kp)?;
                    (ws.gate.ptr(), row0 as i64)
                };
                let kp = OutputParams { common, t: t.wrapping_sub(shift), gate, buf_row0, ..OutputParams::default() };
                // SAFETY: as for the input stage; t holds the rank's rows of every channel.
                self.launch_output(output, &kp, stream)?;
            }
        }
        record(ws.forward_done, stream)?;
        self.mark("output stage", stream)
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The largest power of two (at most 256, cuMemAlloc's alignment) dividing `offsets_gcd`, the
/// greatest common divisor of the byte offsets an operand may sit at (0: none besides the
/// allocation's start).
fn alignment(offsets_gcd: u64) -> u32 {
    if offsets_gcd == 0 {
        256
    } else {
        (1u64 << offsets_gcd.trailing_zeros().min(8)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_of_every_offset() {
        assert_eq!(alignment(0), 256);
        assert_eq!(alignment(1 << 20), 256);
        // N = 200, rank 1 of 2: a row offset of 100·200 halves, 40000 bytes.
        assert_eq!(alignment(gcd(0, 40_000)), 64);
        // N = 100: 50·100 halves = 10000 bytes, and a column block starting at 50 (100 bytes).
        assert_eq!(alignment(gcd(gcd(0, 10_000), 100)), 4);
        assert_eq!(alignment(gcd(2 * 97, 2 * 97 * 49)), 2);
    }
}
