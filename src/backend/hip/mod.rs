//! HIP backend for AMD GPUs: MI300 (gfx942) and MI200 (gfx90a) from prebuilt code objects, other
//! archs through hipRTC. Built with `--features rocm`; needs no ROCm at build time.
//!
//! One forward, in the notation of SPEC.md (M = B·N² positions, P = 4H + G):
//! 1. per chunk of positions (see [`plan`]):
//!    `input_norm`: z = LN_C(x) → f16 `[rows, C]`;
//!    projection GEMM (rocBLAS `gemm_ex`, [`GemmSpec::projection`]): proj = z·Wcatᵀ → f16
//!    `[rows, P]`, with Wcat = [left_proj; left_gate; right_proj; right_gate; out_gate] fused and
//!    cast to f16 once in [`Backend::prepare`];
//!    `input_gating`: left = lp ⊙ mask ⊙ σ(lg), right likewise → `[B, H, N, N]`, gate = σ(og) `[M, G]`;
//! 2. contraction (rocBLAS `gemm_strided_batched_ex`, [`GemmSpec::contraction`], A = right,
//!    B = left): t `[B, H, N, N]` f16, f32 accumulation; both directions by transposes alone;
//! 3. output, one of two paths ([`kernels::select_output`]):
//!    rocBLAS (default): `output_norm` (a = LN_H(t) [⊙ gate], into the `left` buffer), output
//!    GEMM ([`GemmSpec::output`], y = a·Woutᵀ in f32), af3: bias as a rank-1 GEMM update and
//!    `output_gate` (y ⊙= σ(z·Wgᵀ + bg));
//!    MFMA (opt-in, `TRIMUL_HIP_MFMA=1`, CDNA only): `output_projection` does all of step 3 in
//!    one kernel with `v_mfma_f32_32x32x8f16`. It is not yet validated on hardware.
//!
//! The stage kernels (`hip/*.hip`) share their source with the CUDA backend (`common/`), the
//! GEMMs share their layout math ([`GemmSpec`]); so both backends compute the same thing in the
//! same order, and what the H100 tests prove about the shared parts holds here too.
//!
//! `unsafe` lives in [`sys`] (loading), [`result`] (calls) and the launch/GEMM helpers at the end
//! of this file, each with its justification.

pub mod arch;
pub mod blas;
pub mod kernels;
pub mod plan;
pub mod result;
pub mod sys;

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use self::blas::{bias_update_spec, DataType, RocblasGemm};
use self::kernels::{HipKernelOutput, KernelImage};
use self::plan::{Plan, Staging};
use self::result::{BlasHandle, DeviceMem, Kernel, Stream};
use super::gemm::GemmSpec;
use super::params::{self as launch_params, KernelParams, INPUT_NORM_ROWS_PER_BLOCK, STAGE_THREADS};
use super::{Backend, DeviceInfo, MemoryInfo};
use crate::error::{BackendKind, Error, Result};
use crate::problem::{Config, Formulation, Problem, LN_EPS};
use crate::weights::Weights;

/// A HIP device with its stream, rocBLAS handle and loaded kernels. Cheap to clone (shared).
#[derive(Clone)]
pub struct HipBackend {
    ctx: Arc<Context>,
}

impl std::fmt::Debug for HipBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HipBackend({} {}, device {})", self.ctx.info.name, self.ctx.target_id, self.ctx.ordinal)
    }
}

struct Context {
    // Drop order is field order: the rocBLAS handle and the modules go before the stream.
    blas: Mutex<BlasHandle>,
    kernels: Mutex<Option<Arc<Kernels>>>,
    mfma: Mutex<Option<Arc<Kernel>>>,
    stream: Stream,
    api: &'static sys::HipApi,
    ordinal: i32,
    /// Raw target id, e.g. `gfx942:sramecc+:xnack-`.
    target_id: String,
    /// Normalised processor, e.g. `gfx942`.
    arch: String,
    info: DeviceInfo,
}

impl Drop for Context {
    fn drop(&mut self) {
        // Work still queued may use buffers and modules freed right after; wait for it.
        let _ = self.stream.synchronize();
    }
}

/// The portable stage kernels, loaded once per device.
struct Kernels {
    input_norm: Kernel,
    input_gating: Kernel,
    output_norm: Kernel,
    output_gate: Kernel,
}

/// Weights fused, cast and uploaded for this device.
pub struct HipPrepared {
    config: Config,
    /// f16 `[P, C]`: [left_proj; left_gate; right_proj; right_gate; out_gate].
    wcat: DeviceMem,
    /// f32 `[P]`, when any input-side linear layer has a bias (af3 only).
    proj_bias: Option<DeviceMem>,
    norm_in_w: DeviceMem,
    norm_in_b: DeviceMem,
    norm_out_w: DeviceMem,
    norm_out_b: DeviceMem,
    /// f16 `[C, H]`.
    wout: DeviceMem,
    /// f32 `[C]` (af3 with biases).
    out_bias: Option<DeviceMem>,
    output: HipKernelOutput,
    kernels: Arc<Kernels>,
    mfma: Option<Arc<Kernel>>,
}

/// Device buffers for one problem shape (see [`plan`]).
pub struct HipWorkspace {
    plan: Plan,
    left: DeviceMem,
    right: DeviceMem,
    gate: DeviceMem,
    t: DeviceMem,
    staging: Option<DeviceMem>,
    ones: Option<DeviceMem>,
    /// Device copies of x, mask and y for [`Backend::forward_host`], made on first use.
    host_io: Option<HostIo>,
}

struct HostIo {
    x: HipBuffer,
    mask: Option<HipBuffer>,
    y: HipBuffer,
}

/// `len` f32 values in device memory.
pub struct HipBuffer {
    mem: DeviceMem,
    len: usize,
}

impl HipBuffer {
    /// The device address (for interop with other HIP code on the same device).
    pub fn device_ptr(&self) -> u64 {
        self.mem.addr()
    }
}

fn poisoned<T>(_: std::sync::PoisonError<T>) -> Error {
    Error::InvalidArgument("a previous HIP call panicked while holding the device lock".into())
}

fn f16_bits(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect()
}

impl HipBackend {
    /// Opens HIP device `ordinal`: loads the HIP runtime and rocBLAS, reads the device's arch,
    /// checks that kernels exist or can be compiled for it, creates a stream and a rocBLAS handle.
    pub fn new(ordinal: usize) -> Result<HipBackend> {
        let api = sys::hip()?;
        let no_device = |reason: String| Error::NoDevice { backend: BackendKind::Hip, reason };
        result::init(api).map_err(|e| no_device(format!("the HIP runtime did not initialise: {e}")))?;
        let count = result::device_count(api)?;
        if count == 0 {
            return Err(no_device(format!("{} loaded but reports no AMD GPU", api.path)));
        }
        if ordinal >= count {
            return Err(no_device(format!("device {ordinal} requested, {count} present")));
        }
        let ord = ordinal as i32;
        result::set_device(api, ord)?;
        let target_id = result::device_arch(api, ord)?;
        let arch = arch::normalize_arch(&target_id).ok_or_else(|| Error::NoKernels {
            arch: target_id.clone(),
            reason: "the runtime reported an arch name that is not a gfx target id".into(),
        })?;
        // Fail here rather than at the first forward when no kernel can be had for this arch.
        let kernel_origin = kernel_origin(&arch)?;
        let blas_api = sys::rocblas()?;
        let stream = Stream::new(api)?;
        let blas = BlasHandle::new(blas_api, &stream)?;

        let name = result::device_name(api, ord).unwrap_or_else(|e| format!("AMD GPU ({e})"));
        let cus = result::device_attribute(api, sys::HIP_ATTR_MULTIPROCESSOR_COUNT, ord).unwrap_or(0);
        let memory = result::device_total_mem(api, ord).unwrap_or(0);
        let text = |r: Result<String>| r.unwrap_or_else(|e| format!("unknown ({e})"));
        let (output, output_why) = kernels::select_output(&arch, 128, std::env::var(kernels::MFMA_ENV).ok().as_deref());
        let versions = vec![
            ("HIP runtime".to_string(), text(result::runtime_version(api).map(arch::format_hip_version))),
            ("HIP driver".to_string(), text(result::driver_version(api).map(arch::format_hip_version))),
            ("rocBLAS".to_string(), text(result::rocblas_version(blas_api))),
            ("target id".to_string(), target_id.clone()),
            ("PCI bus".to_string(), text(result::pci_bus_id(api, ord))),
            ("libamdhip64".to_string(), api.path.clone()),
            ("librocblas".to_string(), blas_api.path.clone()),
            ("kernels".to_string(), format!("{kernel_origin} (build: {})", kernels::HIP_BUILD)),
            (
                "output stage (H=128)".to_string(),
                match output {
                    HipKernelOutput::Blas => format!("rocBLAS: {output_why}"),
                    HipKernelOutput::Mfma => format!("MFMA: {output_why}"),
                },
            ),
        ];
        let info = DeviceInfo {
            vendor: "AMD".to_string(),
            name,
            arch: arch.clone(),
            compute_units: cus.max(0) as u32,
            memory_bytes: memory,
            versions,
        };
        Ok(HipBackend {
            ctx: Arc::new(Context {
                blas: Mutex::new(blas),
                kernels: Mutex::new(None),
                mfma: Mutex::new(None),
                stream,
                api,
                ordinal: ord,
                target_id,
                arch,
                info,
            }),
        })
    }

    /// The normalised arch (`gfx942`).
    pub fn arch(&self) -> &str {
        &self.ctx.arch
    }

    /// Milliseconds of device time the work enqueued by `f` takes (HIP events on our stream).
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f32> {
        self.bind()?;
        let timer = result::Timer::new(self.ctx.api)?;
        timer.start(&self.ctx.stream)?;
        f()?;
        timer.stop(&self.ctx.stream)?;
        timer.elapsed_ms()
    }

    /// HIP's current device is per thread; every entry point makes ours current first.
    fn bind(&self) -> Result<()> {
        result::set_device(self.ctx.api, self.ctx.ordinal)
    }

    fn upload_f32(&self, v: &[f32]) -> Result<DeviceMem> {
        let mem = DeviceMem::alloc(self.ctx.api, std::mem::size_of_val(v))?;
        mem.upload(&self.ctx.stream, 0, v)?;
        Ok(mem)
    }

    fn upload_f16(&self, v: &[f32]) -> Result<DeviceMem> {
        let bits = f16_bits(v);
        let mem = DeviceMem::alloc(self.ctx.api, 2 * bits.len())?;
        mem.upload(&self.ctx.stream, 0, &bits)?;
        Ok(mem)
    }

    fn load_stage(&self, stage: &'static str) -> Result<Kernel> {
        let force = std::env::var(kernels::FORCE_RTC_ENV).is_ok_and(|v| v.trim() == "1");
        let prebuilt = kernels::HIP_PREBUILT_ARCHS.contains(&self.ctx.arch.as_str());
        let rtc = if force || !prebuilt || kernels::needs_mfma(stage) {
            sys::hiprtc().map(|_| ()).map_err(|e| e.to_string())
        } else {
            Err("not needed: prebuilt code objects".to_string())
        };
        match kernels::select(kernels::HIP_STAGES, stage, &self.ctx.target_id, rtc, force)? {
            KernelImage::Prebuilt { code, .. } => Kernel::load(self.ctx.api, code.to_vec(), stage),
            KernelImage::Compile { source, options, .. } => {
                let code = result::rtc_compile(sys::hiprtc()?, source, stage, &options)?;
                Kernel::load(self.ctx.api, code, stage)
            }
        }
    }

    fn kernels(&self) -> Result<Arc<Kernels>> {
        let mut slot = self.ctx.kernels.lock().map_err(poisoned)?;
        if let Some(k) = slot.as_ref() {
            return Ok(k.clone());
        }
        let k = Arc::new(Kernels {
            input_norm: self.load_stage(kernels::INPUT_NORM)?,
            input_gating: self.load_stage(kernels::INPUT_GATING)?,
            output_norm: self.load_stage(kernels::OUTPUT_NORM)?,
            output_gate: self.load_stage(kernels::OUTPUT_GATE)?,
        });
        *slot = Some(k.clone());
        Ok(k)
    }

    fn mfma_kernel(&self) -> Result<Arc<Kernel>> {
        let mut slot = self.ctx.mfma.lock().map_err(poisoned)?;
        if let Some(k) = slot.as_ref() {
            return Ok(k.clone());
        }
        let k = Arc::new(self.load_stage(kernels::OUTPUT_PROJECTION)?);
        *slot = Some(k.clone());
        Ok(k)
    }

    fn blas(&self) -> Result<MutexGuard<'_, BlasHandle>> {
        self.ctx.blas.lock().map_err(poisoned)
    }

    fn check_fits(&self, what: &str, needed: u64) -> Result<()> {
        let (free, _) = result::mem_get_info(self.ctx.api)?;
        if needed > free {
            return Err(Error::OutOfMemory {
                backend: BackendKind::Hip,
                what: what.to_string(),
                needed,
                available: free,
            });
        }
        Ok(())
    }

    /// Enqueues the whole forward (module docs) on device addresses whose sizes the caller has
    /// checked against `problem` and `ws.plan`.
    fn enqueue(
        &self,
        prep: &HipPrepared,
        ws: &HipWorkspace,
        problem: &Problem,
        x: u64,
        mask: Option<u64>,
        y: u64,
    ) -> Result<()> {
        let plan = &ws.plan;
        let Config { c, h, formulation } = problem.config;
        let (b, n) = (problem.shape.batch, problem.shape.n);
        let m = plan.rows;
        let k = &prep.kernels;
        let stream = &self.ctx.stream;
        let staging = ws.staging.as_ref().unwrap_or(&ws.t);
        debug_assert!(plan.staging == Staging::Separate || ws.staging.is_none());
        let int =
            |v: usize, what: &str| i32::try_from(v).map_err(|_| Error::Shape(format!("{what} = {v} exceeds i32")));
        let base = KernelParams {
            x,
            mask: mask.unwrap_or(0),
            norm_in_w: prep.norm_in_w.addr(),
            norm_in_b: prep.norm_in_b.addr(),
            proj_bias: prep.proj_bias.as_ref().map_or(0, DeviceMem::addr),
            norm_out_w: prep.norm_out_w.addr(),
            norm_out_b: prep.norm_out_b.addr(),
            z: staging.addr(),
            proj: staging.addr() + plan.proj_offset as u64,
            left: ws.left.addr(),
            right: ws.right.addr(),
            gate: ws.gate.addr(),
            t: ws.t.addr(),
            a: ws.left.addr(),
            y,
            row0: 0,
            rows: m as i64,
            batch: int(b, "B")?,
            n: int(n, "N")?,
            c: int(c, "C")?,
            h: int(h, "H")?,
            g: int(plan.g, "G")?,
            p: int(plan.p, "P")?,
            af3: i32::from(formulation == Formulation::Af3),
            tile_rows: 0,
            eps: LN_EPS,
            reserved: 0,
        };
        let blas = self.blas()?;

        // 1. LN_C, projection, gating, chunk by chunk.
        let tr = launch_params::gating_tile_rows(h);
        for (row0, rows) in plan.chunks() {
            let p = KernelParams { row0: row0 as i64, rows: rows as i64, tile_rows: tr as i32, ..base };
            launch(&k.input_norm, stream, rows.div_ceil(INPUT_NORM_ROWS_PER_BLOCK as usize), 0, &p)?;
            let g = RocblasGemm::from_spec(&GemmSpec::projection(rows, c, plan.p), DataType::F16, DataType::F16)?;
            gemm(&blas, &g, 1.0, prep.wcat.addr(), base.z, 0.0, base.proj)?;
            launch(&k.input_gating, stream, rows.div_ceil(tr), launch_params::gating_smem_bytes(h, tr), &p)?;
        }

        // 2. Contraction: A = right, B = left, D = t, one N×N matrix per (b, h).
        let g =
            RocblasGemm::from_spec(&GemmSpec::contraction(problem.direction, b * h, n), DataType::F16, DataType::F16)?;
        gemm(&blas, &g, 1.0, ws.right.addr(), ws.left.addr(), 0.0, ws.t.addr())?;

        // 3. Output stage.
        match prep.output {
            HipKernelOutput::Mfma => {
                let kernel = prep.mfma.as_ref().ok_or_else(|| Error::NoKernels {
                    arch: self.ctx.arch.clone(),
                    reason: "MFMA output kernel selected but not loaded".into(),
                })?;
                let p = KernelParams { tile_rows: kernels::OUTPUT_PROJECTION_ROWS as i32, ..base };
                let wout = prep.wout.addr();
                let bias = prep.out_bias.as_ref().map_or(0, DeviceMem::addr);
                launch_output_projection(kernel, stream, m, h, &p, wout, bias)?;
            }
            HipKernelOutput::Blas => {
                let tp = launch_params::output_norm_tile_rows(h);
                let p = KernelParams { tile_rows: tp as i32, ..base };
                launch(&k.output_norm, stream, m.div_ceil(tp), launch_params::output_norm_smem_bytes(h, tp), &p)?;
                let g = RocblasGemm::from_spec(&GemmSpec::output(m, c, h), DataType::F16, DataType::F32)?;
                gemm(&blas, &g, 1.0, prep.wout.addr(), base.a, 0.0, y)?;
                if let Some(bias) = &prep.out_bias {
                    let ones = ws.ones.as_ref().ok_or_else(|| {
                        Error::InvalidArgument("workspace has no ones vector for the af3 bias".into())
                    })?;
                    let g = RocblasGemm::from_spec(&bias_update_spec(m, c), DataType::F32, DataType::F32)?;
                    gemm(&blas, &g, 1.0, bias.addr(), ones.addr(), 1.0, y)?;
                }
                if formulation == Formulation::Af3 {
                    let grid = (m * c).div_ceil(STAGE_THREADS as usize).clamp(1, OUTPUT_GATE_MAX_GRID);
                    let p = KernelParams { tile_rows: grid as i32, ..base };
                    launch(&k.output_gate, stream, grid, 0, &p)?;
                }
            }
        }
        Ok(())
    }

    fn check_problem(&self, prep: &HipPrepared, ws: &HipWorkspace, problem: &Problem) -> Result<()> {
        if prep.config != problem.config {
            return Err(Error::InvalidArgument(format!(
                "weights prepared for {:?} used with a problem of {:?}",
                prep.config, problem.config
            )));
        }
        if !ws.plan.fits(problem) {
            return Err(Error::InvalidArgument("workspace was made for another problem shape".into()));
        }
        Ok(())
    }
}

/// Grid-stride blocks of `output_gate` (enough to fill an MI300X several times over).
const OUTPUT_GATE_MAX_GRID: usize = 1 << 16;

/// Where kernels for `arch` will come from, or why none can.
fn kernel_origin(arch: &str) -> Result<String> {
    if kernels::HIP_PREBUILT_ARCHS.contains(&arch) {
        return Ok(format!("prebuilt code objects for {arch}"));
    }
    match sys::hiprtc() {
        Ok(rtc) => Ok(format!("hipRTC ({}) for {arch}", rtc.path)),
        Err(e) => Err(Error::NoKernels {
            arch: arch.to_string(),
            reason: format!(
                "this build has code objects for [{}] only, and hipRTC is unavailable: {e}",
                kernels::HIP_PREBUILT_ARCHS.join(", ")
            ),
        }),
    }
}

impl Backend for HipBackend {
    type Buffer = HipBuffer;
    // Boxed: a layer stores both inline, and these hold a dozen device buffers each.
    type Prepared = Box<HipPrepared>;
    type Workspace = Box<HipWorkspace>;

    fn kind(&self) -> BackendKind {
        BackendKind::Hip
    }

    fn info(&self) -> DeviceInfo {
        self.ctx.info.clone()
    }

    fn prepare(&self, weights: &Weights) -> Result<Box<HipPrepared>> {
        weights.validate()?;
        self.bind()?;
        let config = weights.config();
        let (c, p) = (config.c, config.fused_proj_width());
        let inputs =
            [&weights.left_proj, &weights.left_gate, &weights.right_proj, &weights.right_gate, &weights.out_gate];
        let mut wcat = Vec::with_capacity(p * c);
        for l in inputs {
            wcat.extend_from_slice(&l.weight);
        }
        let proj_bias = if inputs.iter().any(|l| l.bias.is_some()) {
            let mut bias = Vec::with_capacity(p);
            for l in inputs {
                match &l.bias {
                    Some(b) => bias.extend_from_slice(b),
                    None => bias.extend(std::iter::repeat_n(0.0f32, l.out_features)),
                }
            }
            Some(self.upload_f32(&bias)?)
        } else {
            None
        };
        let (output, _) =
            kernels::select_output(&self.ctx.arch, config.h, std::env::var(kernels::MFMA_ENV).ok().as_deref());
        let mfma = match output {
            HipKernelOutput::Mfma => Some(self.mfma_kernel()?),
            HipKernelOutput::Blas => None,
        };
        Ok(Box::new(HipPrepared {
            config,
            wcat: self.upload_f16(&wcat)?,
            proj_bias,
            norm_in_w: self.upload_f32(&weights.norm_in.weight)?,
            norm_in_b: self.upload_f32(&weights.norm_in.bias)?,
            norm_out_w: self.upload_f32(&weights.norm_out.weight)?,
            norm_out_b: self.upload_f32(&weights.norm_out.bias)?,
            wout: self.upload_f16(&weights.out_proj.weight)?,
            out_bias: weights.out_proj.bias.as_ref().map(|b| self.upload_f32(b)).transpose()?,
            output,
            kernels: self.kernels()?,
            mfma,
        }))
    }

    fn workspace(&self, _prepared: &Box<HipPrepared>, problem: &Problem) -> Result<Box<HipWorkspace>> {
        self.bind()?;
        let plan = Plan::new(problem)?;
        let (b, n) = (problem.shape.batch, problem.shape.n);
        self.check_fits(&format!("HIP workspace for B={b} N={n}"), plan.total_bytes())?;
        let api = self.ctx.api;
        let staging = match plan.staging {
            Staging::Separate => Some(DeviceMem::alloc(api, plan.staging_bytes)?),
            Staging::InT => None,
        };
        let ones = if plan.ones_bytes > 0 {
            let mem = DeviceMem::alloc(api, plan.ones_bytes)?;
            mem.upload(&self.ctx.stream, 0, &vec![1.0f32; plan.rows])?;
            Some(mem)
        } else {
            None
        };
        Ok(Box::new(HipWorkspace {
            left: DeviceMem::alloc(api, plan.left_bytes)?,
            right: DeviceMem::alloc(api, plan.left_bytes)?,
            gate: DeviceMem::alloc(api, plan.gate_bytes)?,
            t: DeviceMem::alloc(api, plan.t_bytes)?,
            staging,
            ones,
            host_io: None,
            plan,
        }))
    }

    fn workspace_fits(&self, workspace: &Box<HipWorkspace>, problem: &Problem) -> bool {
        workspace.plan.fits(problem)
    }

    fn workspace_bytes(&self, _prepared: &Box<HipPrepared>, problem: &Problem) -> u64 {
        Plan::new(problem).map_or(u64::MAX, |p| p.total_bytes())
    }

    fn alloc(&self, len: usize) -> Result<HipBuffer> {
        self.bind()?;
        let bytes = len.checked_mul(4).ok_or_else(|| Error::Shape(format!("buffer of {len} f32 overflows")))?;
        Ok(HipBuffer { mem: DeviceMem::alloc(self.ctx.api, bytes)?, len })
    }

    fn buffer_len(buffer: &HipBuffer) -> usize {
        buffer.len
    }

    fn upload(&self, src: &[f32], dst: &mut HipBuffer) -> Result<()> {
        if src.len() != dst.len {
            return Err(Error::Shape(format!("upload of {} values into a buffer of {}", src.len(), dst.len)));
        }
        self.bind()?;
        dst.mem.upload(&self.ctx.stream, 0, src)
    }

    fn download(&self, src: &HipBuffer, dst: &mut [f32]) -> Result<()> {
        if src.len != dst.len() {
            return Err(Error::Shape(format!("download of a buffer of {} values into {}", src.len, dst.len())));
        }
        self.bind()?;
        src.mem.download(&self.ctx.stream, 0, dst)
    }

    fn forward(
        &self,
        prepared: &Box<HipPrepared>,
        workspace: &mut Box<HipWorkspace>,
        problem: &Problem,
        x: &HipBuffer,
        mask: Option<&HipBuffer>,
        y: &mut HipBuffer,
    ) -> Result<()> {
        problem.check_lengths(x.len, mask.map(|m| m.len), y.len)?;
        self.check_problem(prepared, workspace, problem)?;
        self.bind()?;
        self.enqueue(prepared, workspace, problem, x.mem.addr(), mask.map(|m| m.mem.addr()), y.mem.addr())
    }

    fn forward_host(
        &self,
        prepared: &Box<HipPrepared>,
        workspace: &mut Box<HipWorkspace>,
        problem: &Problem,
        x: &[f32],
        mask: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<()> {
        problem.check_lengths(x.len(), mask.map(<[f32]>::len), y.len())?;
        self.check_problem(prepared, workspace, problem)?;
        self.bind()?;
        let reuse = workspace
            .host_io
            .as_ref()
            .is_some_and(|io| io.x.len == x.len() && io.mask.as_ref().map(|m| m.len) == mask.map(<[f32]>::len));
        if !reuse {
            workspace.host_io = None;
            let bytes = 4 * (2 * x.len() + mask.map_or(0, <[f32]>::len)) as u64;
            self.check_fits("device copies of x, mask and y", bytes)?;
            workspace.host_io = Some(HostIo {
                x: self.alloc(x.len())?,
                mask: mask.map(|m| self.alloc(m.len())).transpose()?,
                y: self.alloc(y.len())?,
            });
        }
        let io = workspace.host_io.take().ok_or_else(|| Error::InvalidArgument("host I/O buffers missing".into()))?;
        let run = (|| {
            io.x.mem.upload(&self.ctx.stream, 0, x)?;
            if let (Some(dm), Some(hm)) = (&io.mask, mask) {
                dm.mem.upload(&self.ctx.stream, 0, hm)?;
            }
            let mask_addr = io.mask.as_ref().map(|m| m.mem.addr());
            self.enqueue(prepared, workspace, problem, io.x.mem.addr(), mask_addr, io.y.mem.addr())?;
            io.y.mem.download(&self.ctx.stream, 0, y)
        })();
        workspace.host_io = Some(io);
        run
    }

    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.ctx.stream.synchronize()
    }

    fn memory_info(&self) -> Result<Option<MemoryInfo>> {
        self.bind()?;
        let (free, total) = result::mem_get_info(self.ctx.api)?;
        Ok(Some(MemoryInfo { free, total }))
    }
}

// ----------------------------------------------------------------------- launches and GEMMs
//
// The only unsafe code of this file. Every device address these helpers pass comes from a
// `DeviceMem` of a prepared layer, a workspace whose `Plan` equals `Plan::new(problem)` (checked
// by `check_problem`), or a caller buffer whose length `Problem::check_lengths` checked; the
// kernels and GEMMs touch only the index ranges those sizes cover (layouts in common/params.h,
// spans in `RocblasGemm`). The buffers outlive the work: forward callers hold them until they
// synchronise, and dropping a `DeviceMem` frees it with hipFree, which waits for the device.

/// Launches a portable stage (`kernel(TrimulParams)`) with `STAGE_THREADS` threads per block.
fn launch(kernel: &Kernel, stream: &Stream, grid: usize, smem: usize, params: &KernelParams) -> Result<()> {
    let (grid, smem) = geometry(kernel, grid, smem)?;
    let mut p = *params;
    let mut args = [(&mut p as *mut KernelParams).cast::<c_void>()];
    // SAFETY: one argument, a TrimulParams by value, as the stage is declared; the addresses in it
    // satisfy the invariant stated above this section.
    unsafe { kernel.launch(stream, grid, STAGE_THREADS, smem, &mut args) }
}

/// Launches `output_projection(TrimulParams, const half* wout, const float* out_bias)`.
fn launch_output_projection(
    kernel: &Kernel,
    stream: &Stream,
    rows: usize,
    h: usize,
    params: &KernelParams,
    wout: u64,
    out_bias: u64,
) -> Result<()> {
    let (grid, smem) =
        geometry(kernel, rows.div_ceil(kernels::OUTPUT_PROJECTION_ROWS), kernels::output_projection_smem_bytes(h))?;
    let (mut p, mut w, mut bias) = (*params, wout, out_bias);
    let mut args = [
        (&mut p as *mut KernelParams).cast::<c_void>(),
        (&mut w as *mut u64).cast::<c_void>(),
        (&mut bias as *mut u64).cast::<c_void>(),
    ];
    // SAFETY: three arguments matching the kernel's declaration (a device pointer is 8 bytes);
    // wout is the prepared [C, H] f16 matrix and out_bias a [C] f32 vector or null; the rest as
    // stated above this section.
    unsafe { kernel.launch(stream, grid, kernels::OUTPUT_PROJECTION_THREADS, smem, &mut args) }
}

/// Grid and LDS size as the launch API takes them, with HIP's limits checked.
fn geometry(kernel: &Kernel, grid: usize, smem: usize) -> Result<(u32, u32)> {
    // HIP counts the grid in threads in 32 bits: blocks × 256 must stay below 2³².
    if grid > (u32::MAX / STAGE_THREADS) as usize {
        return Err(Error::Shape(format!("{}: {grid} blocks exceed HIP's grid limit", kernel.name())));
    }
    if smem > kernels::LDS_BYTES {
        return Err(Error::Shape(format!("{}: {smem} bytes of LDS exceed 64 KiB", kernel.name())));
    }
    Ok((grid as u32, smem as u32))
}

/// One rocBLAS call; `c` aliases `d`.
fn gemm(blas: &BlasHandle, g: &RocblasGemm, alpha: f32, a: u64, b: u64, beta: f32, d: u64) -> Result<()> {
    // SAFETY: `g` was built from the GemmSpec of this problem, whose spans fit the buffers behind
    // a, b and d (invariant above this section).
    unsafe { blas.gemm(g, alpha, a, b, beta, d) }
}
