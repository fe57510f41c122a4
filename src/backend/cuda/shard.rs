//! One rank's forward on a row-sharded pair tensor (issue 29; `plan::shard` has the layout, the
//! exchanges and the memory arithmetic, `collective` the communicator).
//!
//! The rank holds rows `[r0, r1)` of x and y for every batch, `[B, r1 − r0, N, C]`. Its input
//! and output stages are the one-pass forward's fused kernels over its own positions (per
//! batch, the positions `(b·N + r0)·N .. (b·N + r1)·N`); only the contraction needs other
//! ranks' data. Left, right and t are full-size `[B, H, N, N]` f16 buffers on every rank, in
//! the layout the kernels index by global position, and the contraction runs in chunks of
//! matrices (`plan::shard::CHUNK_MATRICES` by default) so that the exchanges (NCCL, on a second
//! stream) run under GEMMs:
//!
//! - **outgoing**: each rank broadcasts its rows of right to the others, chunk by chunk; the
//!   compute stream first runs every chunk's GEMM against the rank's own rows of right (no
//!   exchange needed), then each chunk's GEMMs against the peers' rows once that chunk's
//!   broadcast is done.
//! - **incoming**: each rank computes, chunk by chunk, the partial t over its own rows of the
//!   contracted index for every `(i, j)`; each chunk's partials are then summed to the rank that
//!   owns each row block (an f16 reduction: one more rounding per rank than on one GPU), under
//!   the next chunk's GEMM.
//!
//! The GEMMs run on blocks inside the buffers (offsets of `r0·N` halves and the chunks' starts),
//! so their plans are told the alignment those addresses have.
//!
//! Consecutive forwards on one workspace are ordered even on different streams: each waits for
//! the previous one's end. Every rank must enqueue the same forwards in the same order, each
//! rank from its own thread (NCCL: one thread driving several ranks would have to group their
//! calls together).
//!
//! The kernels address x, the mask and y by global position; the rank's buffers hold only its
//! rows, so each batch's launch gets base addresses moved back by the positions before its
//! first own one (wrapping arithmetic: the kernels only form addresses of positions in the
//! launch, which are inside the rank's buffers).

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
use crate::backend::params::{Addresses, CommonParams, InputParams, OutputParams};
use crate::collective::Communicator;
use crate::error::{BackendKind, Error, Result};
use crate::plan::shard::{full_buffers_bytes, matrix_blocks, matrix_chunks, row_split};
use crate::problem::{Direction, Problem};

/// The buffers, GEMM plans, second stream and events of one rank's sharded forward of one
/// problem. Made by [`CudaBackend::shard_workspace`].
pub struct ShardWorkspace {
    problem: Problem,
    split: Vec<Range<usize>>,
    rank: usize,
    left: DeviceBuffer<u16>,
    right: DeviceBuffer<u16>,
    t: DeviceBuffer<u16>,
    gate: DeviceBuffer<u16>,
    gemm_ws: DeviceBuffer<u8>,
    /// Per chunk of matrices, its GEMMs (see [`ChunkGemms`]).
    gemms: Vec<ChunkGemms>,
    exchange_stream: Arc<CudaStream>,
    /// One event per chunk, and one for "the input stage is done" / "every exchange is done".
    chunk_done: Vec<CUevent>,
    stage_done: CUevent,
    /// Recorded at the end of each forward; the next one's stream waits for it.
    forward_done: CUevent,
    /// Whether the current forward has enqueued an exchange: a failure after that leaves the
    /// peers waiting for this rank (`sharded::ShardedGroup` then aborts the communicators).
    exchanged: bool,
    weights_of: u64,
}

// SAFETY: the events are plain driver handles usable from any thread with the context bound;
// every method that records or waits on them takes `&mut self`.
unsafe impl Send for ShardWorkspace {}

/// The contraction GEMMs of one chunk of matrices, each with the element offsets of right,
/// left and t within a matrix ([`GemmSpec::shard_contraction`]).
struct ChunkGemms {
    matrices: Range<usize>,
    /// Outgoing: the rank's rows of t against its own rows of right, which need no exchange.
    /// Incoming: the partial t over the rank's rows of the contracted index.
    own: (MatmulPlan, [usize; 3]),
    /// Outgoing: against each peer's rows of right, once the chunk's exchange is done.
    peers: Vec<(MatmulPlan, [usize; 3])>,
}

impl Drop for ShardWorkspace {
    fn drop(&mut self) {
        let _ = self.exchange_stream.context().bind_to_thread();
        for &ev in self.chunk_done.iter().chain([&self.stage_done, &self.forward_done]) {
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
        self.split[self.rank].clone()
    }

    /// Whether the last forward enqueued on this workspace got as far as an exchange (see
    /// [`CudaBackend::enqueue_shard`]): if it then failed, the peers wait for this rank.
    pub fn exchange_started(&self) -> bool {
        self.exchanged
    }

    /// Device bytes the workspace holds.
    pub fn bytes(&self) -> u64 {
        self.left.bytes() + self.right.bytes() + self.t.bytes() + self.gate.bytes() + self.gemm_ws.bytes()
    }
}

impl CudaBackend {
    /// The workspace for rank `rank` of `ranks` of a sharded forward of `problem` (the global
    /// problem: every row), its contraction in chunks of `chunk_matrices` of the `B·H` matrices
    /// (every rank must use the same). Refuses, before allocating, what today's sharded forward
    /// does not take: layers without the fused input and output kernels on this GPU, and
    /// buffers that do not fit in free memory.
    pub fn shard_workspace(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        rank: usize,
        ranks: usize,
        chunk_matrices: usize,
    ) -> Result<ShardWorkspace> {
        check_prepared_for(&prep.config, problem)?;
        let split = row_split(problem.shape.n, ranks)?;
        let rows = split
            .get(rank)
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("rank {rank} of a communicator of {ranks} ranks")))?;
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
        let need = full_buffers_bytes(problem, &rows) + MAX_GEMM_WORKSPACE as u64;
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let (free, _) = cu::mem_get_info().ctx("cuMemGetInfo")?;
        if need > free as u64 {
            return Err(Error::OutOfMemory {
                backend: BackendKind::Cuda,
                what: format!(
                    "rank {rank}'s sharded forward (left, right and t of every row in f16, the gate of its {} rows)",
                    rows.len()
                ),
                needed: need,
                available: free as u64,
            });
        }
        let (b, n, h) = (problem.shape.batch, problem.shape.n, problem.config.h);
        let matrices = b * h;
        let gate_len = b * rows.len() * n * problem.config.gate_width();
        let chunks = matrix_chunks(matrices, chunk_matrices);
        // The byte offsets every plan's operands sit at besides the allocations' own 256-byte
        // alignment: the chunks' starts, and the blocks' offsets within a matrix.
        let chunk_starts = chunks.iter().map(|c| (c.start * n * n * 2) as u64).fold(0, gcd);
        let gemm = |cols: Range<usize>, batch| -> Result<(MatmulPlan, [usize; 3])> {
            let (spec, offsets) = GemmSpec::shard_contraction(problem.direction, n, rows.clone(), cols, batch);
            let at = offsets.iter().map(|&o| 2 * o as u64).fold(chunk_starts, gcd);
            let plan = MatmulPlan::new_aligned(&self.inner.blas, spec, Elem::F16, MAX_GEMM_WORKSPACE, alignment(at))?;
            Ok((plan, offsets))
        };
        let mut gemms = Vec::new();
        for matrices in chunks {
            let batch = matrices.len();
            let (own, peers) = match problem.direction {
                Direction::Outgoing => {
                    let peers = split.iter().filter(|p| **p != rows).map(|p| gemm(p.clone(), batch));
                    (gemm(rows.clone(), batch)?, peers.collect::<Result<_>>()?)
                }
                Direction::Incoming => (gemm(0..n, batch)?, Vec::new()),
            };
            gemms.push(ChunkGemms { matrices, own, peers });
        }
        let event = || cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING).ctx("cuEventCreate");
        Ok(ShardWorkspace {
            problem: *problem,
            rank,
            left: self.alloc_buffer(matrices * n * n)?,
            right: self.alloc_buffer(matrices * n * n)?,
            t: self.alloc_buffer(matrices * n * n)?,
            gate: self.alloc_buffer(gate_len)?,
            gemm_ws: self.alloc_buffer(MAX_GEMM_WORKSPACE)?,
            chunk_done: (0..gemms.len()).map(|_| event()).collect::<Result<_>>()?,
            stage_done: event()?,
            forward_done: event()?,
            exchanged: false,
            gemms,
            split,
            exchange_stream: self.inner.ctx.new_stream().ctx("cuStreamCreate")?,
            weights_of: prep.id,
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
        let problem = ws.problem;
        check_prepared_for(&prep.config, &problem)?;
        if ws.weights_of != prep.id {
            return Err(Error::InvalidArgument("this shard workspace was made for other prepared weights".into()));
        }
        if (comm.rank(), comm.ranks()) != (ws.rank, ws.split.len()) {
            return Err(Error::InvalidArgument(format!(
                "the workspace is rank {} of {}, the communicator rank {} of {}",
                ws.rank,
                ws.split.len(),
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
            _ => return Err(Error::Internal("the sharded forward's fused kernels went away".into())),
        };
        let f = prep.fused.as_ref().ok_or_else(|| Error::Internal("no fused input weights".into()))?;
        let (b, n, c, g) = (problem.shape.batch, problem.shape.n, problem.config.c, problem.config.gate_width());
        let rows = ws.rows();
        let (r0, r) = (rows.start, rows.len());
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
        if inner.poison.load(std::sync::atomic::Ordering::Relaxed) {
            for buf in [&mut ws.left, &mut ws.right, &mut ws.t, &mut ws.gate] {
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
        let gate_of = |local: u64| ws.gate.ptr() + local * g as u64 * 2;

        self.mark("start", stream)?;
        // 1. The input stage over the rank's positions: LN_C, projections, gating; left and right
        // at their global rows, the gate at the rank's.
        for &pos in &batches {
            let common = CommonParams::new(&problem, addresses(pos))?
                .with_fused(&f.layout, f.w.ptr(), f.bias.as_ref().map_or(0, |bias| bias.ptr()))?
                .over(pos.0 as usize, count)?;
            let kp = InputParams {
                common,
                left: ws.left.ptr(),
                right: ws.right.ptr(),
                gate: gate_of(pos.1),
                buf_row0: pos.0 as i64,
                ..InputParams::default()
            };
            // SAFETY: the addresses cover the launch's positions (the caller's buffers, moved
            // back by the positions before the first own one) and `ws`'s full-size buffers.
            input.launch(count, stream, &kp)?;
        }
        self.mark("input (LN, projections, gating)", stream)?;

        // 2. The contraction in chunks, each chunk's exchange on the second stream.
        let blocks = matrix_blocks(&ws.split, n);
        let matrix_bytes = (n * n * 2) as u64;
        let exchange = ws.exchange_stream.cu_stream();
        let (left, right, t, gemm_ws, gemm_ws_len) =
            (ws.left.ptr(), ws.right.ptr(), ws.t.ptr(), ws.gemm_ws.ptr(), ws.gemm_ws.len());
        let run = |(gemm, [oa, ob, od]): &mut (MatmulPlan, [usize; 3]), m0: u64| {
            let (oa, ob, od) = (2 * *oa as u64, 2 * *ob as u64, 2 * *od as u64);
            // SAFETY: the offsets stay inside the chunk's matrices of the full-size buffers
            // (`GemmSpec::shard_contraction`), which live in `ws` until the stream has run them.
            unsafe {
                gemm.run(&inner.blas, right + m0 + oa, left + m0 + ob, t + m0 + od, 0, gemm_ws, gemm_ws_len, stream)
            }
        };
        // From here on a failure leaves the peers waiting for this rank's exchanges.
        ws.exchanged = true;
        match problem.direction {
            Direction::Outgoing => {
                record(ws.stage_done, stream)?;
                wait(exchange, ws.stage_done)?;
                for (chunk, &done) in ws.gemms.iter().zip(&ws.chunk_done) {
                    let mats = chunk.matrices.clone().map(|m| right + m as u64 * matrix_bytes);
                    // SAFETY: every matrix of right holds N² halves, the blocks lie inside one,
                    // and `ws` keeps right alive; the stream waited for the input stage.
                    comm.broadcast_blocks(mats, &blocks, exchange)?;
                    record(done, exchange)?;
                }
                // Every chunk's block against the rank's own rows of right first (no exchange
                // needed), so the broadcasts run under them; then the peers' blocks, each chunk
                // once its broadcast is done.
                for chunk in ws.gemms.iter_mut() {
                    run(&mut chunk.own, chunk.matrices.start as u64 * matrix_bytes)?;
                }
                for (chunk, &done) in ws.gemms.iter_mut().zip(&ws.chunk_done) {
                    wait(stream, done)?;
                    for peer in chunk.peers.iter_mut() {
                        run(peer, chunk.matrices.start as u64 * matrix_bytes)?;
                    }
                }
            }
            Direction::Incoming => {
                for (chunk, &done) in ws.gemms.iter_mut().zip(&ws.chunk_done) {
                    run(&mut chunk.own, chunk.matrices.start as u64 * matrix_bytes)?;
                    record(done, stream)?;
                    wait(exchange, done)?;
                    let mats = chunk.matrices.clone().map(|m| t + m as u64 * matrix_bytes);
                    // SAFETY: as for the broadcasts, on t after the chunk's GEMM.
                    comm.sum_blocks_to_owners(mats, &blocks, exchange)?;
                }
                record(ws.stage_done, exchange)?;
                wait(stream, ws.stage_done)?;
            }
        }
        self.mark("contraction and exchange", stream)?;

        // 3. The output stage over the rank's positions.
        for &pos in &batches {
            let common = CommonParams::new(&problem, addresses(pos))?.over(pos.0 as usize, count)?;
            let kp =
                OutputParams { common, t, gate: gate_of(pos.1), buf_row0: pos.0 as i64, ..OutputParams::default() };
            // SAFETY: as for the input stage; t holds every row the launch reads.
            self.launch_output(output, &kp, stream)?;
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
