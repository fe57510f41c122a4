//! One forward's launches in the one-pass plan (the whole workspace fits): the input build
//! (fused kernel — warp-specialised, wgmma or mma.sync — or the portable kernels with the
//! cuBLASLt projection), the contraction, and the output stage (the fused output kernel in its
//! plain, resident or gate-from-x form, or LN_H + cuBLASLt + af3's gate kernel); and the choice of
//! kernels those launches use.

use std::sync::atomic::Ordering;

use cudarc::driver::result as cu;
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::blas::MatmulPlan;
use super::context::{ceil_div, CudaBackend, OutputGate, POISON_BYTE};
use super::driver::DriverResult;
use super::kernels;
use super::launch_graph::{self, Mode, Plan as GraphPlan};
use super::tuning::Tuning;
use super::workspace::{
    full_or_tail, output_projection_smem, CudaPrepared, CudaWorkspace, FusedInput, FusedKernel, InputBuild, Layout,
    WsBuild, OUTPUT_PROJECTION_ROWS, OUTPUT_RESIDENT_SMEM, OUTPUT_XGATE_SMEM, WS_SMEM_BYTES,
};
use crate::backend::params::{
    self, to_i32, Addresses, CommonParams, InputParams, OutputParams, FUSED_INPUT_ROWS, INPUT_NORM_ROWS_PER_BLOCK,
    STAGE_THREADS,
};
use crate::backend::{check_device_forward, check_same_weights, Backend};
use crate::error::{Error, Result};
use crate::plan::{Buffer, Plan};
use crate::problem::{Formulation, Precision, Problem};

impl CudaBackend {
    /// Whether a one-pass forward of `problem` can make the output gate from x in the output stage
    /// (`output_projection_sm90_xgate`) instead of storing it in the input stage and reading it
    /// back: af3 (whose gate multiplies y; gpumode's would have to enter LN_H's tile) with 16-bit
    /// x (whose bytes are the stored gate's, so the output stage reads as much as before while
    /// the input stage writes a quarter less), C = H = 128, out of place (in place the contraction
    /// borrows x's bytes for its workspace), the fused input kernel and whole 64-position tiles
    /// inside a batch, on an H100 (sm_90a: wgmma) with room for two blocks per SM.
    pub(super) fn gate_from_x_for(&self, prep: &CudaPrepared, problem: &Problem, tuning: Tuning) -> bool {
        let cfg = &problem.config;
        let nn = problem.shape.n * problem.shape.n;
        self.inner.kernels.output_projection_sm90_xgate.is_some()
            && self.output_gate() != OutputGate::Stored
            && cfg.formulation == Formulation::Af3
            && problem.io != Precision::F32Io
            && !problem.in_place
            && (cfg.c, cfg.h, cfg.gate_width()) == (128, 128, 128)
            && prep.fused.as_ref().is_some_and(|f| (f.layout.k_pad, f.layout.h_pad) == (128, 128))
            && nn % OUTPUT_PROJECTION_ROWS == 0
            && self.blocks_fit(2, OUTPUT_XGATE_SMEM as usize)
            && self.fused_kernel_for(prep, problem, tuning).is_some()
    }

    /// The fused output kernel when it takes this configuration (H a multiple of 16 up to 128:
    /// the whole reduction in one shared-memory tile; C a multiple of 8: 8-byte stores) and
    /// measured faster. H100, against output_norm + cuBLASLt (+ the af3 gate pass): af3 gains
    /// everywhere (1024,1,128: 2.875 → 2.477 ms; 1024,1,384: 6.754 → 5.845 ms), gpumode gains a
    /// little at C = 128 (2.365 → 2.359 ms) and loses at C = 384 (4.282 → 4.387 ms), where
    /// cuBLASLt's GEMM beats reloading Wout per 128-column chunk.
    pub(super) fn fused_output_for(&self, problem: &Problem, tuning: Tuning) -> Option<&kernels::Stage> {
        let k = self.fused_output_fits(problem)?;
        if problem.io != Precision::F32Io {
            // The only output path that writes 16-bit y.
            return Some(k);
        }
        let wins = tuning.fused_output.unwrap_or_else(|| Tuning::fused_output_rule(problem));
        (wins && self.inner.fused_output.load(Ordering::Relaxed)).then_some(k)
    }

    /// The fused output kernel when it takes this configuration, faster or not and whatever
    /// [`CudaBackend::set_fused_output`] says: the sharded forward's only output path.
    pub(super) fn fused_output_fits(&self, problem: &Problem) -> Option<&kernels::Stage> {
        let cfg = &problem.config;
        let k = self.inner.kernels.output_projection.as_ref()?;
        let fits = cfg.h % 16 == 0
            && cfg.h <= 128
            && cfg.c % 8 == 0
            && output_projection_smem(cfg.formulation == Formulation::Af3, params::io_dtype(problem.io)) as usize
                <= self.inner.kernels.max_smem;
        fits.then_some(k)
    }

    /// Enqueues the fused output stage for `kp`'s rows (gate at `kp.gate` from `kp.buf_row0`).
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue`]: every pointer in `kp` is live and sized for the rows.
    pub(super) unsafe fn launch_output(&self, k: &kernels::Stage, kp: &OutputParams, stream: CUstream) -> Result<()> {
        // Programmatic dependents of the contraction (or the gate pass): Wout and the LN_H
        // parameters load under its tail.
        let pdl = self.inner.kernels.pdl;
        if let Some((resident, grid)) = self.resident_output(kp) {
            launch_graph::count(&self.inner.resident_launches);
            return resident.launch_dependent(grid, STAGE_THREADS, OUTPUT_RESIDENT_SMEM, stream, kp, pdl);
        }
        let p = &kp.common;
        k.launch_dependent(
            ceil_div(p.rows(), OUTPUT_PROJECTION_ROWS),
            STAGE_THREADS,
            output_projection_smem(p.formulation() == Formulation::Af3, p.io_dtype()),
            stream,
            kp,
            pdl,
        )
    }

    /// Enqueues af3's output stage that makes the gate from x (`output_projection_sm90_xgate`,
    /// [`CudaBackend::gate_from_x_for`]) for all `kp`'s positions; `kp.common` is the fused input
    /// kernel's, whose w_in, bias and pads name the gate's weights.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue`]: every pointer in `kp` is live and sized for the rows.
    pub(super) unsafe fn launch_output_from_x(&self, kp: &OutputParams, stream: CUstream) -> Result<()> {
        let inner = &self.inner;
        let k = inner.kernels.output_projection_sm90_xgate.as_ref().ok_or_else(|| {
            Error::InvalidArgument("this workspace needs the output kernel that makes the gate from x".into())
        })?;
        let grid = u32::try_from(kp.common.rows() / OUTPUT_PROJECTION_ROWS)
            .unwrap_or(u32::MAX)
            .min(2 * inner.info.compute_units);
        launch_graph::count(&inner.xgate_launches);
        k.launch_dependent(grid, STAGE_THREADS, OUTPUT_XGATE_SMEM, stream, kp, inner.kernels.pdl)?;
        self.mark("output stage (LayerNorm, gate from x, projection)", stream)
    }

    /// The resident output kernel and its grid (three blocks per SM, each walking tiles), when it
    /// takes `kp`'s launch: H = 128, C ≤ 128 (one column chunk; either formulation, any y
    /// precision), whole 64-position tiles inside one batch, and room for three blocks per SM.
    /// With two per SM the resident form lost to the plain kernel (H100, NOTES.md), so GPUs with
    /// less shared memory keep the plain one.
    pub(super) fn resident_output(&self, kp: &OutputParams) -> Option<(&kernels::Stage, u32)> {
        let k = self.inner.kernels.output_projection_resident.as_ref()?;
        let (p, rows) = (&kp.common, OUTPUT_PROJECTION_ROWS);
        let nn = p.n() * p.n();
        let takes = p.h() == 128
            && p.c() <= 128
            && p.rows() % rows == 0
            && p.row0() % rows == 0
            && nn % rows == 0
            && self.inner.resident_output.load(Ordering::Relaxed);
        if !takes || !self.blocks_fit(3, OUTPUT_RESIDENT_SMEM as usize) {
            return None;
        }
        let tiles = u32::try_from(p.rows() / rows).ok()?;
        Some((k, tiles.min(3 * self.inner.info.compute_units)))
    }

    /// Enqueues one forward on device addresses. See the module docs for the stages. Where
    /// launch graphs apply ([`CudaBackend::set_launch_graphs`]), the launches are recorded first
    /// and enqueued as one graph replay (`launch_graph.rs`).
    ///
    /// # Safety
    /// `x` and `y` must be device allocations of `B·N·N·C` f32, `mask` (unless 0) of `B·N·N`
    /// f32, in this backend's context, not aliasing each other or the workspace, and alive until
    /// `stream` has run the work.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn enqueue(
        &self,
        prep: &CudaPrepared,
        ws: &mut CudaWorkspace,
        problem: &Problem,
        x: CUdeviceptr,
        mask: CUdeviceptr,
        y: CUdeviceptr,
        stream: CUstream,
    ) -> Result<()> {
        // The context first: the capture query below needs it on this thread.
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        // SAFETY (every call below): forwarded from this function's contract.
        if !self.graphs_apply(ws, problem, stream)? {
            let poison = self.inner.poison.load(Ordering::Relaxed);
            return unsafe { self.enqueue_launches(prep, ws, problem, (x, mask, y), stream, poison) };
        }
        // Poisoning is off for every pass of this call (the switch may change meanwhile).
        let record = launch_graph::run_in(Mode::Record, || unsafe {
            self.enqueue_launches(prep, ws, problem, (x, mask, y), stream, false)
        })?;
        let shape = launch_graph::shape_of(&record);
        // Out of the workspace while the launches below borrow it.
        let mut cache = std::mem::take(&mut ws.graphs);
        let plan = if cache.rule_out(&record) { GraphPlan::Direct } else { cache.plan(&shape) };
        let graph = match plan {
            GraphPlan::Replay => cache.graph(),
            GraphPlan::Direct => None,
            GraphPlan::Capture => {
                let captured = launch_graph::capture(shape.clone(), |s| unsafe {
                    self.enqueue_launches(prep, ws, problem, (x, mask, y), s, false)
                });
                cache.keep(shape.clone(), captured)
            }
        };
        // A replay that fails has enqueued nothing (the launch is its last call): this call makes
        // its launches, and the shape is not captured again for a while.
        let replayed = graph.map(|g| unsafe { g.launch(&record, stream) });
        let mut again = || {
            launch_graph::run_in(Mode::Again, || unsafe {
                self.enqueue_launches(prep, ws, problem, (x, mask, y), stream, false)
            })
            .map(drop)
        };
        let done = match replayed {
            Some(Ok(())) => {
                self.inner.graph_launches.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Some(Err(_)) => {
                cache.forget(shape);
                again()
            }
            None => again(),
        };
        ws.graphs = cache;
        done
    }

    /// Whether this forward's launches go through a launch graph: the switch is on, the plan is
    /// one pass with the fused input build and a fused output stage (its launches are two
    /// kernels and the contraction's GEMM), whose GEMM takes no workspace memory (the plan lends
    /// it y's bytes, whose address moves; found by the first record), nothing is poisoned or
    /// timed, and the caller is not capturing `stream` itself.
    fn graphs_apply(&self, ws: &CudaWorkspace, problem: &Problem, stream: CUstream) -> Result<bool> {
        let inner = &self.inner;
        let fused_output = match &ws.layout {
            Layout::OnePass { blas_input: None, gate, .. } => {
                gate.is_none() || self.fused_output_for(problem, ws.tuning).is_some()
            }
            _ => false,
        };
        let applies = inner.launch_graphs.load(Ordering::Relaxed)
            && fused_output
            && !ws.graphs.ruled_out()
            && !inner.poison.load(Ordering::Relaxed)
            && inner.timeline.lock().is_ok_and(|t| t.is_none());
        // A stream whose capture state cannot be read gets the launches, which report the error.
        Ok(applies && !launch_graph::is_capturing(stream).unwrap_or(true))
    }

    /// The launches of one forward ([`CudaBackend::enqueue`]), made on `stream`; with `poison`,
    /// after filling y and the intermediates with NaN.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue_launches(
        &self,
        prep: &CudaPrepared,
        ws: &mut CudaWorkspace,
        problem: &Problem,
        (x, mask, y): (CUdeviceptr, CUdeviceptr, CUdeviceptr),
        stream: CUstream,
        poison: bool,
    ) -> Result<()> {
        check_device_forward(&prep.config, problem, x, mask, y)?;
        check_same_weights(ws.weights_of, prep.id)?;
        if !self.workspace_fits(ws, problem) {
            return Err(Error::InvalidArgument("workspace was made for another problem shape".into()));
        }
        // `enqueue`, its only caller, made the context current on this thread.
        let inner = &self.inner;
        let cfg = problem.config;
        let (c, h, g) = (cfg.c, cfg.h, cfg.gate_width());
        let m = problem.shape.rows();
        if poison {
            ws.t.memset_async(POISON_BYTE, stream)?;
            match &mut ws.layout {
                Layout::OnePass { left, right, gate, .. } => {
                    for b in [Some(left), Some(right), gate.as_mut()].into_iter().flatten() {
                        b.memset_async(POISON_BYTE, stream)?;
                    }
                }
                Layout::Chunked { scratch, .. } => scratch.memset_async(POISON_BYTE, stream)?,
                Layout::Staged(st) => st.scratch.memset_async(POISON_BYTE, stream)?,
            }
            if !problem.in_place {
                cu::memset_d8_async(y, POISON_BYTE, m * c * problem.io.io_bytes(), stream).ctx("cuMemsetD8Async(y)")?;
            }
        }
        let base = CommonParams::new(problem, Addresses { x, mask, y, ..prep.tensors.addresses() })?;

        self.mark("start", stream)?;
        let (left, right, gate) = match &ws.layout {
            Layout::OnePass { left, right, gate, .. } => {
                (left.ptr(), right.ptr(), gate.as_ref().map_or(0, |g| g.ptr()))
            }
            Layout::Chunked { scratch } => {
                let scratch = scratch.ptr();
                return self.enqueue_chunked(prep, ws, scratch, &base, m, stream);
            }
            Layout::Staged(_) => return self.enqueue_staged(prep, ws, &base, stream),
        };
        // 1. LN_C, input projections and gating.
        let fused = match (&prep.fused, self.fused_kernel_for(prep, problem, ws.tuning)) {
            (Some(f), Some(kernel)) if matches!(ws.layout, Layout::OnePass { blas_input: None, .. }) => {
                Some((f, kernel))
            }
            _ => None,
        };
        let gate_from_x = gate == 0;
        // With the gate made from x, the input kernel's common part: the output stage reads w_in's
        // gate rows, their bias and the pads from it.
        let mut from_x_launch = None;
        if let Some((f, kernel)) = fused {
            // One pass: x read once, left/right (and the gate, unless the output stage makes it
            // from x: then only the gating column chunks run) written once.
            let common = base.with_fused(&f.layout, f.w.ptr(), f.bias.as_ref().map_or(0, |b| b.ptr()))?;
            let kp = InputParams {
                common,
                left,
                right,
                gate,
                // The gating column chunks alone (32 channels of left and right each), no gate.
                chunk_end: if gate_from_x { to_i32(f.layout.h_pad / 32, "gating column chunks")? } else { 0 },
                ..InputParams::default()
            };
            kernel.launch(m, stream, &kp)?;
            from_x_launch = gate_from_x.then_some(common);
        } else if gate_from_x {
            return Err(Error::InvalidArgument(
                "this workspace was planned for the fused input kernel, which is off now".into(),
            ));
        } else {
            let input = InputParams {
                common: base,
                left,
                right,
                gate,
                proj_bias: prep.tensors.proj_bias_address(),
                proj_h: to_i32(h, "H")?,
                proj_g: to_i32(g, "G")?,
                ..InputParams::default()
            };
            self.enqueue_blas_input(prep, ws, &input, m, stream)?;
        }

        self.mark("input (LN, projections, gating)", stream)?;
        // 2. contraction over the B·H matrices; y (or, in place, x) is dead until step 3, so it
        // lends the workspace.
        let cws = Plan::require(ws.plan.contraction_ws, "contraction workspace")?;
        if cws.buffer != Buffer::Y {
            return Err(Error::Internal("the one-pass plan's contraction workspace is not y".into()));
        }
        ws.contraction.run(&inner.blas, right, left, ws.t.ptr(), 0, cws.at(y), cws.bytes, stream)?;
        self.mark("contraction", stream)?;

        if let Some(common) = from_x_launch {
            return self
                .launch_output_from_x(&OutputParams { common, t: ws.t.ptr(), ..OutputParams::default() }, stream);
        }
        // 3. LN_H (+ gate) and the output projection (+ bias, af3 gate): one fused kernel, or
        // LN_H into `a` (= left), the cuBLASLt GEMM (+ bias) into y (right lends the workspace)
        // and af3's gate kernel.
        let fused_output = self.fused_output_for(problem, ws.tuning);
        let kp = OutputParams { common: base, t: ws.t.ptr(), a: left, gate, buf_row0: 0, ..OutputParams::default() };
        let ows = Plan::require(ws.plan.output_ws, "output workspace")?;
        if ows.buffer != Buffer::Right {
            return Err(Error::Internal("the one-pass plan's output workspace is not right".into()));
        }
        self.enqueue_output(prep, fused_output, &mut ws.output, &kp, ows.at(right), ows.bytes, stream, true)
    }

    /// The output stage of `p`'s positions (`p.gate` and `p.a` hold them from `p.buf_row0`, t is
    /// whole): the fused kernel `fused` when there is one, else LN_H into
    /// `p.a`, the cuBLASLt GEMM `gemm` (+ bias, workspace `gemm_ws`) into y's rows and af3's gate
    /// kernel. `marks`: record the one-pass plan's stage names on the timeline.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue`]; the buffers in `p` hold those rows, `gemm` is the output GEMM
    /// of that many rows and `gemm_ws` holds `gemm_ws_len` bytes.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn enqueue_output(
        &self,
        prep: &CudaPrepared,
        fused: Option<&kernels::Stage>,
        gemm: &mut MatmulPlan,
        p: &OutputParams,
        gemm_ws: CUdeviceptr,
        gemm_ws_len: usize,
        stream: CUstream,
        marks: bool,
    ) -> Result<()> {
        let mark = |name| if marks { self.mark(name, stream) } else { Ok(()) };
        if let Some(op) = fused {
            self.launch_output(op, p, stream)?;
            return mark("output stage (LayerNorm, gate, projection)");
        }
        let k = &self.inner.kernels;
        let (rows, c, h) = (p.common.rows(), p.common.c(), p.common.h());
        let tp = params::output_norm_tile_rows(h);
        let np = OutputParams { tile_rows: to_i32(tp, "positions per block")?, ..*p };
        let smem = params::output_norm_smem_bytes(h, tp) as u32;
        k.output_norm.launch(ceil_div(rows, tp), STAGE_THREADS, smem, stream, &np)?;
        mark("output LayerNorm")?;
        if gemm.spec().n != rows {
            return Err(Error::InvalidArgument(format!("no output plan for a chunk of {rows} rows")));
        }
        let bias = prep.tensors.addresses().out_bias;
        let y = p.common.y() + (p.common.row0() as u64) * (c as u64) * 4;
        gemm.run(&self.inner.blas, prep.tensors.w_out.ptr(), p.a, y, bias, gemm_ws, gemm_ws_len, stream)?;
        mark("output GEMM")?;
        if p.common.formulation() == Formulation::Af3 {
            let grid = ceil_div(rows * c, STAGE_THREADS as usize * 8).clamp(1, 65_535);
            let gp = OutputParams { gate_blocks: to_i32(grid as usize, "output_gate blocks")?, ..*p };
            k.output_gate.launch(grid, STAGE_THREADS, 0, stream, &gp)?;
            mark("output gate")?;
        }
        Ok(())
    }

    /// The fused input kernel for this layer and problem, or `None` for the chunked cuBLASLt
    /// path. Padded C ≤ 128: the build with two blocks per SM (its LayerNorm holds at most 128
    /// channels in registers). Wider C: the one-block-per-SM build. Its wgmma form (H100) beats
    /// the chunked path at every size measured (C = 384: 2.420 → 2.356 ms at 590K positions,
    /// 4.272 → 4.148 ms at 1M). Its mma.sync form is faster than the chunked path only below
    /// about half a million positions (H100, C = 384: 0.55 vs 0.78 ms at 131K positions, 2.30 vs
    /// 2.24 ms at 590K, 3.92 vs 3.60 ms at 1M).
    pub(super) fn fused_kernel_for(
        &self,
        prep: &CudaPrepared,
        problem: &Problem,
        tuning: Tuning,
    ) -> Option<FusedKernel<'_>> {
        const WIDE_MMA_SYNC_MAX_POSITIONS: usize = 512 * 1024;
        let f = prep.fused.as_ref()?;
        let kernel = self.chunk_kernel(prep, tuning)?;
        let narrow = f.layout.k_pad <= 128 && self.two_blocks_fit(f);
        // 16-bit x is read by the fused kernels only.
        let half_io = problem.io != Precision::F32Io;
        (narrow || kernel.wgmma || half_io || problem.shape.rows() < WIDE_MMA_SYNC_MAX_POSITIONS).then_some(kernel)
    }

    /// Whether two blocks of the fused input kernel fit on one SM.
    pub(super) fn two_blocks_fit(&self, f: &FusedInput) -> bool {
        self.blocks_fit(2, f.smem_bytes())
    }

    /// Whether `blocks` blocks with `smem` bytes of dynamic shared memory each fit on one SM (the
    /// driver reserves 1 KB per block).
    pub(super) fn blocks_fit(&self, blocks: usize, smem: usize) -> bool {
        blocks * (smem + 1024) <= self.inner.smem_per_sm
    }

    /// Stage 1 without the fused kernel (shapes it does not take, GPUs before sm_80): per chunk
    /// of positions, `input_norm`, the projection GEMM through cuBLASLt and `input_gating`, with
    /// the scratch inside the t buffer.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue`]; `base` holds that call's pointers, left, right, the gate and
    /// the projection's bias.
    pub(super) unsafe fn enqueue_blas_input(
        &self,
        prep: &CudaPrepared,
        ws: &mut CudaWorkspace,
        base: &InputParams,
        m: usize,
        stream: CUstream,
    ) -> Result<()> {
        let inner = &self.inner;
        let k = &inner.kernels;
        let h = base.common.h();
        let t = ws.t.ptr();
        let (z, proj) = (Plan::require(ws.plan.z, "z")?, Plan::require(ws.plan.proj, "proj")?);
        let gemm_ws = Plan::require(ws.plan.projection_ws, "projection workspace")?;
        // The staged one-pass plan keeps [z | proj | gemm ws] inside t.
        let base_of = |b: Buffer| if b == Buffer::T { t } else { 0 };
        if [z, proj, gemm_ws].iter().any(|r| r.buffer != Buffer::T) {
            return Err(Error::Internal("the staged one-pass plan's projection is not inside t".into()));
        }
        let input_rows = ws.plan.input_rows;
        let Layout::OnePass { blas_input: Some(chunked), .. } = &mut ws.layout else {
            return Err(Error::InvalidArgument("workspace has no chunked-projection plan".into()));
        };
        let (z, proj) = (Plan::address(z, base_of), Plan::address(proj, base_of));
        let (gemm_ws_len, gemm_ws) = (gemm_ws.bytes, Plan::address(gemm_ws, base_of));
        let tr = params::gating_tile_rows(h);
        let mut row0 = 0;
        while row0 < m {
            let rows = input_rows.min(m - row0);
            let kp = InputParams {
                common: base.common.over(row0, rows)?,
                z,
                proj,
                tile_rows: to_i32(tr, "positions per block")?,
                ..*base
            };
            k.input_norm.launch(ceil_div(rows, INPUT_NORM_ROWS_PER_BLOCK as usize), STAGE_THREADS, 0, stream, &kp)?;
            let plan = full_or_tail(&mut chunked.proj_full, &mut chunked.proj_tail, rows == input_rows);
            if plan.spec().n != rows {
                return Err(Error::InvalidArgument(format!("no projection plan for a chunk of {rows} rows")));
            }
            plan.run(&inner.blas, prep.tensors.w_in.ptr(), z, proj, 0, gemm_ws, gemm_ws_len, stream)?;
            let smem = params::gating_smem_bytes(h, tr) as u32;
            k.input_gating.launch(ceil_div(rows, tr), STAGE_THREADS, smem, stream, &kp)?;
            row0 += rows;
        }
        Ok(())
    }

    /// The fused input kernel a chunked plan runs with, whatever the number of positions
    /// (hidden passes and the gate pass need its column-chunk selection); `None` when this layer
    /// has no fused weights or the GPU no such kernel.
    pub(super) fn chunk_kernel(&self, prep: &CudaPrepared, tuning: Tuning) -> Option<FusedKernel<'_>> {
        let k = &self.inner.kernels;
        let f = prep.fused.as_ref()?;
        let narrow = f.layout.k_pad <= 128 && self.two_blocks_fit(f);
        if self.inner.warpgroup_mma.load(Ordering::Relaxed) && tuning.warpgroup_mma.unwrap_or(true) {
            // Wider C: 64-position blocks, two per SM, where they fit (H100, C = 384: 1024,1,384
            // 3.967 → 3.736 ms, 768,1,384 2.241 → 2.100 ms against 128-position blocks, one per SM).
            let smem64 = f.smem_bytes_sm90_rows(64);
            let (sm90, smem, rows) = if narrow {
                (&k.input_projection_sm90, f.smem_bytes_sm90_rows(FUSED_INPUT_ROWS), FUSED_INPUT_ROWS)
            } else if self.blocks_fit(2, smem64) && k.input_projection_sm90_mid.is_some() {
                (&k.input_projection_sm90_mid, smem64, 64)
            } else {
                (&k.input_projection_sm90_wide, f.smem_bytes_sm90_rows(FUSED_INPUT_ROWS), FUSED_INPUT_ROWS)
            };
            if let Some(stage) = sm90 {
                // Padded C ≤ 128 with f32 x: 64-position blocks, three per SM, where they fit.
                let f32_x = match &k.input_projection_sm90_narrow64 {
                    Some(s) if narrow && self.blocks_fit(3, smem64) => {
                        Some(InputBuild { stage: s, smem: smem64 as u32, rows: 64 })
                    }
                    _ => None,
                };
                let build = InputBuild { stage, smem: smem as u32, rows };
                let ws = k.input_projection_sm90_ws.as_ref().filter(|_| {
                    self.inner.warp_specialised.load(Ordering::Relaxed)
                        && f.layout.k_pad == 128
                        && f.layout.h_pad == 128
                        && f.layout.g_pad == 128
                        && self.blocks_fit(1, WS_SMEM_BYTES as usize)
                });
                let rs = k
                    .input_projection_sm90_rs
                    .as_ref()
                    .filter(|_| self.inner.register_operand_input.load(Ordering::Relaxed))
                    .map(|stage| (stage, &self.inner.rs_launches));
                let ws = ws.map(|stage| WsBuild {
                    stage,
                    rs,
                    sms: self.inner.info.compute_units,
                    launches: &self.inner.ws_launches,
                });
                return Some(FusedKernel { build, wgmma: true, f32_x, ws, pdl: k.pdl });
            }
        }
        let stage = if narrow { k.input_projection.as_ref() } else { k.input_projection_wide.as_ref() }?;
        let build = InputBuild { stage, smem: f.smem_bytes() as u32, rows: FUSED_INPUT_ROWS };
        Some(FusedKernel { build, wgmma: false, f32_x: None, ws: None, pdl: k.pdl })
    }
}
