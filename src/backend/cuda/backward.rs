//! The CUDA backward pass: every gradient of `L` given `dy`, recomputing the forward's
//! intermediates from `x` (`docs/backward.md` derives the math; `common/backward.h` has the
//! kernels and the same lines per kernel). cuBLASLt does the GEMMs, our kernels everything
//! between them.
//!
//! # Steps (`M = B·N²` positions, `F = 4H + G`; gpumode's differences in brackets)
//! ```text
//!  1 input_norm        z = LN_C(x), (μ, ρ)_x                    [M, C]
//!  2 GEMM              P = z·Wcatᵀ                              [M, F]
//!  3 gating            left, right                              [B, H, N²]
//!  4 GEMM (B·H)        t = contraction(left, right)             [B, H, N²]
//!  5 output_norm       u = LN_H(t), (μ, ρ)_t   [v = u⊙σ(P_G)]   [M, H]
//!  6 GEMM              s = u·Wzᵀ               [dWout = dyᵀ·v]
//!  7 output_gate       ds, dG                  [GEMM dv = dy·Wout; output_gate: du, dG]
//!  8 GEMM              dWz = dsᵀ·u; Σ ds → dbz [Σ dy → dbout]
//!  9 GEMM              du = ds·Wz
//! 10 output_norm_grad dt (over t); Σ du⊙t̂ → dγ_out, Σ du → dβ_out
//! 11 GEMM (B·H)        dleft, dright (over u and du)
//! 12 gating_grad       dcat[:, :4H] (dcat over P, column by column: output_gate writes dG over
//!                      P_G, gating_grad the rest over P's first 4H columns)
//! 13 GEMM              dWcat = dcatᵀ·z; Σ dcat → dbcat
//! 14 GEMM              dz = dcat·Wcat (over s)
//! 15 input_norm_grad   dx; Σ dz⊙x̂ → dγ_in, Σ dz → dβ_in
//! ```
//!
//! # Precision and memory
//! The kernels compute and store in f32. The column sums are f64 in a fixed order: the bias
//! sums (skipped for biases the layer lacks) in f64 from the start, per row block then across
//! blocks; the LayerNorm-weight sums f32 per warp inside the LayerNorm backward kernels, then
//! f64. The GEMMs read f32 and run on the tensor cores in TF32
//! (10-bit mantissa, as the forward's f16 operands, but f32's range, which gradients need) with
//! f32 accumulation, including the weight gradients' sums over all `M` positions. The weights are
//! the prepared f16 ones, widened. Every intermediate is a whole f32 tensor, the later ones over
//! earlier ones that are dead by then: about `(C + F + 5H + max(C, H))·4` bytes per position
//! (6 KiB at C = H = 128), nothing chunked; the x, dy and dx tensors are the caller's. The
//! buffers come from a caller's workspace span, or else from the backend, which keeps them for
//! the next backward of the same sizes (`Backend::free_backward_buffers`).

use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::blas::MatmulPlan;
use super::context::{ceil_div, CudaBackend, MAX_GEMM_WORKSPACE, POISON_BYTE};
use super::driver::DeviceBuffer;
use super::kernels::Stage;
use super::workspace::CudaPrepared;
use crate::backend::backward_params::{
    acc_smem, backward_sizes, chunk_rows, output_norm_grad_smem, BackwardParams, ColumnSums, Outputs, Widen,
    GATING_SMEM, MAX_ROW_BLOCKS, PARTIALS_SMEM, ROWS_PER_BLOCK, THREADS, TILE, WARPS,
};
use crate::backend::gemm::GemmSpec;
use crate::device_io::{DeviceSpan, SPAN_ALIGN};
use crate::error::{Error, Result};
use crate::gradients::Gradients;
use crate::problem::{Direction, Formulation, Problem};

/// One backward's device tensors (module docs: what each holds): views into one block, the
/// caller's workspace span or the one the backend keeps for the next backward of the same sizes.
struct Buffers {
    z: DeviceBuffer<f32>,
    stats_x: DeviceBuffer<f32>,
    p: DeviceBuffer<f32>,
    left: DeviceBuffer<f32>,
    right: DeviceBuffer<f32>,
    t: DeviceBuffer<f32>,
    u: DeviceBuffer<f32>,
    stats_t: DeviceBuffer<f32>,
    e: DeviceBuffer<f32>,
    du: DeviceBuffer<f32>,
    w_cat: DeviceBuffer<f32>,
    w_out: DeviceBuffer<f32>,
    /// The weight gradients' per-chunk f32 sums, `[chunks + 1, widest weight]`.
    weight_partial: DeviceBuffer<f32>,
    partial: DeviceBuffer<f64>,
    sums: DeviceBuffer<f32>,
    gemm_ws: DeviceBuffer<u8>,
}

/// Where a backward's buffers come from: views into a block of device memory (each 256-byte
/// aligned), or nowhere (counting the block's bytes).
enum Source {
    Span { at: u64, end: u64 },
    Count(u64),
}

impl Source {
    fn take<T>(&mut self, be: &CudaBackend, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = ((len.max(1) * std::mem::size_of::<T>()) as u64).next_multiple_of(SPAN_ALIGN);
        let view = |ptr| DeviceBuffer::borrowed(&be.inner.ctx, &be.inner.tracker, ptr, len);
        match self {
            Source::Span { at, end } => {
                if *at + bytes > *end {
                    return Err(Error::InvalidArgument("the backward's workspace is too small".into()));
                }
                let b = view(*at);
                *at += bytes;
                Ok(b)
            }
            // A view of nothing, never dereferenced: only the byte count is wanted.
            Source::Count(total) => {
                *total += bytes;
                Ok(view(0))
            }
        }
    }
}

impl CudaBackend {
    /// Refuses a backward whose LayerNorm kernels would need more shared memory per block than
    /// the GPU has (they hold a 32-position tile of t, and per-warp column sums): H ≤ 1185 and
    /// C ≤ 3632 on an H100, before anything is enqueued.
    pub(super) fn check_backward_fits(&self, problem: &Problem) -> Result<()> {
        let (c, h) = (problem.config.c, problem.config.h);
        let max = self.inner.kernels.max_smem;
        let need = [("H", h, output_norm_grad_smem(h)), ("C", c, acc_smem(c))];
        match need.into_iter().find(|&(_, _, bytes)| bytes > max) {
            Some((name, v, bytes)) => Err(Error::Unsupported {
                backend: crate::error::BackendKind::Cuda,
                what: format!(
                    "the backward pass at {name} = {v} (its LayerNorm kernels need {bytes} bytes of shared memory \
                     per block; this GPU has {max})"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Bytes of the workspace span a backward of `problem` carves its buffers from
    /// ([`Backend::backward_device`](crate::Backend) with a workspace).
    pub(super) fn backward_span_bytes(&self, problem: &Problem) -> Result<u64> {
        let out = Outputs::new(problem.config.c, problem.config.h, problem.config.fused_proj_width());
        let mut count = Source::Count(0);
        drop(self.backward_buffers_from(problem, &out, &mut count)?);
        match count {
            Source::Count(total) => Ok(total),
            _ => Err(Error::Internal("the backward's byte count was not counted".into())),
        }
    }

    /// One backward's tensors, carved in order from `src` (or counted).
    fn backward_buffers_from(&self, problem: &Problem, out: &Outputs, src: &mut Source) -> Result<Buffers> {
        let cfg = problem.config;
        let m = problem.shape.rows();
        let (c, h, f) = (cfg.c, cfg.h, cfg.fused_proj_width());
        let widest = (f * c).max(c * h);
        let chunks = m / chunk_rows(m) + 1;
        let mut a = |len: usize| src.take::<f32>(self, len);
        Ok(Buffers {
            z: a(m * c)?,
            stats_x: a(2 * m)?,
            p: a(m * f)?,
            left: a(m * h)?,
            right: a(m * h)?,
            t: a(m * h)?,
            u: a(m * h)?,
            stats_t: a(2 * m)?,
            e: a(m * c.max(h))?,
            du: a(m * h)?,
            w_cat: a(f * c)?,
            w_out: a(c * h)?,
            weight_partial: a(chunks * widest)?,
            sums: a(out.len)?,
            partial: src.take::<f64>(self, (MAX_ROW_BLOCKS * f.max(2 * c).max(2 * h)).max(widest))?,
            gemm_ws: src.take::<u8>(self, MAX_GEMM_WORKSPACE)?,
        })
    }

    /// With poisoning on, fills every intermediate with NaN, so that an element a step fails to
    /// write shows in the gradients.
    fn poison_backward_buffers(&self, b: &mut Buffers, stream: CUstream) -> Result<()> {
        if self.inner.poison.load(std::sync::atomic::Ordering::Relaxed) {
            for buf in [
                &mut b.z,
                &mut b.stats_x,
                &mut b.p,
                &mut b.left,
                &mut b.right,
                &mut b.t,
                &mut b.u,
                &mut b.stats_t,
                &mut b.e,
                &mut b.du,
                &mut b.w_cat,
                &mut b.w_out,
                &mut b.weight_partial,
                &mut b.sums,
            ] {
                buf.memset_async(POISON_BYTE, stream)?;
            }
        }
        Ok(())
    }

    /// Drops the block the last backward kept: the next backward allocates one again.
    pub(super) fn drop_backward_buffers(&self) {
        if let Ok(mut kept) = self.inner.backward_block.lock() {
            *kept = None;
        }
    }

    /// Enqueues the backward on device memory: `x`, `dy` and `dx` are `[M, C]` f32, `mask` `[M]`
    /// f32 or 0; `b` (sized for the problem) holds the weight gradients in `sums`, at `out`'s
    /// offsets, once the stream has run.
    ///
    /// # Safety
    /// `x`, `dy`, `mask` (when non-zero) and `dx` are live device allocations of those sizes
    /// until the stream has run the work; `dx` aliases none of the others.
    unsafe fn enqueue_backward(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        (x, mask, dy, dx): (CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr),
        out: &Outputs,
        b: &Buffers,
        stream: CUstream,
    ) -> Result<()> {
        let cfg = problem.config;
        let (c, h, f) = (cfg.c, cfg.h, cfg.fused_proj_width());
        let (n, m) = (problem.shape.n, problem.shape.rows());
        let (n2, bh) = (n * n, problem.shape.batch * h);
        let af3 = cfg.formulation == Formulation::Af3;
        let k = &self.inner.kernels.backward;
        let blas = &self.inner.blas;
        let opt = |o: &Option<DeviceBuffer<f32>>| o.as_ref().map_or(0, |b| b.ptr());
        let p = BackwardParams {
            x,
            dy,
            mask,
            norm_in_w: prep.norm_in_w.ptr(),
            norm_in_b: prep.norm_in_b.ptr(),
            norm_out_w: prep.norm_out_w.ptr(),
            norm_out_b: prep.norm_out_b.ptr(),
            proj_bias: opt(&prep.proj_bias),
            out_bias: opt(&prep.out_bias),
            z: b.z.ptr(),
            stats_x: b.stats_x.ptr(),
            p: b.p.ptr(),
            left: b.left.ptr(),
            right: b.right.ptr(),
            t: b.t.ptr(),
            u: b.u.ptr(),
            stats_t: b.stats_t.ptr(),
            e: b.e.ptr(),
            du: b.du.ptr(),
            dcat: b.p.ptr(),
            // dz goes where s/ds (or v) was: dead after the output stage.
            dz: b.e.ptr(),
            dx,
            partial: b.partial.ptr(),
            rows: m as i64,
            n2: n2 as i64,
            c: c as i32,
            h: h as i32,
            f: f as i32,
            af3: i32::from(af3),
            eps: problem.eps,
            blocks: 0,
        };
        let t_smem = (h * (TILE + 1) * 4) as u32;
        // The LayerNorm backward kernels: blocks that loop over positions, as many as fit at once
        // (at most MAX_ROW_BLOCKS, the partial sums' rows), each with its accumulators.
        let resident = |smem: usize, work: usize| {
            let per_sm = (self.inner.smem_per_sm / smem.max(1)).clamp(1, 8);
            (per_sm * self.inner.info.compute_units as usize).min(MAX_ROW_BLOCKS).min(work).max(1)
        };
        let out_grad_smem = output_norm_grad_smem(h);
        let out_grad_blocks = resident(out_grad_smem, m.div_ceil(TILE));
        let in_grad_blocks = resident(acc_smem(c), m.div_ceil(WARPS));
        let warp_rows = ceil_div(m, ROWS_PER_BLOCK);
        let tiles = ceil_div(m, TILE);
        let rm = GemmSpec::row_major;
        let launch = |stage: &Stage, grid: u32, smem: u32, params: &BackwardParams| {
            // SAFETY: every pointer in `params` is a live allocation of the size its field's
            // comment in `TmBackwardParams` gives for this problem (the caller's by this
            // function's contract, the rest allocated above for this problem), until the stream
            // has run the launch; `BackwardParams` mirrors the struct the kernel takes.
            unsafe { stage.launch_with(grid, THREADS, smem, stream, params, false) }
        };
        let gemm = |spec: GemmSpec, u: CUdeviceptr, v: CUdeviceptr, d: CUdeviceptr| -> Result<()> {
            let mut plan = MatmulPlan::tf32(blas, spec, MAX_GEMM_WORKSPACE)?;
            // SAFETY: `u`, `v` and `d` hold the matrices `spec` describes (the row-major shapes
            // at each call below); the workspace holds MAX_GEMM_WORKSPACE bytes; all live
            // until the stream has run the call.
            unsafe { plan.run(blas, v, u, d, 0, b.gemm_ws.ptr(), MAX_GEMM_WORKSPACE, stream) }
        };
        let column_sum_of = |a: CUdeviceptr, rows: usize, cols: usize, ld: usize, to: usize| -> Result<()> {
            let row_blocks = rows.div_ceil(256).clamp(1, MAX_ROW_BLOCKS);
            let s = ColumnSums {
                a,
                partial: b.partial.ptr(),
                out: b.sums.ptr() + (to * 4) as u64,
                rows: rows as i64,
                cols: cols as i32,
                ld: ld as i32,
                row_blocks: row_blocks as i32,
                pad: 0,
            };
            let chunks = cols.div_ceil(32);
            // SAFETY: `a` holds `rows` rows of `ld ≥ cols` floats; `partial` holds row_blocks ×
            // cols doubles (sized for the widest sum) and `sums` `out.len` floats (`to + cols`
            // within it); `ColumnSums` mirrors `TmColumnSums`. The two launches are stream-ordered.
            unsafe {
                k.column_partials.launch_with(
                    (row_blocks * chunks) as u32,
                    THREADS,
                    PARTIALS_SMEM,
                    stream,
                    &s,
                    false,
                )?;
                k.column_finish.launch_with(ceil_div(cols, THREADS as usize), THREADS, 0, stream, &s, false)
            }
        };
        let column_sum = |a: CUdeviceptr, cols: usize, ld: usize, to: usize| column_sum_of(a, m, cols, ld, to);
        // The LayerNorm backward kernels' per-block sums of [γ | β] (2w columns) into `to`.
        let finish = |blocks: usize, w: usize, to: usize| -> Result<()> {
            let s = ColumnSums {
                a: 0,
                partial: b.partial.ptr(),
                out: b.sums.ptr() + (to * 4) as u64,
                rows: 0,
                cols: (2 * w) as i32,
                ld: 0,
                row_blocks: blocks as i32,
                pad: 0,
            };
            // SAFETY: the kernel before wrote `blocks` rows of 2w doubles into `partial` (sized
            // for MAX_ROW_BLOCKS of them); `sums` holds γ's and then β's gradient at `to`.
            unsafe { k.column_finish.launch_with(ceil_div(2 * w, THREADS as usize), THREADS, 0, stream, &s, false) }
        };
        let any_input_bias = prep.biases[..5].iter().any(|&b| b);
        let out_bias = prep.biases[5];
        // dW[wa, wb] = Σ_r U[r, :wa]ᵀ·V[r, :wb] over all M rows (U, V position-major with leading
        // dimensions lu, lv), in chunks of `rows` positions: one strided batch of GEMMs for the
        // whole chunks and one for the rest, each into its own f32 partial, summed in f64.
        let weight_grad = |(u, wa, lu): (CUdeviceptr, usize, usize), (v, wb, lv): (CUdeviceptr, usize, usize), to| {
            let rows = chunk_rows(m);
            let (whole, rest) = (m / rows, m % rows);
            let part = b.weight_partial.ptr();
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
        for (src, dst, len) in [(prep.w_in.ptr(), b.w_cat.ptr(), f * c), (prep.w_out.ptr(), b.w_out.ptr(), c * h)] {
            let w = Widen { src, dst, n: len as i64 };
            // SAFETY: `src` holds `len` f16 words (the prepared weights), `dst` `len` floats.
            unsafe { k.widen.launch_with(ceil_div(len, THREADS as usize), THREADS, 0, stream, &w, false)? };
        }
        let outgoing = problem.direction == Direction::Outgoing;

        self.mark("start", stream)?;
        // 1-5: the forward, recomputed, keeping what the backward reads.
        launch(&k.input_norm, warp_rows, 0, &p)?;
        gemm(rm(m, f, c, (false, c), (true, c), f), b.z.ptr(), b.w_cat.ptr(), b.p.ptr())?;
        self.mark("LN_C and the input projection", stream)?;
        launch(&k.gating, tiles, GATING_SMEM, &p)?;
        self.mark("gating", stream)?;
        // Outgoing t = L·Rᵀ, incoming t = Lᵀ·R, per (b, h).
        let square = |u_t: bool, v_t: bool| rm(n, n, n, (u_t, n), (v_t, n), n).batched(bh, n2);
        gemm(square(!outgoing, outgoing), b.left.ptr(), b.right.ptr(), b.t.ptr())?;
        self.mark("contraction", stream)?;
        launch(&k.output_norm, tiles, t_smem, &p)?;
        self.mark("LN_H", stream)?;

        // 6-9: the output projection and gate.
        if af3 {
            gemm(rm(m, c, h, (false, h), (true, h), c), b.u.ptr(), b.w_out.ptr(), b.e.ptr())?;
            launch(&k.output_gate, ceil_div(m * c, THREADS as usize), 0, &p)?;
            weight_grad((b.e.ptr(), c, c), (b.u.ptr(), h, h), out.w_out)?;
            if out_bias {
                column_sum(b.e.ptr(), c, c, out.b_out)?;
            }
            gemm(rm(m, h, c, (false, c), (false, h), h), b.e.ptr(), b.w_out.ptr(), b.du.ptr())?;
        } else {
            weight_grad((dy, c, c), (b.e.ptr(), h, h), out.w_out)?;
            if out_bias {
                column_sum(dy, c, c, out.b_out)?;
            }
            gemm(rm(m, h, c, (false, c), (false, h), h), dy, b.w_out.ptr(), b.du.ptr())?;
            launch(&k.output_gate, ceil_div(m * h, THREADS as usize), 0, &p)?;
        }

        self.mark("output projection and gate backward", stream)?;
        // 10: LN_H.
        launch(
            &k.output_norm_grad,
            out_grad_blocks as u32,
            out_grad_smem as u32,
            &BackwardParams { blocks: out_grad_blocks as i32, ..p },
        )?;
        finish(out_grad_blocks, h, out.norm_out_w)?;
        self.mark("LN_H backward", stream)?;

        // 11: the contraction. Outgoing dL = dT·R, dR = dTᵀ·L; incoming dL = R·dTᵀ, dR = L·dT.
        // dleft and dright go where u and du were (dead after LN_H's backward).
        let dt = b.t.ptr();
        let (dleft, dright) = (b.u.ptr(), b.du.ptr());
        if outgoing {
            gemm(square(false, false), dt, b.right.ptr(), dleft)?;
            gemm(square(true, false), dt, b.left.ptr(), dright)?;
        } else {
            gemm(square(false, true), b.right.ptr(), dt, dleft)?;
            gemm(square(false, false), b.left.ptr(), dt, dright)?;
        }

        self.mark("contraction backward", stream)?;
        // 12-15: the input projections and LN_C.
        launch(&k.gating_grad, tiles, GATING_SMEM, &BackwardParams { left: dleft, right: dright, ..p })?;
        self.mark("gating backward", stream)?;
        weight_grad((p.dcat, f, f), (b.z.ptr(), c, c), out.w_cat)?;
        if any_input_bias {
            column_sum(p.dcat, f, f, out.b_cat)?;
        }
        self.mark("input weight gradients", stream)?;
        gemm(rm(m, c, f, (false, f), (false, c), c), p.dcat, b.w_cat.ptr(), p.dz)?;
        self.mark("dz = dcat·Wcat", stream)?;
        launch(
            &k.input_norm_grad,
            in_grad_blocks as u32,
            acc_smem(c) as u32,
            &BackwardParams { blocks: in_grad_blocks as i32, ..p },
        )?;
        finish(in_grad_blocks, c, out.norm_in_w)?;
        self.mark("LN_C backward", stream)
    }

    /// The backward on device memory, on `stream` (see
    /// [`Backend::backward_buffers`](crate::Backend)), its buffers carved from `workspace` or
    /// else the backend's own (kept for the next backward of the same sizes): runs it, waits,
    /// and returns the weight gradients.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue_backward`].
    pub(super) unsafe fn backward_on_device(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        io: (CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr),
        stream: CUstream,
        workspace: Option<DeviceSpan>,
    ) -> Result<Gradients> {
        let cfg = problem.config;
        let (c, h, f) = (cfg.c, cfg.h, cfg.fused_proj_width());
        let out = Outputs::new(c, h, f);
        let run = |bufs: &mut Buffers| -> Result<Vec<f32>> {
            // SAFETY: forwarded from this function's contract; `bufs` was sized for this problem.
            let enqueued = self
                .poison_backward_buffers(bufs, stream)
                .and_then(|()| unsafe { self.enqueue_backward(prep, problem, io, &out, bufs, stream) });
            if let Err(e) = enqueued {
                // What was enqueued before the failure still writes dx and the buffers: wait for
                // it, so that the caller's memory is free when this returns, as promised.
                // SAFETY: a live stream of this context (the caller's or the backend's).
                let _ = unsafe { cudarc::driver::result::stream::synchronize(stream) };
                return Err(e);
            }
            let mut sums = vec![0f32; out.len];
            // Waits for the backward: the buffers are free for the next call once this returns.
            bufs.sums.download(&mut sums, stream)?;
            Ok(sums)
        };
        let bytes = self.backward_span_bytes(problem)?;
        let carve = |span: DeviceSpan| -> Result<Buffers> {
            span.check("the backward's workspace", bytes)?;
            self.backward_buffers_from(problem, &out, &mut Source::Span { at: span.ptr, end: span.ptr + span.bytes })
        };
        let sums = match workspace {
            Some(span) => run(&mut carve(span)?)?,
            None => {
                let mut kept =
                    self.inner.backward_block.lock().map_err(|_| {
                        Error::Internal("a backward panicked while holding the backward buffers".into())
                    })?;
                let block = match kept.take() {
                    Some((k, block)) if k == backward_sizes(problem) => block,
                    // Other sizes: that block is freed first, so that it does not count against the
                    // new (the taken value would otherwise live to the end of this statement).
                    other => {
                        drop(other);
                        self.alloc_buffer::<u8>(bytes as usize)?
                    }
                };
                let sums = run(&mut carve(DeviceSpan { ptr: block.ptr(), bytes })?);
                *kept = Some((backward_sizes(problem), block));
                sums?
            }
        };
        Ok(out.gradients(&sums, prep.biases, c, h))
    }
}
