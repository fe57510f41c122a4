//! The plans for forwards whose one-pass workspace does not fit the memory budget: hidden passes
//! of the fused input kernel and the contraction, then the output stage per row chunk with the
//! gate made again from x (`enqueue_chunked`), or the same plan on the portable stage kernels
//! (`enqueue_staged`, [`crate::backend::staged_steps`]); and the workspaces they run in.

use cudarc::driver::result as cu;
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::blas::{Elem, MatmulPlan};
use super::context::{ceil_div, CudaBackend};
use super::driver::{DeviceBuffer, DriverResult};
use super::workspace::{full_or_tail, CudaPrepared, CudaWorkspace, Layout, Staged};
use crate::backend::gemm::GemmSpec;
use crate::backend::params::{
    to_i32, to_i64, Addresses, CommonParams, InputParams, OutputParams, INPUT_NORM_ROWS_PER_BLOCK, STAGE_THREADS,
};
use crate::backend::staged_steps::{self, StagedBuffers, StagedStep};
use crate::error::{Error, Result};
use crate::plan::{Buffer, Plan};
use crate::problem::Problem;

impl CudaBackend {
    /// The workspace of a chunked plan of the fused input kernel, in `t` (`plan.t_bytes`) and
    /// `scratch` (`plan.scratch_bytes`): allocated here, or views of caller memory. It holds no
    /// copy of the weights (the kernels read the prepared ones), so it serves any weights of the
    /// layer's configuration with the same output-bias presence (its output GEMM plans refuse
    /// the other).
    pub(super) fn chunked_workspace(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        plan: Plan,
        t: DeviceBuffer<u16>,
        scratch: DeviceBuffer<u8>,
    ) -> Result<CudaWorkspace> {
        let tuning = self.tuning_for(problem);
        let (cws, ows) = (plan.contraction_ws.map_or(0, |r| r.bytes), plan.output_ws.map_or(0, |r| r.bytes));
        let cfg = problem.config;
        let m = problem.shape.rows();
        let blas = &self.inner.blas;
        let contraction = |hc: usize| {
            MatmulPlan::new(blas, GemmSpec::contraction(problem.direction, hc, problem.shape.n), Elem::F16, false, cws)
        };
        let output = |rows: usize| {
            MatmulPlan::new(
                blas,
                GemmSpec::output(rows, cfg.c, cfg.h),
                Elem::F32,
                prepared.tensors.out_bias.is_some(),
                ows,
            )
        };
        let (h_tail, m_tail) = (cfg.h % plan.hidden_chunk, m % plan.output_rows);
        let contraction = (contraction(plan.hidden_chunk)?, if h_tail > 0 { Some(contraction(h_tail)?) } else { None });
        let output = (output(plan.output_rows)?, if m_tail > 0 { Some(output(m_tail)?) } else { None });
        Ok(self.workspace_of(problem, plan, tuning, (Layout::Chunked { scratch }, t), contraction, output))
    }

    /// The workspace of a staged chunked plan: t, the scratch, every pass's rows of the gated
    /// projections copied from the prepared `[P, C]` weights into one `[lp; lg; rp; rg]` block per
    /// pass (and their biases), the cuBLASLt workspace and one plan per distinct GEMM.
    pub(super) fn staged_workspace(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        plan: Plan,
    ) -> Result<CudaWorkspace> {
        let tuning = self.tuning_for(problem);
        let (c, h) = (plan.c, plan.h);
        let stream = self.stream();
        let pass_w = self.alloc_buffer::<u8>(plan.pass_weights_bytes)?;
        for (dst, src, rows) in plan.pass_row_copies() {
            let (dst, src, row) = (dst as u64, src as u64, (c * 2) as u64);
            // SAFETY: the prepared weights hold P = 4H + G rows of C halves and the biases P f32;
            // pass_w holds 4H rows of C halves, then 4H f32 from pass_bias_offset; every range below
            // lies inside its allocation, and the stream is synchronised below.
            unsafe {
                cu::memcpy_dtod_async(
                    pass_w.ptr() + dst * row,
                    prepared.tensors.w_in.ptr() + src * row,
                    rows * c * 2,
                    stream,
                )
                .ctx("cuMemcpyDtoDAsync(pass weights)")?;
                if let Some(b) = &prepared.tensors.proj_bias {
                    let to = pass_w.ptr() + plan.pass_bias_offset as u64 + dst * 4;
                    cu::memcpy_dtod_async(to, b.ptr() + src * 4, rows * 4, stream)
                        .ctx("cuMemcpyDtoDAsync(pass biases)")?;
                }
            }
        }
        // Forwards may run on a caller's stream: the copies are done before this returns.
        // SAFETY: our own stream.
        unsafe { cu::stream::synchronize(stream) }.ctx("cuStreamSynchronize")?;
        let ws_bytes = plan.gemm_ws_bytes;
        let blas = &self.inner.blas;
        let out_bias = prepared.tensors.out_bias.is_some();
        let mut gemms = std::collections::HashMap::new();
        let mut add = |spec: GemmSpec, d: Elem, bias: bool| -> Result<()> {
            if let std::collections::hash_map::Entry::Vacant(e) = gemms.entry((spec, d, bias)) {
                e.insert(MatmulPlan::new(blas, spec, d, bias, ws_bytes)?);
            }
            Ok(())
        };
        // One plan per distinct GEMM the steps run (their addresses do not matter here).
        let bufs = StagedBuffers { scratch: 0, pass_w: 0, t: 0, w_in: 0, proj_bias: 0 };
        let base = CommonParams::new(problem, Addresses::default())?;
        for step in staged_steps::steps(&plan, problem, &base, bufs)? {
            match step {
                StagedStep::Gemm { spec, .. } => add(spec, Elem::F16, false)?,
                StagedStep::Output(chunk) => add(GemmSpec::output(chunk.common.rows(), c, h), Elem::F32, out_bias)?,
                _ => {}
            }
        }
        // The workspace's contraction and output fields are unused by this layout; they hold the
        // first pass's and first chunk's plans.
        let contraction = MatmulPlan::new(
            blas,
            GemmSpec::contraction(problem.direction, plan.hidden_chunk, problem.shape.n),
            Elem::F16,
            false,
            ws_bytes,
        )?;
        let output = MatmulPlan::new(blas, GemmSpec::output(plan.output_rows, c, h), Elem::F32, out_bias, ws_bytes)?;
        let t = self.alloc_buffer(plan.t_bytes / 2)?;
        let layout = Layout::Staged(Staged {
            scratch: self.alloc_buffer(plan.scratch_bytes)?,
            gemm_ws: self.alloc_buffer(ws_bytes)?,
            pass_w,
            gemms,
        });
        let mut ws = self.workspace_of(problem, plan, tuning, (layout, t), (contraction, None), (output, None));
        ws.weights_of = Some(prepared.id);
        Ok(ws)
    }

    /// The staged chunked plan ([`Staged`]): the steps of [`staged_steps::steps`] with our launches
    /// and cuBLASLt plans.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue`]; `base` holds that call's pointers and shape.
    pub(super) unsafe fn enqueue_staged(
        &self,
        prep: &CudaPrepared,
        ws: &mut CudaWorkspace,
        base: &CommonParams,
        stream: CUstream,
    ) -> Result<()> {
        let inner = &self.inner;
        let k = &inner.kernels;
        let problem = ws.problem;
        let t = ws.t.ptr();
        let fused_output = self.fused_output_for(&problem, ws.tuning);
        let Layout::Staged(st) = &mut ws.layout else {
            return Err(Error::InvalidArgument("workspace has no staged chunked plan".into()));
        };
        let bufs = StagedBuffers {
            scratch: st.scratch.ptr(),
            pass_w: st.pass_w.ptr(),
            t,
            w_in: prep.tensors.w_in.ptr(),
            proj_bias: prep.tensors.proj_bias_address(),
        };
        let (gws, gws_len) = (st.gemm_ws.ptr(), st.gemm_ws.bytes() as usize);
        let (c, h) = (ws.plan.c, ws.plan.h);
        // SAFETY (every launch and GEMM below): the steps' addresses lie inside the workspace's
        // buffers, the prepared weights and the call's x, mask and y, as the plan lays them out
        // (`staged_steps::tests::steps_stay_inside_their_buffers_and_cover_the_problem`).
        for step in staged_steps::steps(&ws.plan, &problem, base, bufs)? {
            match step {
                StagedStep::Norm(p) => {
                    let grid = ceil_div(p.common.rows(), INPUT_NORM_ROWS_PER_BLOCK as usize);
                    k.input_norm.launch(grid, STAGE_THREADS, 0, stream, &p)?;
                }
                StagedStep::Gemm { spec, a, b, d } => {
                    st.gemm(spec, Elem::F16, false)?.run(&inner.blas, a, b, d, 0, gws, gws_len, stream)?;
                }
                StagedStep::Gating { params, tile_rows, smem } => {
                    let grid = ceil_div(params.common.rows(), tile_rows);
                    k.input_gating.launch(grid, STAGE_THREADS, smem as u32, stream, &params)?;
                }
                StagedStep::PassesDone => self.mark("hidden passes (stage kernels, cuBLASLt)", stream)?,
                StagedStep::Output(chunk) => {
                    let spec = GemmSpec::output(chunk.common.rows(), c, h);
                    let gemm = st.gemm(spec, Elem::F32, prep.tensors.out_bias.is_some())?;
                    self.enqueue_output(prep, fused_output, gemm, &chunk, gws, gws_len, stream, false)?;
                }
            }
        }
        self.mark("output stage (gate, LayerNorm, GEMM) per row chunk", stream)
    }

    /// The chunked plan (see [`crate::plan`]): hidden passes of the fused
    /// input kernel and the contraction, then the output stage per row chunk with the gate
    /// recomputed from x. In place, each row chunk reads its rows of x (the gate) before the
    /// output GEMM writes them.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue`]; `scratch` is the workspace's scratch buffer of
    /// `plan.scratch_bytes` bytes and `base` holds the call's pointers.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn enqueue_chunked(
        &self,
        prep: &CudaPrepared,
        ws: &mut CudaWorkspace,
        scratch: CUdeviceptr,
        base: &CommonParams,
        m: usize,
        stream: CUstream,
    ) -> Result<()> {
        let inner = &self.inner;
        let (Some(f), Some(kernel)) = (prep.fused.as_ref(), self.chunk_kernel(prep, ws.tuning)) else {
            return Err(Error::InvalidArgument("a chunked plan needs the fused input kernel".into()));
        };
        let h = base.h();
        let (batch, nn) = (ws.problem.shape.batch, ws.problem.shape.n * ws.problem.shape.n);
        let fused = base.with_fused(&f.layout, f.w.ptr(), f.bias.as_ref().map_or(0, |b| b.ptr()))?;
        let n_gating = f.layout.h_pad / 32;

        // Phase A: per hidden pass, left/right of its channels for every position, then its
        // channels of t, one strided-batched GEMM per batch (t's channels of a pass are
        // contiguous within a batch only).
        let plan = ws.plan.clone();
        let base_of = |b: Buffer| match b {
            Buffer::Y => base.y(),
            Buffer::Scratch => scratch,
            _ => 0,
        };
        let (left, right) = (Plan::address(plan.left, base_of), Plan::address(plan.right, base_of));
        let cws_region = Plan::require(plan.contraction_ws, "contraction workspace")?;
        let cws = Plan::address(cws_region, base_of);
        for (h0, n) in plan.passes() {
            let kp = InputParams {
                common: fused.over(0, m)?,
                left,
                right,
                chunk_begin: to_i32(h0 / 32, "first column chunk")?,
                chunk_end: to_i32((h0 + n).div_ceil(32), "last column chunk")?,
                lr_h0: to_i32(h0, "first channel of a pass")?,
                lr_h: to_i32(n, "channels of a pass")?,
                ..InputParams::default()
            };
            kernel.launch(m, stream, &kp)?;
            let gemm = full_or_tail(&mut ws.contraction, &mut ws.contraction_tail, n == plan.hidden_chunk);
            if gemm.spec().batch != n {
                return Err(Error::InvalidArgument(format!("no contraction plan for a pass of {n} channels")));
            }
            for b in 0..batch {
                let off = (b * n * nn * 2) as u64;
                let t = ws.t.ptr() + ((b * h + h0) * nn * 2) as u64;
                gemm.run(&inner.blas, right + off, left + off, t, 0, cws, cws_region.bytes, stream)?;
            }
        }
        self.mark("hidden passes (input projections, contraction)", stream)?;

        // Phase B: per row chunk, the gate from x, LN_H (⊙ gate), the output GEMM (+ bias) into
        // y's rows, and af3's gate.
        let (gate, ows) = (Plan::require(plan.gate, "gate")?, Plan::require(plan.output_ws, "output workspace")?);
        let (gate, a) = (Plan::address(gate, base_of), Plan::address(plan.a, base_of));
        let (ows_len, ows) = (ows.bytes, Plan::address(ows, base_of));
        let fused_output = self.fused_output_for(&ws.problem, ws.tuning);
        for (r0, rows) in plan.output_chunks() {
            let (common, buf_row0) = (fused.over(r0, rows)?, to_i64(r0, "first position of a chunk")?);
            let chunk = OutputParams { common, t: ws.t.ptr(), a, gate, buf_row0, ..OutputParams::default() };
            // The gate's column chunks alone.
            let kp = InputParams {
                common,
                gate,
                buf_row0,
                chunk_begin: to_i32(n_gating, "first gate column chunk")?,
                chunk_end: to_i32(n_gating + f.layout.g_pad / 128, "last gate column chunk")?,
                ..InputParams::default()
            };
            kernel.launch(rows, stream, &kp)?;
            let gemm = full_or_tail(&mut ws.output, &mut ws.output_tail, rows == plan.output_rows);
            self.enqueue_output(prep, fused_output, gemm, &chunk, ows, ows_len, stream, false)?;
        }
        self.mark("output stage (gate, LayerNorm, GEMM) per row chunk", stream)?;
        Ok(())
    }
}
