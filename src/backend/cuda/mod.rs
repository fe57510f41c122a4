//! CUDA backend: cuBLASLt for the three GEMMs, our portable stage kernels for everything else.
//!
//! One forward, `M = B·N²` positions, `P = 4H + G` fused projection outputs:
//! 1. for each chunk of positions (bounded scratch, see below):
//!    `input_norm`: z = LN_C(x) → f16 · projection GEMM: proj = z·Wᵀ (f16 in, f32 accumulate,
//!    f16 out; W fused once at prepare time) · `input_gating`: σ, mask, products → left/right in
//!    the contraction layout `[B, H, N, N]` f16 and the output gate σ(og) `[M, G]` f16;
//! 2. contraction: one strided-batched GEMM over the `B·H` matrices, t in `[B, H, N, N]` f16;
//! 3. `output_norm`: a = LN_H(t) (⊙ gate for gpumode) `[M, H]` f16, written over `left` (dead by
//!    then) · output GEMM: y = a·Woutᵀ (+ bias epilogue) f32 · af3 only `output_gate`: y ⊙= σ(g).
//!
//! Device memory: left, right, gate and t, each `M × (H or G)` halves — within
//! `4·M·max(C, H)·2` bytes — plus the caller's x and y. The chunk scratch (z, proj and the
//! projection GEMM's workspace) lives inside the t buffer, which is unused until the contraction;
//! the other GEMMs borrow their workspace from buffers that are dead at that point (y before the
//! output GEMM, right after the contraction). Nothing is allocated inside a forward and nothing
//! waits on the host, except the copies of [`Backend::forward_host`].

mod blas;
mod driver;
mod kernels;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUstream};
use cudarc::driver::{CudaContext, CudaStream};

use self::blas::{BlasHandle, Elem, MatmulPlan};
pub use self::driver::DeviceBuffer;
use self::driver::{probe_libraries, AllocTracker, DriverResult, EventPair, Timeline};
use self::kernels::Kernels;
use super::gemm::GemmSpec;
use super::params::{self, FusedInputLayout, KernelParams, FUSED_INPUT_ROWS, INPUT_NORM_ROWS_PER_BLOCK, STAGE_THREADS};
use super::{Backend, Ceilings, DeviceInfo, MemoryInfo};
use crate::error::{BackendKind, Error, Result};
use crate::layer::Layer;
use crate::problem::{Formulation, Problem, Shape, LN_EPS};
use crate::weights::Weights;

/// Largest cuBLASLt workspace a GEMM may borrow.
const MAX_GEMM_WORKSPACE: usize = 32 << 20;
/// Byte bit pattern that makes every f16/f32 element a NaN: poisons buffers in checks.
const POISON_BYTE: u8 = 0xFF;

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: BlasHandle,
    kernels: Kernels,
    info: DeviceInfo,
    tracker: Arc<AllocTracker>,
    poison: AtomicBool,
    fused_input: AtomicBool,
    /// Shared memory per SM (bytes), to decide how many blocks of a kernel fit.
    smem_per_sm: usize,
    /// When set, the next forward records an event after each stage (see `stage_times`).
    timeline: std::sync::Mutex<Option<Timeline>>,
}

/// An NVIDIA GPU with its stream, cuBLASLt handle and loaded kernels. Cheap to clone.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

fn round_up(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

fn ceil_div(a: usize, b: usize) -> u32 {
    u32::try_from(a.div_ceil(b)).unwrap_or(u32::MAX)
}

impl CudaBackend {
    /// Opens device `ordinal`: probes libcuda and libcublasLt, creates a context, a stream and
    /// a cuBLASLt handle, and loads the kernels. Missing libraries are errors, not panics.
    pub fn new(ordinal: usize) -> Result<Self> {
        // cudarc panics on a missing symbol inside an otherwise present library; turn any such
        // panic into an error naming what failed.
        match catch_unwind(AssertUnwindSafe(|| Self::open(ordinal))) {
            Ok(r) => r,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                Err(Error::LibraryNotFound {
                    library: "CUDA driver / cuBLASLt".into(),
                    tried: "cudarc dynamic loader".into(),
                    reason: msg,
                })
            }
        }
    }

    fn open(ordinal: usize) -> Result<Self> {
        probe_libraries()?;
        cu::init().ctx("cuInit")?;
        let count = CudaContext::device_count().ctx("cuDeviceGetCount")?;
        if count <= 0 || ordinal >= count as usize {
            return Err(Error::NoDevice {
                backend: BackendKind::Cuda,
                reason: format!("device {ordinal} requested, the driver reports {count}"),
            });
        }
        let ctx = CudaContext::new(ordinal).ctx("cuDevicePrimaryCtxRetain")?;
        let cc = ctx.compute_capability().ctx("cuDeviceGetAttribute(COMPUTE_CAPABILITY)")?;
        if cc.0 < 7 {
            return Err(Error::NoDevice {
                backend: BackendKind::Cuda,
                reason: format!("compute capability {}.{} is below 7.0 (f16 tensor cores needed)", cc.0, cc.1),
            });
        }
        let stream = ctx.new_stream().ctx("cuStreamCreate")?;
        let kernels = Kernels::load(&ctx, cc)?;
        ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let blas = BlasHandle::new()?;
        let attr = |a| ctx.attribute(a).unwrap_or(0);
        let mut driver_version = 0i32;
        // SAFETY: writes one int; libcuda was probed and initialised above.
        let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
        let mut versions = vec![
            ("CUDA driver API".to_string(), format!("{}.{}", driver_version / 1000, (driver_version % 1000) / 10)),
            ("cuBLASLt".to_string(), BlasHandle::version().to_string()),
            ("kernels".to_string(), format!("{} [{}]", crate::kernels::CUDA_BUILD, kernels.origin)),
        ];
        if driver::nvrtc_present() {
            let (mut ma, mut mi) = (0, 0);
            // SAFETY: writes two ints; NVRTC was found loadable just above.
            let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut ma, &mut mi) };
            versions.push(("NVRTC".to_string(), format!("{ma}.{mi}")));
        }
        let smem_per_sm = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR) as usize;
        let info = DeviceInfo {
            vendor: "NVIDIA".into(),
            name: ctx.name().unwrap_or_else(|_| "unknown NVIDIA GPU".into()),
            arch: format!("sm_{}{}", cc.0, cc.1),
            compute_units: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) as u32,
            memory_bytes: ctx.total_mem().unwrap_or(0) as u64,
            versions,
        };
        Ok(CudaBackend {
            inner: Arc::new(Inner {
                ctx,
                stream,
                blas,
                kernels,
                info,
                tracker: Arc::new(AllocTracker::default()),
                poison: AtomicBool::new(false),
                fused_input: AtomicBool::new(true),
                smem_per_sm,
                timeline: std::sync::Mutex::new(None),
            }),
        })
    }

    /// The backend's own stream (every forward of [`Backend::forward`] runs on it).
    pub fn stream(&self) -> CUstream {
        self.inner.stream.cu_stream()
    }

    /// A device buffer of `len` elements, tracked in [`Backend::peak_memory`].
    pub fn alloc_buffer<T>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::alloc(&self.inner.ctx, &self.inner.tracker, len)
    }

    /// Before each forward, fill the output and every intermediate with NaN so that any
    /// element a kernel fails to write shows up in a check. Off by default (it costs a pass
    /// over the buffers); `trimul check` and the GPU tests turn it on.
    pub fn set_poison(&self, on: bool) {
        self.inner.poison.store(on, Ordering::Relaxed);
    }

    /// Arms a per-stage timeline for the next forward; read it with [`CudaBackend::stage_times`].
    pub fn record_stages(&self) {
        if let Ok(mut t) = self.inner.timeline.lock() {
            *t = Some(Timeline::default());
        }
    }

    /// Milliseconds of each stage of the last forward run after [`CudaBackend::record_stages`].
    pub fn stage_times(&self) -> Result<Vec<(String, f64)>> {
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let taken = self.inner.timeline.lock().ok().and_then(|mut t| t.take());
        taken.map_or(Ok(Vec::new()), |t| t.stage_ms())
    }

    fn mark(&self, name: &'static str, stream: CUstream) -> Result<()> {
        if let Ok(mut guard) = self.inner.timeline.lock() {
            if let Some(t) = guard.as_mut() {
                t.mark(name, stream)?;
            }
        }
        Ok(())
    }

    /// Whether layers prepared from now on use the fused input kernel where it takes the shape
    /// (default on). Off forces the chunked cuBLASLt path, to test and compare it.
    pub fn set_fused_input(&self, on: bool) {
        self.inner.fused_input.store(on, Ordering::Relaxed);
    }

    fn upload_f32(&self, v: &[f32]) -> Result<DeviceBuffer<f32>> {
        let mut b = self.alloc_buffer::<f32>(v.len())?;
        b.upload(v, self.stream())?;
        Ok(b)
    }

    fn upload_f16(&self, what: &str, v: &[f32]) -> Result<DeviceBuffer<u16>> {
        if let Some(bad) = v.iter().find(|w| !w.is_finite() || w.abs() > 65504.0) {
            return Err(Error::Weights(format!("{what} holds {bad}, outside the f16 range the GPU path uses")));
        }
        let h: Vec<u16> = v.iter().map(|&w| half::f16::from_f32(w).to_bits()).collect();
        let mut b = self.alloc_buffer::<u16>(h.len())?;
        b.upload(&h, self.stream())?;
        Ok(b)
    }

    /// Enqueues one forward on device addresses. See the module docs for the stages.
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
        if !self.workspace_fits(ws, problem) {
            return Err(Error::InvalidArgument("workspace was made for another problem shape".into()));
        }
        if x == y {
            return Err(Error::InvalidArgument("y must not alias x (in-place mode is not supported)".into()));
        }
        for (name, ptr) in [("x", x), ("mask", mask), ("y", y)] {
            if ptr % 16 != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{name} must be 16-byte aligned on the device (got {ptr:#x})"
                )));
            }
        }
        let inner = &self.inner;
        inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let cfg = problem.config;
        let (c, h, g, p) = (cfg.c, cfg.h, cfg.gate_width(), cfg.fused_proj_width());
        let m = problem.shape.rows();
        let k = &inner.kernels;
        if inner.poison.load(Ordering::Relaxed) {
            for b in [&mut ws.left, &mut ws.right, &mut ws.gate, &mut ws.t] {
                b.memset_async(POISON_BYTE, stream)?;
            }
            cu::memset_d8_async(y, POISON_BYTE, m * c * 4, stream).ctx("cuMemsetD8Async(y)")?;
        }
        let base = KernelParams {
            x,
            mask,
            norm_in_w: prep.norm_in_w.ptr(),
            norm_in_b: prep.norm_in_b.ptr(),
            proj_bias: prep.proj_bias.as_ref().map_or(0, |b| b.ptr()),
            norm_out_w: prep.norm_out_w.ptr(),
            norm_out_b: prep.norm_out_b.ptr(),
            left: ws.left.ptr(),
            right: ws.right.ptr(),
            gate: ws.gate.ptr(),
            t: ws.t.ptr(),
            a: ws.left.ptr(),
            y,
            batch: problem.shape.batch as i32,
            n: problem.shape.n as i32,
            c: c as i32,
            h: h as i32,
            g: g as i32,
            p: p as i32,
            af3: i32::from(cfg.formulation == Formulation::Af3),
            eps: LN_EPS,
            ..KernelParams::default()
        };

        self.mark("start", stream)?;
        // 1. LN_C, input projections and gating.
        let fused = match (&prep.fused, self.fused_kernel_for(prep, problem)) {
            (Some(f), Some(kernel)) if ws.chunked.is_none() => Some((f, kernel)),
            _ => None,
        };
        if let Some((f, kernel)) = fused {
            // One pass: x read once, left/right/gate written once.
            let kp = KernelParams {
                row0: 0,
                rows: m as i64,
                w_in: f.w.ptr(),
                w_in_bias: f.bias.as_ref().map_or(0, |b| b.ptr()),
                k_pad: f.layout.k_pad as i32,
                h_pad: f.layout.h_pad as i32,
                g_pad: f.layout.g_pad as i32,
                ..base
            };
            kernel.launch(ceil_div(m, FUSED_INPUT_ROWS), STAGE_THREADS, f.smem_bytes() as u32, stream, &kp)?;
        } else {
            self.enqueue_chunked_input(prep, ws, &base, m, stream)?;
        }

        self.mark("input (LN, projections, gating)", stream)?;
        // 2. contraction over the B·H matrices; y is dead until step 3, so it lends the workspace.
        ws.contraction.run(&inner.blas, ws.right.ptr(), ws.left.ptr(), ws.t.ptr(), 0, y, m * c * 4, stream)?;
        self.mark("contraction", stream)?;

        // 3. LN_H (+ gate) into `a` (= left), output GEMM (+ bias) into y; right lends the workspace.
        let tp = params::output_norm_tile_rows(h);
        let kp = KernelParams { row0: 0, rows: m as i64, tile_rows: tp as i32, ..base };
        let smem = params::output_norm_smem_bytes(h, tp) as u32;
        k.output_norm.launch(ceil_div(m, tp), STAGE_THREADS, smem, stream, &kp)?;
        self.mark("output LayerNorm", stream)?;
        let bias = prep.out_bias.as_ref().map_or(0, |b| b.ptr());
        ws.output.run(
            &inner.blas,
            prep.w_out.ptr(),
            ws.left.ptr(),
            y,
            bias,
            ws.right.ptr(),
            ws.right.bytes() as usize,
            stream,
        )?;
        self.mark("output GEMM", stream)?;
        if cfg.formulation == Formulation::Af3 {
            let grid = ceil_div(m * c, STAGE_THREADS as usize * 8).clamp(1, 65_535);
            let kp = KernelParams { row0: 0, rows: m as i64, tile_rows: grid as i32, ..base };
            k.output_gate.launch(grid, STAGE_THREADS, 0, stream, &kp)?;
            self.mark("output gate", stream)?;
        }
        Ok(())
    }

    /// The fused input kernel for this layer and problem, or `None` for the chunked cuBLASLt
    /// path. Padded C ≤ 128: the build with two blocks per SM (its LayerNorm holds at most 128
    /// channels in registers). Wider C: the one-block-per-SM build, which measured faster than the
    /// chunked path below about half a million positions and slower above (H100, C = 384:
    /// 0.55 vs 0.78 ms at 131K positions, 2.30 vs 2.24 ms at 590K, 3.92 vs 3.60 ms at 1M).
    fn fused_kernel_for(&self, prep: &CudaPrepared, problem: &Problem) -> Option<&kernels::Stage> {
        const WIDE_MAX_POSITIONS: usize = 512 * 1024;
        let k = &self.inner.kernels;
        let f = prep.fused.as_ref()?;
        let two_fit = 2 * (f.smem_bytes() + 1024) <= self.inner.smem_per_sm;
        if f.layout.k_pad <= 128 && two_fit {
            k.input_projection.as_ref()
        } else if problem.shape.rows() < WIDE_MAX_POSITIONS {
            k.input_projection_wide.as_ref()
        } else {
            None
        }
    }

    /// Stage 1 without the fused kernel (shapes it does not take, GPUs before sm_80): per chunk
    /// of positions, `input_norm`, the projection GEMM through cuBLASLt and `input_gating`, with
    /// the scratch inside the t buffer.
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue`]; `base` holds that call's pointers.
    unsafe fn enqueue_chunked_input(
        &self,
        prep: &CudaPrepared,
        ws: &mut CudaWorkspace,
        base: &KernelParams,
        m: usize,
        stream: CUstream,
    ) -> Result<()> {
        let inner = &self.inner;
        let k = &inner.kernels;
        let h = base.h as usize;
        let t_bytes = ws.t.bytes() as usize;
        let z = ws.t.ptr();
        let Some(chunked) = ws.chunked.as_mut() else {
            return Err(Error::InvalidArgument("workspace has no chunked-projection plan".into()));
        };
        let scratch = chunked.scratch;
        // Scratch layout inside t: [z | proj | gemm ws].
        let proj = z + scratch.proj_offset as u64;
        let gemm_ws = z + scratch.ws_offset as u64;
        let gemm_ws_len = t_bytes - scratch.ws_offset;
        let tr = params::gating_tile_rows(h);
        let mut row0 = 0;
        while row0 < m {
            let rows = scratch.chunk_rows.min(m - row0);
            let kp = KernelParams { row0: row0 as i64, rows: rows as i64, z, proj, tile_rows: tr as i32, ..*base };
            k.input_norm.launch(ceil_div(rows, INPUT_NORM_ROWS_PER_BLOCK as usize), STAGE_THREADS, 0, stream, &kp)?;
            let plan = if rows == scratch.chunk_rows {
                &mut chunked.proj_full
            } else {
                chunked.proj_tail.as_mut().unwrap_or(&mut chunked.proj_full)
            };
            if plan.spec().n != rows {
                return Err(Error::InvalidArgument(format!("no projection plan for a chunk of {rows} rows")));
            }
            plan.run(&inner.blas, prep.w_in.ptr(), z, proj, 0, gemm_ws, gemm_ws_len, stream)?;
            let smem = params::gating_smem_bytes(h, tr) as u32;
            k.input_gating.launch(ceil_div(rows, tr), STAGE_THREADS, smem, stream, &kp)?;
            row0 += rows;
        }
        Ok(())
    }
}

/// Weights fused, cast to f16 and uploaded once.
pub struct CudaPrepared {
    /// Weights in the fused input kernel's order, when that kernel takes this shape.
    fused: Option<FusedInput>,
    /// `[P, C]` f16, rows `[left_proj; left_gate; right_proj; right_gate; out_gate]`.
    w_in: DeviceBuffer<u16>,
    /// `[C, H]` f16.
    w_out: DeviceBuffer<u16>,
    /// `[P]` f32 in the order of `w_in`, when any input linear has a bias (af3).
    proj_bias: Option<DeviceBuffer<f32>>,
    /// `[C]` f32, af3's output-projection bias.
    out_bias: Option<DeviceBuffer<f32>>,
    norm_in_w: DeviceBuffer<f32>,
    norm_in_b: DeviceBuffer<f32>,
    norm_out_w: DeviceBuffer<f32>,
    norm_out_b: DeviceBuffer<f32>,
}

struct FusedInput {
    layout: FusedInputLayout,
    w: DeviceBuffer<u16>,
    bias: Option<DeviceBuffer<f32>>,
}

impl FusedInput {
    /// Dynamic shared memory of one block (see the layout comment in `cuda/input_projection.cu`).
    fn smem_bytes(&self) -> usize {
        let rows = FUSED_INPUT_ROWS;
        let a = rows * (self.layout.k_pad + 8) * 2;
        let ring = 2 * 128 * (64 + 8) * 2;
        let staging = (2 * 32 * (rows + 8) * 2).max(rows * (128 + 8) * 2);
        a + ring + staging + rows * 4
    }
}

/// Where the per-chunk scratch sits inside the t buffer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Scratch {
    chunk_rows: usize,
    proj_offset: usize,
    ws_offset: usize,
    t_bytes: usize,
}

impl Scratch {
    /// Chunks as large as t's natural size allows, leaving an eighth of it (≤ 8 MiB) for the
    /// projection GEMM's workspace; tiny problems grow t to fit one row.
    fn plan(problem: &Problem) -> Scratch {
        let cfg = problem.config;
        let m = problem.shape.rows();
        let natural = m * cfg.h * 2;
        let ws = ((natural / 8).min(8 << 20) / 256) * 256;
        let row_bytes = (cfg.c + cfg.fused_proj_width()) * 2;
        let mut chunk_rows = ((natural - ws) / row_bytes).clamp(1, m);
        if chunk_rows >= 64 && chunk_rows < m {
            // Chunks start 64-aligned so the gating kernel's tiles keep their 16-byte stores.
            chunk_rows -= chunk_rows % 64;
        }
        let proj_offset = round_up(chunk_rows * cfg.c * 2, 256);
        let ws_offset = proj_offset + round_up(chunk_rows * cfg.fused_proj_width() * 2, 256);
        Scratch { chunk_rows, proj_offset, ws_offset, t_bytes: natural.max(ws_offset + ws) }
    }
}

/// Intermediates and GEMM plans for one problem shape.
pub struct CudaWorkspace {
    problem: Problem,
    left: DeviceBuffer<u16>,
    right: DeviceBuffer<u16>,
    gate: DeviceBuffer<u16>,
    t: DeviceBuffer<u16>,
    /// The chunked stage-1 path's scratch plan and projection GEMMs (None with the fused kernel).
    chunked: Option<ChunkedInput>,
    contraction: MatmulPlan,
    output: MatmulPlan,
    /// Device copies of x, mask and y for [`Backend::forward_host`], made on first use.
    staging: Option<Staging>,
}

struct ChunkedInput {
    scratch: Scratch,
    proj_full: MatmulPlan,
    proj_tail: Option<MatmulPlan>,
}

struct Staging {
    x: DeviceBuffer<f32>,
    mask: Option<DeviceBuffer<f32>>,
    y: DeviceBuffer<f32>,
}

impl Backend for CudaBackend {
    type Buffer = DeviceBuffer<f32>;
    type Prepared = CudaPrepared;
    type Workspace = CudaWorkspace;

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn info(&self) -> DeviceInfo {
        self.inner.info.clone()
    }

    fn prepare(&self, w: &Weights) -> Result<CudaPrepared> {
        let cfg = w.config();
        let inputs = w.input_linears();
        let fused: Vec<f32> = inputs.iter().flat_map(|l| l.weight.iter().copied()).collect();
        let any_bias = inputs.iter().any(|l| l.bias.is_some());
        let proj_bias = if any_bias {
            let b: Vec<f32> =
                inputs.iter().flat_map(|l| l.bias.clone().unwrap_or_else(|| vec![0.0; l.out_features])).collect();
            Some(self.upload_f32(&b)?)
        } else {
            None
        };
        debug_assert_eq!(fused.len(), cfg.fused_proj_width() * cfg.c);
        let fused_input = match (FusedInputLayout::new(&cfg), &self.inner.kernels.input_projection) {
            (Some(layout), Some(_)) if self.inner.fused_input.load(Ordering::Relaxed) => {
                let (mat, bias) = layout.pack(w);
                let f = FusedInput {
                    layout,
                    w: self.upload_f16("the input projections", &mat)?,
                    bias: bias.map(|b| self.upload_f32(&b)).transpose()?,
                };
                (f.smem_bytes() <= self.inner.kernels.max_smem).then_some(f)
            }
            _ => None,
        };
        Ok(CudaPrepared {
            fused: fused_input,
            w_in: self.upload_f16("the input projections", &fused)?,
            w_out: self.upload_f16("the output projection", &w.out_proj.weight)?,
            proj_bias,
            out_bias: w.out_proj.bias.as_ref().map(|b| self.upload_f32(b)).transpose()?,
            norm_in_w: self.upload_f32(&w.norm_in.weight)?,
            norm_in_b: self.upload_f32(&w.norm_in.bias)?,
            norm_out_w: self.upload_f32(&w.norm_out.weight)?,
            norm_out_b: self.upload_f32(&w.norm_out.bias)?,
        })
    }

    fn workspace_bytes(&self, prepared: &CudaPrepared, problem: &Problem) -> u64 {
        let m = problem.shape.rows() as u64;
        let cfg = problem.config;
        let t_bytes =
            if prepared.fused.is_some() { m * cfg.h as u64 * 2 } else { Scratch::plan(problem).t_bytes as u64 };
        2 * (2 * m * cfg.h as u64 + m * cfg.gate_width() as u64) + t_bytes
    }

    fn workspace(&self, prepared: &CudaPrepared, problem: &Problem) -> Result<CudaWorkspace> {
        let needed = self.workspace_bytes(prepared, problem);
        if let Some(mem) = self.memory_info()? {
            if needed > mem.free {
                return Err(Error::OutOfMemory {
                    backend: BackendKind::Cuda,
                    what: format!("the workspace for B={} N={}", problem.shape.batch, problem.shape.n),
                    needed,
                    available: mem.free,
                });
            }
        }
        let cfg = problem.config;
        let m = problem.shape.rows();
        let blas = &self.inner.blas;
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let chunked = if self.fused_kernel_for(prepared, problem).is_some() {
            None
        } else {
            let s = Scratch::plan(problem);
            let ws_proj = s.t_bytes - s.ws_offset;
            let proj = |rows| {
                MatmulPlan::new(
                    blas,
                    GemmSpec::projection(rows, cfg.c, cfg.fused_proj_width()),
                    Elem::F16,
                    false,
                    ws_proj,
                )
            };
            let tail = m % s.chunk_rows;
            Some(ChunkedInput {
                scratch: s,
                proj_full: proj(s.chunk_rows)?,
                proj_tail: if tail > 0 { Some(proj(tail)?) } else { None },
            })
        };
        let t_len = chunked.as_ref().map_or(m * cfg.h, |c| c.scratch.t_bytes / 2);
        let bh = problem.shape.batch * cfg.h;
        Ok(CudaWorkspace {
            problem: *problem,
            left: self.alloc_buffer(m * cfg.h)?,
            right: self.alloc_buffer(m * cfg.h)?,
            gate: self.alloc_buffer(m * cfg.gate_width())?,
            t: self.alloc_buffer(t_len)?,
            chunked,
            contraction: MatmulPlan::new(
                blas,
                GemmSpec::contraction(problem.direction, bh, problem.shape.n),
                Elem::F16,
                false,
                MAX_GEMM_WORKSPACE.min(m * cfg.c * 4),
            )?,
            output: MatmulPlan::new(
                blas,
                GemmSpec::output(m, cfg.c, cfg.h),
                Elem::F32,
                prepared.out_bias.is_some(),
                MAX_GEMM_WORKSPACE.min(m * cfg.h * 2),
            )?,
            staging: None,
        })
    }

    fn workspace_fits(&self, ws: &CudaWorkspace, problem: &Problem) -> bool {
        // The mask only changes a kernel argument, not the buffers or plans.
        ws.problem.config == problem.config
            && ws.problem.shape == problem.shape
            && ws.problem.direction == problem.direction
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        self.alloc_buffer(len)
    }

    fn buffer_len(buffer: &DeviceBuffer<f32>) -> usize {
        buffer.len()
    }

    fn upload(&self, src: &[f32], dst: &mut DeviceBuffer<f32>) -> Result<()> {
        dst.upload(src, self.stream())
    }

    fn download(&self, src: &DeviceBuffer<f32>, dst: &mut [f32]) -> Result<()> {
        src.download(dst, self.stream())
    }

    fn forward(
        &self,
        prepared: &CudaPrepared,
        workspace: &mut CudaWorkspace,
        problem: &Problem,
        x: &DeviceBuffer<f32>,
        mask: Option<&DeviceBuffer<f32>>,
        y: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        problem.check_lengths(x.len(), mask.map(|m| m.len()), y.len())?;
        // SAFETY: the buffers are live allocations of this backend with lengths checked above;
        // `y` is borrowed mutably so it cannot alias x or mask; the workspace is borrowed for the
        // call and its buffers outlive the stream work because dropping them frees through
        // cuMemFree, which waits for pending work.
        unsafe {
            self.enqueue(prepared, workspace, problem, x.ptr(), mask.map_or(0, |m| m.ptr()), y.ptr(), self.stream())
        }
    }

    fn forward_host(
        &self,
        prepared: &CudaPrepared,
        workspace: &mut CudaWorkspace,
        problem: &Problem,
        x: &[f32],
        mask: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<()> {
        problem.check_lengths(x.len(), mask.map(<[f32]>::len), y.len())?;
        let stream = self.stream();
        let mut staging = match workspace.staging.take() {
            Some(s) => s,
            None => Staging { x: self.alloc_buffer(x.len())?, mask: None, y: self.alloc_buffer(y.len())? },
        };
        if let Some(m) = mask {
            if staging.mask.is_none() {
                staging.mask = Some(self.alloc_buffer(m.len())?);
            }
        }
        let result = (|| {
            staging.x.upload_async(x, stream)?;
            if let (Some(m), Some(md)) = (mask, staging.mask.as_mut()) {
                md.upload_async(m, stream)?;
            }
            let mask_ptr = if mask.is_some() { staging.mask.as_ref().map_or(0, |m| m.ptr()) } else { 0 };
            // SAFETY: the staging buffers are live allocations sized for this problem (made for
            // this workspace's shape), distinct from each other; the download below waits for
            // the stream, so the host slices outlive every copy.
            unsafe { self.enqueue(prepared, workspace, problem, staging.x.ptr(), mask_ptr, staging.y.ptr(), stream)? };
            staging.y.download(y, stream)
        })();
        workspace.staging = Some(staging);
        result
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        self.inner.stream.synchronize().ctx("cuStreamSynchronize")
    }

    fn memory_info(&self) -> Result<Option<MemoryInfo>> {
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let (free, total) = cu::mem_get_info().ctx("cuMemGetInfo")?;
        Ok(Some(MemoryInfo { free: free as u64, total: total as u64 }))
    }

    fn measure_ceilings(&self) -> Result<Ceilings> {
        let stream = self.stream();
        // GEMM: f16 operands, f32 accumulation, 8192³, on non-zero data (zeros run faster).
        let n = 8192;
        let mut rng = crate::rand::Rng::new(0xCE11);
        let host: Vec<u16> = (0..n * n).map(|_| half::f16::from_f32(rng.uniform() as f32 - 0.5).to_bits()).collect();
        let mut a = self.alloc_buffer::<u16>(n * n)?;
        let mut b = self.alloc_buffer::<u16>(n * n)?;
        a.upload(&host, stream)?;
        b.upload(&host, stream)?;
        let d = self.alloc_buffer::<u16>(n * n)?;
        let ws = self.alloc_buffer::<u8>(MAX_GEMM_WORKSPACE)?;
        let spec = GemmSpec::projection(n, n, n);
        let mut plan = MatmulPlan::new(&self.inner.blas, spec, Elem::F16, false, MAX_GEMM_WORKSPACE)?;
        let mut gemm = || {
            // SAFETY: a, b, d are n×n f16 allocations and ws holds MAX_GEMM_WORKSPACE bytes, all
            // alive until the synchronising timer returns.
            unsafe { plan.run(&self.inner.blas, a.ptr(), b.ptr(), d.ptr(), 0, ws.ptr(), MAX_GEMM_WORKSPACE, stream) }
        };
        let reps = 10;
        gemm()?;
        let gemm_ms = self.elapsed_ms(&mut || (0..reps).try_for_each(|_| gemm()))? / reps as f64;
        drop((a, b, d, ws));
        // Copy: 512 MiB device to device, bytes read + written.
        let len = 512 << 20;
        let mut src = self.alloc_buffer::<u8>(len)?;
        src.memset_async(0x3C, stream)?;
        let dst = self.alloc_buffer::<u8>(len)?;
        let copy = || {
            // SAFETY: both are `len`-byte allocations of this context, alive until timed work ends.
            unsafe { cu::memcpy_dtod_async(dst.ptr(), src.ptr(), len, stream) }.ctx("cuMemcpyDtoDAsync")
        };
        copy()?;
        let copy_ms = self.elapsed_ms(&mut || (0..reps).try_for_each(|_| copy()))? / reps as f64;
        Ok(Ceilings {
            gemm_tflops: 2.0 * (n as f64).powi(3) / (gemm_ms * 1e-3) / 1e12,
            gemm_desc: format!("cuBLASLt f16·f16 (f32 accumulate) {n}³"),
            copy_gbs: 2.0 * len as f64 / (copy_ms * 1e-3) / 1e9,
        })
    }

    fn elapsed_ms(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let ev = EventPair::new()?;
        ev.record_start(self.stream())?;
        work()?;
        ev.record_stop(self.stream())?;
        ev.elapsed_ms()
    }

    fn peak_memory(&self) -> Option<u64> {
        Some(self.inner.tracker.peak())
    }

    fn reset_peak_memory(&self) {
        self.inner.tracker.reset_peak();
    }
}

impl Layer<CudaBackend> {
    /// One forward on caller-owned device memory and a caller-given stream, for integration
    /// into other GPU programs. Returns once the work is enqueued on `stream`.
    ///
    /// # Safety
    /// `x` and `y` must be device allocations (of this layer's device and context) of `B·N·N·C`
    /// f32, `mask` of `B·N·N` f32, not aliasing each other, alive until `stream` has run the
    /// work; `stream` must belong to the same context.
    pub unsafe fn forward_on_stream(
        &mut self,
        x: CUdeviceptr,
        mask: Option<CUdeviceptr>,
        y: CUdeviceptr,
        shape: Shape,
        stream: CUstream,
    ) -> Result<()> {
        let problem = self.problem(shape, mask.is_some())?;
        let (backend, prepared, ws) = self.parts(&problem)?;
        backend.enqueue(prepared, ws, &problem, x, mask.unwrap_or(0), y, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Config, Direction};

    #[test]
    fn scratch_fits_in_t_and_chunks_cover_all_rows() {
        for (b, n, c, h, f) in [
            (1, 1, 768, 128, Formulation::GpuMode),
            (1, 33, 128, 128, Formulation::Af3),
            (2, 256, 128, 128, Formulation::GpuMode),
            (1, 1024, 384, 128, Formulation::GpuMode),
            (1, 1024, 768, 128, Formulation::Af3),
        ] {
            let p = Problem::new(Config::new(f, c, h).unwrap(), Shape::new(b, n), Direction::Outgoing, false).unwrap();
            let s = Scratch::plan(&p);
            let m = p.shape.rows();
            assert!(s.chunk_rows >= 1 && s.chunk_rows <= m);
            assert!(s.proj_offset >= s.chunk_rows * c * 2);
            assert!(s.ws_offset >= s.proj_offset + s.chunk_rows * p.config.fused_proj_width() * 2);
            assert!(s.t_bytes >= s.ws_offset && s.t_bytes >= m * h * 2);
            if m >= 4096 {
                // no growth beyond the contraction output: the memory bound holds
                assert_eq!(s.t_bytes, m * h * 2, "{b} {n} {c}");
            }
        }
    }
}
