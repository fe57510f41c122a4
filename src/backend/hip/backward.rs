//! The HIP backward pass: every gradient of `L` given `dy`, recomputing the forward's
//! intermediates from `x`. The same 15 steps as the CUDA backward (`cuda/backward.rs`, whose
//! module docs list them; `docs/backward.md` derives the math), with the same ten kernels
//! (`common/backward.h`, compiled as HIP by `hip/backward.hip`) on the same buffers, and rocBLAS
//! `gemm_ex` / `gemm_strided_batched_ex` for the GEMMs between them, described by the same
//! [`GemmSpec`]s.
//!
//! # Precision
//! The kernels compute and store in f32; the bias and LayerNorm-weight column sums are f64 in a
//! fixed order, as on CUDA. The GEMMs read and write f32 and are asked for f32 compute
//! (`rocblas_datatype_f32_r` everywhere, rocBLAS's default math mode): on CUDA they run in TF32.
//! What rocBLAS does with such a call on an MI300 is not known here: rocBLAS may pick an xf32
//! (reduced-mantissa) path only when a handle's math mode asks for it, which this backend never
//! sets, but nothing has run on AMD hardware, so neither the path rocBLAS picks nor its error
//! has been observed. On the fake ROCm (`tests/hip_emu/fake_rocm.cpp`) the GEMMs are plain f32
//! sums. The weights are the prepared f16 ones, widened to f32 by `backward_widen`.
//!
//! # Memory
//! Every intermediate is a whole f32 tensor, as on CUDA (about `(C + F + 5H + max(C, H))·4`
//! bytes per position, nothing chunked), carved from a caller's workspace span or from one block
//! the backend allocates and keeps for the next backward of the same sizes
//! ([`Backend::free_backward_buffers`](crate::Backend) drops it). With poisoning on (the tests),
//! every intermediate is filled with NaN first. rocBLAS manages its own GEMM workspace.
//!
//! # Kernels
//! The ten kernels are loaded on the first backward (a forward-only user never loads them):
//! from the prebuilt `backward` code object for the device's processor, else compiled once with
//! hipRTC; one module per kernel, each from that one image.
//!
//! Nothing here has run on an AMD GPU; it runs on the fake ROCm, which executes the kernel
//! bodies through a CPU emulation of wave64 hardware and models rocBLAS's f32 GEMMs.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::blas::{DataType, RocblasGemm};
use super::context::{launch_by_value, poisoned, BackwardKernels, HipBackend, HipPrepared, POISON_BYTE};
use super::kernels::LDS_BYTES;
use super::result::{self, BlasHandle, DeviceMem, Kernel};
use super::sys;
use crate::backend::backward_params::{
    acc_smem, backward_sizes, chunk_rows, output_norm_grad_smem, BackwardParams, ColumnSums, Outputs, Widen,
    GATING_SMEM, MAX_ROW_BLOCKS, PARTIALS_SMEM, ROWS_PER_BLOCK, THREADS, TILE, WARPS,
};
use crate::backend::gemm::GemmSpec;
use crate::device_io::{DeviceSpan, SPAN_ALIGN};
use crate::error::{BackendKind, Error, Result};
use crate::gradients::Gradients;
use crate::problem::{Direction, Formulation, Problem};

/// One backward's device tensors (`cuda/backward.rs`'s module docs say what each holds), as
/// addresses into one block; `all` lists every one with its bytes, for poisoning.
struct Buffers {
    z: u64,
    stats_x: u64,
    p: u64,
    left: u64,
    right: u64,
    t: u64,
    u: u64,
    stats_t: u64,
    e: u64,
    du: u64,
    w_cat: u64,
    w_out: u64,
    /// The weight gradients' per-chunk f32 sums, `[chunks + 1, widest weight]`.
    weight_partial: u64,
    /// f64 partial sums of the column sums.
    partial: u64,
    sums: u64,
    all: Vec<(u64, u64)>,
}

/// Carves 256-byte aligned views from `[at, end)`, or (with `end` `None`) only counts bytes.
struct Carver {
    at: u64,
    end: Option<u64>,
}

impl Carver {
    fn take(&mut self, bytes: usize) -> Result<(u64, u64)> {
        let bytes = (bytes.max(1) as u64).next_multiple_of(SPAN_ALIGN);
        if self.end.is_some_and(|end| self.at + bytes > end) {
            return Err(Error::InvalidArgument("the backward's workspace is too small".into()));
        }
        let at = self.at;
        self.at += bytes;
        Ok((at, bytes))
    }
}

fn buffers_from(problem: &Problem, out: &Outputs, src: &mut Carver) -> Result<Buffers> {
    let cfg = problem.config;
    let m = problem.shape.rows();
    let (c, h, f) = (cfg.c, cfg.h, cfg.fused_proj_width());
    let widest = (f * c).max(c * h);
    let chunks = m / chunk_rows(m) + 1;
    let mut all = Vec::new();
    let mut a = |floats: usize, size: usize| -> Result<u64> {
        let (at, bytes) = src.take(floats * size)?;
        all.push((at, bytes));
        Ok(at)
    };
    let b = Buffers {
        z: a(m * c, 4)?,
        stats_x: a(2 * m, 4)?,
        p: a(m * f, 4)?,
        left: a(m * h, 4)?,
        right: a(m * h, 4)?,
        t: a(m * h, 4)?,
        u: a(m * h, 4)?,
        stats_t: a(2 * m, 4)?,
        e: a(m * c.max(h), 4)?,
        du: a(m * h, 4)?,
        w_cat: a(f * c, 4)?,
        w_out: a(c * h, 4)?,
        weight_partial: a(chunks * widest, 4)?,
        sums: a(out.len, 4)?,
        partial: a((MAX_ROW_BLOCKS * f.max(2 * c).max(2 * h)).max(widest), 8)?,
        all: Vec::new(),
    };
    Ok(Buffers { all, ..b })
}

/// Launches one backward kernel (`THREADS` threads per block) with its one argument struct.
///
/// # Safety
/// `P` is the struct `kernel` takes by value, and every device address in `params` is valid for
/// every access the kernel makes at this geometry until `stream` has run the launch.
unsafe fn launch<P: Copy>(
    kernel: &Kernel,
    stream: sys::hipStream_t,
    grid: usize,
    smem: usize,
    params: &P,
) -> Result<()> {
    // SAFETY: this function's contract.
    unsafe { launch_by_value(kernel, stream, grid, THREADS, smem, params) }
}

impl HipBackend {
    /// The backward kernels, loaded on first use.
    fn backward_kernels(&self) -> Result<Arc<BackwardKernels>> {
        let mut slot = self.ctx.backward.lock().map_err(poisoned)?;
        if let Some(k) = slot.as_ref() {
            return Ok(k.clone());
        }
        let k = Arc::new(BackwardKernels::load(self.ctx.api, &self.ctx.target_id, self.ctx.force_rtc)?);
        *slot = Some(k.clone());
        Ok(k)
    }

    /// Refuses a backward whose LayerNorm kernels would need more LDS per block than the 64 KiB
    /// of gfx90a and gfx942 (a 32-position tile of t, and per-warp column sums): H ≤ 334 and
    /// C ≤ 1024.
    pub(super) fn check_backward_fits(&self, problem: &Problem) -> Result<()> {
        let (c, h) = (problem.config.c, problem.config.h);
        let need = [("H", h, output_norm_grad_smem(h)), ("C", c, acc_smem(c))];
        match need.into_iter().find(|&(_, _, bytes)| bytes > LDS_BYTES) {
            Some((name, v, bytes)) => Err(Error::Unsupported {
                backend: BackendKind::Hip,
                what: format!(
                    "the backward pass at {name} = {v} (its LayerNorm kernels need {bytes} bytes of LDS per \
                     block; the GPU has {LDS_BYTES})"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Bytes of the workspace span a backward of `problem` carves its buffers from.
    pub(super) fn backward_span_bytes(&self, problem: &Problem) -> Result<u64> {
        let cfg = problem.config;
        let out = Outputs::new(cfg.c, cfg.h, cfg.fused_proj_width());
        let mut count = Carver { at: 0, end: None };
        buffers_from(problem, &out, &mut count)?;
        Ok(count.at)
    }

    /// Drops the block the last backward kept.
    pub(super) fn drop_backward_buffers(&self) {
        if let Ok(mut kept) = self.ctx.backward_block.lock() {
            *kept = None;
        }
    }

    /// Enqueues the backward (the 15 steps of `cuda/backward.rs`) on `stream`, `blas` bound to
    /// it: `x`, `dy` and `dx` are `[M, C]` f32, `mask` `[M]` f32 or 0; the weight gradients land
    /// in `b.sums` at `out`'s offsets once the stream has run the work.
    ///
    /// # Safety
    /// `x`, `dy`, `mask` (when non-zero) and `dx` are live device allocations of those sizes
    /// until the stream has run the work, `dx` aliasing none of the others; `b` was carved for
    /// this problem from live device memory that nothing else uses meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_backward(
        &self,
        k: &BackwardKernels,
        blas: &BlasHandle,
        prep: &HipPrepared,
        problem: &Problem,
        (x, mask, dy, dx): (u64, u64, u64, u64),
        out: &Outputs,
        b: &Buffers,
        stream: sys::hipStream_t,
    ) -> Result<()> {
        let cfg = problem.config;
        let (c, h, f) = (cfg.c, cfg.h, cfg.fused_proj_width());
        let (n, m) = (problem.shape.n, problem.shape.rows());
        let (n2, bh) = (n * n, problem.shape.batch * h);
        let af3 = cfg.formulation == Formulation::Af3;
        let opt = |o: &Option<DeviceMem>| o.as_ref().map_or(0, DeviceMem::addr);
        let p = BackwardParams {
            x,
            dy,
            mask,
            norm_in_w: prep.norm_in_w.addr(),
            norm_in_b: prep.norm_in_b.addr(),
            norm_out_w: prep.norm_out_w.addr(),
            norm_out_b: prep.norm_out_b.addr(),
            proj_bias: opt(&prep.proj_bias),
            out_bias: opt(&prep.out_bias),
            z: b.z,
            stats_x: b.stats_x,
            p: b.p,
            left: b.left,
            right: b.right,
            t: b.t,
            u: b.u,
            stats_t: b.stats_t,
            e: b.e,
            du: b.du,
            dcat: b.p,
            // dz goes where s/ds (or v) was: dead after the output stage.
            dz: b.e,
            dx,
            partial: b.partial,
            rows: m as i64,
            n2: n2 as i64,
            c: c as i32,
            h: h as i32,
            f: f as i32,
            af3: i32::from(af3),
            eps: problem.eps,
            blocks: 0,
        };
        let t_smem = h * (TILE + 1) * 4;
        // The LayerNorm backward kernels: blocks that loop over positions, as many as fit at once
        // on the device (64 KiB of LDS per CU, at most 8 blocks of 256 threads; at most
        // MAX_ROW_BLOCKS, the partial sums' rows), each with its accumulators.
        let cus = self.ctx.info.compute_units.max(1) as usize;
        let resident = |smem: usize, work: usize| {
            let per_cu = (LDS_BYTES / smem.max(1)).clamp(1, 8);
            (per_cu * cus).min(MAX_ROW_BLOCKS).min(work).max(1)
        };
        let out_grad_smem = output_norm_grad_smem(h);
        let out_grad_blocks = resident(out_grad_smem, m.div_ceil(TILE));
        let in_grad_blocks = resident(acc_smem(c), m.div_ceil(WARPS));
        let warp_rows = m.div_ceil(ROWS_PER_BLOCK);
        let tiles = m.div_ceil(TILE);
        let threads = THREADS as usize;
        let rm = GemmSpec::row_major;
        let go = |kernel: &Kernel, grid: usize, smem: usize, params: &BackwardParams| {
            // SAFETY: every pointer in `params` is the caller's (this function's contract) or
            // lies in `b`, carved for this problem, with the sizes `TmBackwardParams`'s comments
            // give; `BackwardParams` mirrors that struct.
            unsafe { launch(kernel, stream, grid, smem, params) }
        };
        // Row-major D = op(U)·op(V) (GemmSpec::row_major): column-major A = V, B = U.
        let gemm = |spec: GemmSpec, u: u64, v: u64, d: u64| -> Result<()> {
            let g = RocblasGemm::from_spec(&spec, DataType::F32, DataType::F32)?;
            // SAFETY: `u`, `v` and `d` hold the f32 matrices `spec` describes (the row-major
            // shapes at each call below), live until the stream has run the call; `blas` is
            // bound to `stream`.
            unsafe { blas.gemm(&g, 1.0, v, u, 0.0, d) }
        };
        let column_sum_of = |a: u64, rows: usize, cols: usize, ld: usize, to: usize| -> Result<()> {
            let row_blocks = rows.div_ceil(256).clamp(1, MAX_ROW_BLOCKS);
            let s = ColumnSums {
                a,
                partial: b.partial,
                out: b.sums + (to * 4) as u64,
                rows: rows as i64,
                cols: cols as i32,
                ld: ld as i32,
                row_blocks: row_blocks as i32,
                pad: 0,
            };
            // SAFETY: `a` holds `rows` rows of `ld ≥ cols` floats; `partial` holds row_blocks ×
            // cols doubles (sized for the widest sum) and `sums` `out.len` floats (`to + cols`
            // within it); `ColumnSums` mirrors `TmColumnSums`. The launches are stream-ordered.
            unsafe {
                launch(&k.column_partials, stream, row_blocks * cols.div_ceil(32), PARTIALS_SMEM as usize, &s)?;
                launch(&k.column_finish, stream, cols.div_ceil(threads), 0, &s)
            }
        };
        let column_sum = |a: u64, cols: usize, ld: usize, to: usize| column_sum_of(a, m, cols, ld, to);
        // The LayerNorm backward kernels' per-block sums of [γ | β] (2w columns) into `to`.
        let finish = |blocks: usize, w: usize, to: usize| -> Result<()> {
            let s = ColumnSums {
                a: 0,
                partial: b.partial,
                out: b.sums + (to * 4) as u64,
                rows: 0,
                cols: (2 * w) as i32,
                ld: 0,
                row_blocks: blocks as i32,
                pad: 0,
            };
            // SAFETY: the kernel before wrote `blocks` rows of 2w doubles into `partial` (sized
            // for MAX_ROW_BLOCKS of them); `sums` holds γ's and then β's gradient at `to`.
            unsafe { launch(&k.column_finish, stream, (2 * w).div_ceil(threads), 0, &s) }
        };
        let any_input_bias = prep.biases[..5].iter().any(|&b| b);
        let out_bias = prep.biases[5];
        // dW[wa, wb] = Σ_r U[r, :wa]ᵀ·V[r, :wb] over all M rows (U, V position-major with leading
        // dimensions lu, lv), in chunks of `rows` positions: one strided batch of GEMMs for the
        // whole chunks and one GEMM for the rest, each into its own f32 partial, summed in f64.
        let weight_grad = |(u, wa, lu): (u64, usize, usize), (v, wb, lv): (u64, usize, usize), to| {
            let rows = chunk_rows(m);
            let (whole, rest) = (m / rows, m % rows);
            let part = b.weight_partial;
            let spec = rm(wa, wb, rows, (true, lu), (false, lv), wb);
            let batched = GemmSpec {
                batch: whole,
                stride_a: if whole > 1 { rows * lv } else { 0 },
                stride_b: if whole > 1 { rows * lu } else { 0 },
                stride_d: if whole > 1 { wa * wb } else { 0 },
                ..spec
            };
            gemm(batched, u, v, part)?;
            if rest > 0 {
                let (at_u, at_v) = ((whole * rows * lu * 4) as u64, (whole * rows * lv * 4) as u64);
                let tail = rm(wa, wb, rest, (true, lu), (false, lv), wb);
                gemm(tail, u + at_u, v + at_v, part + (whole * wa * wb * 4) as u64)?;
            }
            column_sum_of(part, whole + usize::from(rest > 0), wa * wb, wa * wb, to)
        };
        for (src, dst, len) in [(prep.w_in.addr(), b.w_cat, f * c), (prep.w_out.addr(), b.w_out, c * h)] {
            let w = Widen { src, dst, n: len as i64 };
            // SAFETY: `src` holds `len` f16 words (the prepared weights), `dst` `len` floats.
            unsafe { launch(&k.widen, stream, len.div_ceil(threads), 0, &w)? };
        }
        let outgoing = problem.direction == Direction::Outgoing;

        // 1-5: the forward, recomputed, keeping what the backward reads.
        go(&k.input_norm, warp_rows, 0, &p)?;
        gemm(rm(m, f, c, (false, c), (true, c), f), b.z, b.w_cat, b.p)?;
        go(&k.gating, tiles, GATING_SMEM as usize, &p)?;
        // Outgoing t = L·Rᵀ, incoming t = Lᵀ·R, per (b, h).
        let square = |u_t: bool, v_t: bool| rm(n, n, n, (u_t, n), (v_t, n), n).batched(bh, n2);
        gemm(square(!outgoing, outgoing), b.left, b.right, b.t)?;
        go(&k.output_norm, tiles, t_smem, &p)?;

        // 6-9: the output projection and gate.
        if af3 {
            gemm(rm(m, c, h, (false, h), (true, h), c), b.u, b.w_out, b.e)?;
            go(&k.output_gate, (m * c).div_ceil(threads), 0, &p)?;
            weight_grad((b.e, c, c), (b.u, h, h), out.w_out)?;
            if out_bias {
                column_sum(b.e, c, c, out.b_out)?;
            }
            gemm(rm(m, h, c, (false, c), (false, h), h), b.e, b.w_out, b.du)?;
        } else {
            weight_grad((dy, c, c), (b.e, h, h), out.w_out)?;
            if out_bias {
                column_sum(dy, c, c, out.b_out)?;
            }
            gemm(rm(m, h, c, (false, c), (false, h), h), dy, b.w_out, b.du)?;
            go(&k.output_gate, (m * h).div_ceil(threads), 0, &p)?;
        }

        // 10: LN_H.
        go(
            &k.output_norm_grad,
            out_grad_blocks,
            out_grad_smem,
            &BackwardParams { blocks: out_grad_blocks as i32, ..p },
        )?;
        finish(out_grad_blocks, h, out.norm_out_w)?;

        // 11: the contraction. Outgoing dL = dT·R, dR = dTᵀ·L; incoming dL = R·dTᵀ, dR = L·dT.
        // dleft and dright go where u and du were (dead after LN_H's backward).
        let dt = b.t;
        let (dleft, dright) = (b.u, b.du);
        if outgoing {
            gemm(square(false, false), dt, b.right, dleft)?;
            gemm(square(true, false), dt, b.left, dright)?;
        } else {
            gemm(square(false, true), b.right, dt, dleft)?;
            gemm(square(false, false), b.left, dt, dright)?;
        }

        // 12-15: the input projections and LN_C.
        go(&k.gating_grad, tiles, GATING_SMEM as usize, &BackwardParams { left: dleft, right: dright, ..p })?;
        weight_grad((p.dcat, f, f), (b.z, c, c), out.w_cat)?;
        if any_input_bias {
            column_sum(p.dcat, f, f, out.b_cat)?;
        }
        gemm(rm(m, c, f, (false, f), (false, c), c), p.dcat, b.w_cat, p.dz)?;
        go(&k.input_norm_grad, in_grad_blocks, acc_smem(c), &BackwardParams { blocks: in_grad_blocks as i32, ..p })?;
        finish(in_grad_blocks, c, out.norm_in_w)
    }

    /// The backward on device memory, on `stream`, its buffers carved from `workspace` or else
    /// from the block the backend keeps: runs it, waits, and returns the weight gradients.
    ///
    /// # Safety
    /// As [`HipBackend::enqueue_backward`] for `io`; `stream` is a live stream of this device
    /// (or 0, the null stream); the workspace span, when given, is device memory of its bytes
    /// that nothing else uses until this returns.
    pub(super) unsafe fn backward_on_device(
        &self,
        prep: &HipPrepared,
        problem: &Problem,
        io: (u64, u64, u64, u64),
        stream: sys::hipStream_t,
        workspace: Option<DeviceSpan>,
    ) -> Result<Gradients> {
        let cfg = problem.config;
        let (c, h, f) = (cfg.c, cfg.h, cfg.fused_proj_width());
        let out = Outputs::new(c, h, f);
        let kernels = self.backward_kernels()?;
        let api = self.ctx.api;
        let poison = self.ctx.poison.load(Ordering::Relaxed);
        let run = |bufs: &Buffers| -> Result<Vec<f32>> {
            let blas = self.ctx.blas.lock().map_err(poisoned)?;
            let own = self.ctx.stream.raw();
            if stream != own {
                // SAFETY: the caller's stream is live for the work (this function's contract);
                // the handle goes back to our stream below, before the lock is released.
                unsafe { blas.set_stream(stream)? };
            }
            let enqueued = (|| -> Result<()> {
                if poison {
                    for &(at, bytes) in &bufs.all {
                        // SAFETY: a buffer carved for this problem from live device memory.
                        unsafe { result::memset_async(api, at, POISON_BYTE, bytes as usize, stream)? };
                    }
                }
                // SAFETY: forwarded from this function's contract; `bufs` was carved for this
                // problem.
                unsafe { self.enqueue_backward(&kernels, &blas, prep, problem, io, &out, bufs, stream) }
            })();
            let restored = if stream != own {
                // SAFETY: our own stream lives as long as the context that owns the handle.
                unsafe { blas.set_stream(own) }
            } else {
                Ok(())
            };
            // Whatever was enqueued (all of it, or what came before a failure) still writes dx
            // and the buffers: wait for it, so that the caller's memory is free when this returns.
            // SAFETY: a live stream of this device (the caller's, by contract, or ours).
            let waited = unsafe { result::stream_synchronize(api, stream) };
            enqueued?;
            restored?;
            waited?;
            let mut sums = vec![0f32; out.len];
            let view = DeviceMem::borrowed(api, &self.ctx.tracker, bufs.sums, out.len * 4);
            view.download(&self.ctx.stream, 0, &mut sums)?;
            Ok(sums)
        };
        let bytes = self.backward_span_bytes(problem)?;
        let carve = |span: DeviceSpan| -> Result<Buffers> {
            span.check("the backward's workspace", bytes)?;
            buffers_from(problem, &out, &mut Carver { at: span.ptr, end: Some(span.ptr + span.bytes) })
        };
        let sums = match workspace {
            Some(span) => run(&carve(span)?)?,
            None => {
                let mut kept = self.ctx.backward_block.lock().map_err(poisoned)?;
                let block = match kept.take() {
                    Some((k, block)) if k == backward_sizes(problem) => block,
                    // Other sizes: that block is freed first, so that it does not count against the
                    // new (the taken value would otherwise live to the end of this statement).
                    other => {
                        drop(other);
                        self.alloc_mem(bytes as usize)?
                    }
                };
                let sums = run(&carve(DeviceSpan { ptr: block.addr(), bytes })?);
                *kept = Some((backward_sizes(problem), block));
                sums?
            }
        };
        Ok(out.gradients(&sums, prep.biases, c, h))
    }
}
