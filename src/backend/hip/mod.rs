//! HIP backend for AMD GPUs: MI300 (gfx942) and MI200 (gfx90a) from prebuilt code objects, other
//! archs through hipRTC. Built with `--features rocm`; needs no ROCm at build time.
//!
//! One forward, in the notation of SPEC.md (M = B·N² positions, P = 4H + G):
//! 1. per chunk of positions (see `plan`):
//!    `input_norm`: z = LN_C(x) → f16 `[rows, C]`;
//!    projection GEMM (rocBLAS `gemm_ex`, `GemmSpec::projection`): proj = z·Wcatᵀ → f16
//!    `[rows, P]`, with Wcat = [left_proj; left_gate; right_proj; right_gate; out_gate] fused and
//!    cast to f16 once in [`Backend::prepare`];
//!    `input_gating`: left = lp ⊙ mask ⊙ σ(lg), right likewise → `[B, H, N, N]`, gate = σ(og) `[M, G]`;
//! 2. contraction (rocBLAS `gemm_strided_batched_ex`, `GemmSpec::contraction`, A = right,
//!    B = left): t `[B, H, N, N]` f16, f32 accumulation; both directions by transposes alone;
//! 3. output, one of two paths (`kernels::select_output`):
//!    rocBLAS (default): `output_norm` (a = LN_H(t) [⊙ gate], into the `left` buffer), output
//!    GEMM (`GemmSpec::output`, y = a·Woutᵀ in f32), af3: the bias as a rank-1 GEMM update and
//!    `output_gate` (y ⊙= σ(z·Wgᵀ + bg));
//!    MFMA (CDNA only): `output_projection` does all of step 3 in one kernel with
//!    `v_mfma_f32_32x32x8f16`. It has not run on hardware yet, so a layer uses it only where this
//!    device validated it for the layer's C and H and it beat rocBLAS (`validate.rs`,
//!    `crate::validation`), or where `TRIMUL_HIP_MFMA=1` forces it.
//!
//! Step 1 also has a fused MFMA form (CDNA only): `input_projection` does LN_C, the projection and
//! the gating in one kernel, z kept in LDS. Like the output kernel it is used only where this
//! device validated it and it won, or where `TRIMUL_HIP_MFMA=1` forces it.
//!
//! When that plan's workspace does not fit the memory budget (or the free memory), the forward
//! runs a chunked [`Plan`] instead: steps 1 and 2 in passes over hidden channels, then step 3 per
//! row chunk with the gate recomputed from x. With the fused input kernel (`FUSED_CAPS`) a pass
//! launches it for its channels' work items and the gate pass for the gate's; with the stage
//! kernels each pass's rows of the gated projections are packed into one weight block when the
//! workspace is made, so `input_gating` runs unchanged with H = the pass width, and the gate is
//! `input_gating` with H = 0 over the out-gate columns. The math of why this is exact, and of
//! in-place mode, is in [`crate::plan`].
//!
//! The stage kernels (`hip/*.hip`) share their source with the CUDA backend (`common/`), the
//! GEMMs share their layout math (`GemmSpec`); so both backends compute the same thing in the
//! same order, and what the H100 tests prove about the shared parts holds here too. Nothing is
//! allocated inside a forward and nothing waits on the host; forwards on host slices are staged
//! above the backends (`src/staging.rs`), with the copies of [`Backend::upload_async`] and
//! [`Backend::download_words`].
//!
//! `unsafe` lives in `sys` (loading), `result` (calls) and the enqueue/launch/GEMM helpers of
//! this file and `backward.rs`, each with its justification.
//!
//! The backward pass (issue 28) is `backward.rs`: the CUDA backward's steps with the same kernels
//! and rocBLAS f32 GEMMs, so far run only on the fake ROCm.

pub(crate) mod arch;
mod backward;
pub(crate) mod blas;
mod context;
pub(crate) mod kernels;
pub(crate) mod result;
pub(crate) mod sys;
mod validate;

#[cfg(test)]
mod host_tests;

pub use self::context::{HipBackend, HipPrepared};
pub use self::kernels::{HipFastPath, HipKernelOutput};

use self::context::{launch_by_value, poisoned, Context, Kernels, Stages, POISON_BYTE};

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use self::blas::{bias_update_spec, DataType, RocblasGemm};
use self::kernels::{KernelImage, PathRule};
use self::result::{AllocTracker, BlasHandle, DeviceMem, Kernel, Stream, Timer};
use super::caller_workspace::{self, SpanCarver};
use super::device_prepare::{fill_params, params as prepare_params, PreparedLayout};
use super::gemm::GemmSpec;
use super::gpu_ceilings;
use super::params::{
    self as launch_params, to_i32, to_i64, Addresses, CommonParams, InputParams, OutputParams, PrepareParams,
    StageParams, INPUT_NORM_ROWS_PER_BLOCK, PREP_THREADS, STAGE_THREADS,
};
use super::prepared::PreparedTensors;
use super::staged_steps::{self, StagedBuffers, StagedStep};
use super::{
    check_device_forward, check_prepared_for, check_same_weights, device_operands, Backend, Ceilings, DeviceInfo,
    MemoryInfo,
};
use crate::device_io::{BackwardDeviceIo, BackwardIo, DeviceSpan, DeviceWeights, ForwardIo, HostWords, HostWordsMut};
use crate::error::{BackendKind, Error, Result};
use crate::gradients::Gradients;
use crate::plan::ExecPlan;
use crate::plan::{Blas, Buffer, Capabilities, InputStage, Plan};
use crate::problem::{Config, Formulation, Precision, Problem};
use crate::validation::VerdictStore;
use crate::weights::Weights;

/// The plans of the stage kernels around rocBLAS. One-pass workspaces are always planned so
/// (z and proj inside t or a buffer of their own), and serve the fused input kernel too, which
/// leaves z and proj unused.
const ROCM_CAPS: Capabilities = Capabilities { input: InputStage::Staged, blas: Blas::RocBlas };
/// The chunked plans of the fused MFMA input kernel: no z, proj or per-pass weight copies (the
/// kernel reads the prepared weights and runs a pass's work items alone).
const FUSED_CAPS: Capabilities = Capabilities { input: InputStage::Fused, blas: Blas::RocBlas };

/// The capabilities a layer's chunked plans are made for.
fn chunked_caps(prepared: &HipPrepared) -> Capabilities {
    if prepared.fused_input() {
        FUSED_CAPS
    } else {
        ROCM_CAPS
    }
}

/// Grid-stride blocks of `output_gate` (enough to fill an MI300X's 304 CUs many times over).
const OUTPUT_GATE_MAX_GRID: usize = 65_535;

impl std::fmt::Debug for HipPrepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HipPrepared({:?}, output {:?})", self.config, self.output)
    }
}

impl std::fmt::Debug for HipWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HipWorkspace({:?}, {} bytes)", self.problem.shape, self.layout.bytes())
    }
}

impl std::fmt::Debug for HipBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HipBuffer({} f32 at {:#x})", self.len, self.mem.addr())
    }
}

impl HipPrepared {
    /// How this layer's output stage runs on this device.
    pub fn output_path(&self) -> HipKernelOutput {
        self.output
    }

    /// Whether this layer's forwards run the fused MFMA input kernel (`input_projection`), in
    /// one-pass and chunked plans; otherwise `input_norm` + rocBLAS + `input_gating`.
    pub fn fused_input(&self) -> bool {
        self.input.is_some()
    }
}

/// Device buffers for one problem shape (see `plan`).
pub struct HipWorkspace {
    problem: Problem,
    layout: Layout,
    /// The prepared weights a chunked workspace holds copies of (`None` for one pass and for the
    /// fused input kernel's chunked plans, which read the prepared weights).
    weights_of: Option<u64>,
    /// For a workspace in caller memory ([`HipBackend::plan_caller_workspace`]), the address its
    /// buffers are laid out from now (0 until the first bind) and the bytes they span.
    caller_base: Option<(u64, u64)>,
}

/// Where the intermediates live: everything at once, or a plan within a memory limit.
enum Layout {
    OnePass(OnePass),
    Chunked(Chunked),
}

/// The fastest plan (a one-pass [`Plan`]): left, right, the gate and t for every position.
struct OnePass {
    plan: Plan,
    left: DeviceMem,
    right: DeviceMem,
    gate: DeviceMem,
    t: DeviceMem,
    /// z and proj of the projection, when they do not live inside t.
    projection: Option<DeviceMem>,
    ones: Option<DeviceMem>,
}

/// Hidden passes and row chunks (a chunked [`Plan`]).
struct Chunked {
    plan: Plan,
    t: DeviceMem,
    scratch: DeviceMem,
    /// Each pass's rows of the gated projections, packed `[lp; lg; rp; rg]` (and their biases):
    /// the stage kernels' plans only.
    pass_w: Option<DeviceMem>,
    ones: Option<DeviceMem>,
}

impl Layout {
    fn bytes(&self) -> u64 {
        match self {
            Layout::OnePass(o) => o.plan.workspace_bytes(),
            Layout::Chunked(c) => c.plan.workspace_bytes(),
        }
    }
}

/// What every stage of one forward is enqueued with ([`HipBackend::enqueue`]): the rocBLAS
/// handle bound to `stream`, the prepared weights, the problem, the call's pointers and shape
/// (`base`), and whether the tests' poisoning is on.
#[derive(Clone, Copy)]
struct Enqueue<'a> {
    blas: &'a BlasHandle,
    prep: &'a HipPrepared,
    problem: &'a Problem,
    base: &'a CommonParams,
    poison: bool,
    stream: sys::hipStream_t,
}

/// `len` f32 values in device memory.
pub struct HipBuffer {
    mem: DeviceMem,
    len: usize,
}

impl HipBuffer {
    /// The device address, for [`Layer::forward_on_stream`](crate::Layer::forward_on_stream)
    /// and interop with other HIP code.
    pub fn device_ptr(&self) -> u64 {
        self.mem.addr()
    }

    /// Number of f32 values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

fn env_flag(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl HipBackend {
    /// Opens HIP device `ordinal`: loads the HIP runtime and rocBLAS, reads the device's arch,
    /// loads (or compiles with hipRTC) the stage kernels, creates a stream and a rocBLAS handle.
    /// Missing libraries, no device and no usable kernels are errors, never panics.
    pub fn new(ordinal: usize) -> Result<HipBackend> {
        Self::open(ordinal, env_flag(kernels::FORCE_RTC_ENV).is_some_and(|v| v.trim() == "1"))
    }

    /// Like [`HipBackend::new`], but every stage is compiled from its embedded source with hipRTC
    /// even where a code object exists: the path other archs take, testable on an MI300.
    pub fn with_runtime_compilation(ordinal: usize) -> Result<HipBackend> {
        Self::open(ordinal, true)
    }

    fn open(ordinal: usize, force_rtc: bool) -> Result<HipBackend> {
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
        // rocBLAS first: a missing library is the cheaper failure, before any hipRTC compile.
        let blas_api = sys::rocblas()?;
        let kernels = load_kernels(api, &target_id, force_rtc)?;
        let stream = Stream::new(api)?;
        let blas = BlasHandle::new(blas_api, &stream)?;

        let name = result::device_name(api, ord).unwrap_or_else(|e| format!("AMD GPU ({e})"));
        let cus = result::device_attribute(api, sys::HIP_ATTR_MULTIPROCESSOR_COUNT, ord).unwrap_or(0);
        let memory = result::device_total_mem(api, ord).unwrap_or(0);
        let text = |r: Result<String>| r.unwrap_or_else(|e| format!("unknown ({e})"));
        let env = env_flag(kernels::MFMA_ENV);
        let rule_text = |rule: PathRule, fast: &str, portable: &str| match rule {
            PathRule::Fixed { on: false, why } => format!("{portable} ({why})"),
            PathRule::Fixed { on: true, why } => format!("{fast} ({why})"),
            PathRule::ByVerdict => {
                format!(
                    "{fast} where this device's validation passed and it won, else {portable} (validated on first use)"
                )
            }
        };
        let output_text = rule_text(
            kernels::output_rule(&arch, 128, env.as_deref()),
            "MFMA output_projection",
            "output_norm + rocBLAS",
        );
        let input_text = rule_text(
            kernels::input_rule(&arch, 128, env.as_deref()),
            "MFMA input_projection",
            "input_norm + rocBLAS + input_gating",
        );
        let versions = vec![
            ("HIP runtime".to_string(), text(result::runtime_version(api).map(arch::format_hip_version))),
            ("HIP driver".to_string(), text(result::driver_version(api).map(arch::format_hip_version))),
            ("rocBLAS".to_string(), text(result::rocblas_version(blas_api))),
            ("target id".to_string(), target_id.clone()),
            ("PCI bus".to_string(), text(result::pci_bus_id(api, ord))),
            ("libamdhip64".to_string(), api.path.clone()),
            ("librocblas".to_string(), blas_api.path.clone()),
            ("kernels".to_string(), format!("{} [{}]", kernels::HIP_BUILD, kernels.origin)),
            ("input stage (C=128, one pass)".to_string(), input_text),
            ("output stage (H=128)".to_string(), output_text),
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
                kernels,
                mfma: Mutex::new(None),
                mfma_input: Mutex::new(None),
                backward: Mutex::new(None),
                backward_block: Mutex::new(None),
                stream,
                api,
                tracker: Arc::new(AllocTracker::default()),
                poison: AtomicBool::new(false),
                mfma_setting: Mutex::new(None),
                verdicts: Mutex::new(HashMap::new()),
                store: VerdictStore::from_env(),
                force_rtc,
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

    /// Whether this GPU has the matrix-core (MFMA) instructions the fused output kernel uses
    /// (CDNA: gfx908, gfx90a, gfx94x, gfx950).
    pub fn has_mfma(&self) -> bool {
        arch::has_mfma(&self.ctx.arch)
    }

    /// The backend's own stream (every forward of [`Backend::forward`] runs on it).
    pub fn stream(&self) -> sys::hipStream_t {
        self.ctx.stream.raw()
    }

    /// Before each forward, fill the output and every intermediate with NaN so that any element
    /// a kernel fails to write shows up in a check. Off by default (it costs a pass over the
    /// buffers); the GPU tests turn it on.
    pub fn set_poison(&self, on: bool) {
        self.ctx.poison.store(on, Ordering::Relaxed);
    }

    /// Chooses the MFMA kernels (the fused input and output stages) of layers prepared from now
    /// on: `Some(true)` both where the arch and the shape allow them, unvalidated; `Some(false)`
    /// neither (the portable stages); `None` the default (`TRIMUL_HIP_MFMA`, else each where this
    /// device's verdict says it passed validation and won: [`HipBackend::verdict`]).
    pub fn set_mfma_kernels(&self, choice: Option<bool>) {
        if let Ok(mut slot) = self.ctx.mfma_setting.lock() {
            *slot = choice;
        }
    }

    /// The `TRIMUL_HIP_MFMA`-style setting in force: the override, else the environment.
    fn mfma_setting(&self) -> Option<String> {
        match self.ctx.mfma_setting.lock().ok().and_then(|s| *s) {
            Some(true) => Some("1".into()),
            Some(false) => Some("0".into()),
            None => env_flag(kernels::MFMA_ENV),
        }
    }

    /// HIP's current device is per thread; every entry point makes ours current first.
    fn bind(&self) -> Result<()> {
        result::set_device(self.ctx.api, self.ctx.ordinal)
    }

    fn alloc_mem(&self, bytes: usize) -> Result<DeviceMem> {
        DeviceMem::alloc(self.ctx.api, &self.ctx.tracker, bytes)
    }

    fn upload_f32(&self, v: &[f32]) -> Result<DeviceMem> {
        self.upload_plain(v)
    }

    /// A new allocation holding `v` (f32 values or 16-bit words) as it is.
    fn upload_plain<T: result::Plain>(&self, v: &[T]) -> Result<DeviceMem> {
        let mem = self.alloc_mem(std::mem::size_of_val(v))?;
        mem.upload(&self.ctx.stream, 0, v)?;
        Ok(mem)
    }

    fn mfma_kernel(&self) -> Result<Arc<Kernel>> {
        self.lazy_kernel(&self.ctx.mfma, kernels::OUTPUT_PROJECTION)
    }

    fn mfma_input_kernel(&self) -> Result<Arc<Kernel>> {
        self.lazy_kernel(&self.ctx.mfma_input, kernels::INPUT_PROJECTION)
    }

    /// A stage loaded on first use and kept in `slot`.
    fn lazy_kernel(&self, slot: &Mutex<Option<Arc<Kernel>>>, stage: &'static str) -> Result<Arc<Kernel>> {
        let mut slot = slot.lock().map_err(poisoned)?;
        if let Some(k) = slot.as_ref() {
            return Ok(k.clone());
        }
        let (k, _) = load_stage(self.ctx.api, &self.ctx.target_id, stage, self.ctx.force_rtc)?;
        let k = Arc::new(k);
        *slot = Some(k.clone());
        Ok(k)
    }

    /// The MFMA kernels `stages` asks for, loaded: (output, input).
    fn stage_kernels(&self, stages: Stages) -> Result<StageKernels> {
        let mfma = match stages.output {
            HipKernelOutput::Mfma => Some(self.mfma_kernel()?),
            HipKernelOutput::Blas => None,
        };
        let input = if stages.fused_input { Some(self.mfma_input_kernel()?) } else { None };
        Ok((mfma, input))
    }

    /// [`Backend::prepare`] with the stages given (the validation prepares both ways).
    fn prepare_as(&self, w: &Weights, stages: Stages) -> Result<HipPrepared> {
        w.validate()?;
        self.bind()?;
        let (mfma, input) = self.stage_kernels(stages)?;
        Ok(HipPrepared {
            config: w.config(),
            id: super::next_weights_id(),
            tensors: PreparedTensors::upload(w, |h| self.upload_plain(h), |v| self.upload_plain(v))?,
            output: stages.output,
            mfma,
            input,
        })
    }

    /// af3's vector of ones for the output-bias update of `rows` positions.
    fn ones(&self, bytes: usize, rows: usize) -> Result<Option<DeviceMem>> {
        if bytes == 0 {
            return Ok(None);
        }
        let mem = self.alloc_mem(bytes)?;
        mem.upload(&self.ctx.stream, 0, &vec![1.0f32; rows])?;
        Ok(Some(mem))
    }

    fn one_pass_buffers(&self, plan: Plan) -> Result<OnePass> {
        let projection = if plan.projection_bytes > 0 { Some(self.alloc_mem(plan.projection_bytes)?) } else { None };
        Ok(OnePass {
            left: self.alloc_mem(plan.left_bytes)?,
            right: self.alloc_mem(plan.left_bytes)?,
            gate: self.alloc_mem(plan.gate_bytes)?,
            t: self.alloc_mem(plan.t_bytes)?,
            projection,
            ones: self.ones(plan.ones_bytes, plan.rows)?,
            plan,
        })
    }

    /// The buffers of a chunked plan: the stage kernels' plans also get their per-pass weight
    /// copies ([`HipBackend::pass_weights`]); the fused kernel's read the prepared weights.
    fn chunked_buffers(&self, prepared: &HipPrepared, plan: Plan) -> Result<Chunked> {
        let pass_w =
            if plan.caps.input == InputStage::Staged { Some(self.pass_weights(prepared, &plan)?) } else { None };
        Ok(Chunked {
            t: self.alloc_mem(plan.t_bytes)?,
            scratch: self.alloc_mem(plan.scratch_bytes)?,
            pass_w,
            ones: self.ones(plan.ones_bytes, plan.output_rows)?,
            plan,
        })
    }

    /// Every pass's rows of the gated projections (and their biases) copied from the prepared
    /// weights into one `[lp; lg; rp; rg]` block per pass, so a pass's projection is one GEMM and
    /// `input_gating` sees the layout it expects with H = hc.
    fn pass_weights(&self, prepared: &HipPrepared, plan: &Plan) -> Result<DeviceMem> {
        let pass_w = self.alloc_mem(plan.pass_weights_bytes)?;
        let c = plan.c;
        let stream = self.stream();
        let bias = prepared.tensors.proj_bias.as_ref();
        for (dst, src, rows) in plan.pass_row_copies() {
            let (dst, src, row) = (dst as u64, src as u64, (c * 2) as u64);
            // SAFETY: both ranges lie inside their allocations: the prepared [P, C] f16 weights
            // hold rows src .. src + rows, pass_w holds 4H rows of C halves and then 4H f32 biases
            // at pass_bias_offset; the copies are waited for below.
            unsafe {
                result::copy_dtod_async(
                    self.ctx.api,
                    pass_w.addr() + dst * row,
                    prepared.tensors.w_in.addr() + src * row,
                    rows * c * 2,
                    stream,
                )?;
                if let Some(b) = bias {
                    let off = pass_w.addr() + plan.pass_bias_offset as u64;
                    result::copy_dtod_async(self.ctx.api, off + dst * 4, b.addr() + src * 4, rows * 4, stream)?;
                }
            }
        }
        // Forwards may run on a caller's stream: the copies must be done before this returns.
        self.ctx.stream.synchronize()?;
        Ok(pass_w)
    }

    /// Blocks of a `prepare_weights` launch over `elements` elements: a grid stride of two
    /// blocks per compute unit at most.
    fn prepare_grid(&self, elements: u64) -> u32 {
        elements.div_ceil(u64::from(PREP_THREADS)).clamp(1, 2 * u64::from(self.ctx.info.compute_units.max(1))) as u32
    }

    /// See [`Backend::prepare_device`]: the buffers of [`HipPrepared`] as views into `storage`,
    /// laid out by [`PreparedLayout`] (no fused-kernel layout on HIP) and filled by one
    /// `prepare_weights` launch on `stream`.
    ///
    /// # Safety
    /// As [`Backend::prepare_device`].
    unsafe fn prepare_on_device(
        &self,
        w: &DeviceWeights,
        storage: DeviceSpan,
        stream: sys::hipStream_t,
    ) -> Result<HipPrepared> {
        w.validate()?;
        self.bind()?;
        let config = w.config;
        let input_bias = w.input_linears().iter().any(|l| l.bias.is_some());
        let layout = PreparedLayout::new(&config, None, input_bias, w.out_proj.bias.is_some());
        storage.check("the prepared-weight storage", layout.bytes)?;
        let kp = prepare_params(w, &layout, storage.ptr, self.prepare_grid(layout.bytes / 2))?;
        // SAFETY: every source is a weight tensor of the length `validate` checked, alive until the
        // stream runs the launch, and every destination lies inside `storage` (checked above): this
        // function's contract.
        unsafe { launch_prepare(&self.ctx.kernels.prepare_weights, stream, &kp)? };
        // No validation here: this may run inside a graph capture. A verdict that exists is used.
        let stages = self.stages_for(&config, false)?;
        let (mfma, input) = self.stage_kernels(stages)?;
        let view = |off: u64, bytes: usize| DeviceMem::borrowed(self.ctx.api, &self.ctx.tracker, off, bytes);
        Ok(HipPrepared {
            config,
            id: super::next_weights_id(),
            tensors: PreparedTensors::views(w, &layout, storage.ptr, |at, n| view(at, 2 * n), |at, n| view(at, 4 * n)),
            output: stages.output,
            mfma,
            input,
        })
    }

    /// A one-pass workspace whose buffers are views into caller memory, laid out from address 0
    /// until [`HipWorkspace::bind`] moves them to a call's span, and the bytes that span needs.
    fn plan_caller_workspace(
        &self,
        prepared: &HipPrepared,
        problem: &Problem,
        limit: Option<u64>,
    ) -> Result<(HipWorkspace, u64)> {
        check_prepared_for(&prepared.config, problem)?;
        let plan = Plan::one_pass(problem, ROCM_CAPS, false)?;
        let mut span = SpanCarver::default();
        let mut carve = |bytes: usize| {
            span.carve(bytes as u64, |at| DeviceMem::borrowed(self.ctx.api, &self.ctx.tracker, at, bytes))
        };
        let projection = (plan.projection_bytes > 0).then(|| carve(plan.projection_bytes));
        let one = OnePass {
            left: carve(plan.left_bytes),
            right: carve(plan.left_bytes),
            gate: carve(plan.gate_bytes),
            t: carve(plan.t_bytes),
            projection,
            ones: (plan.ones_bytes > 0).then(|| carve(plan.ones_bytes)),
            plan,
        };
        let end = span.workspace_within(BackendKind::Hip, problem, limit)?;
        let ws = HipWorkspace {
            problem: *problem,
            layout: Layout::OnePass(one),
            weights_of: None,
            caller_base: Some((0, end)),
        };
        Ok((ws, end))
    }

    /// Enqueues one forward (module docs) on `stream`.
    ///
    /// # Safety
    /// `x` and `y` must be device allocations of this backend's device of `B·N·N·C` elements of
    /// `problem.io` (f32, or 16-bit where the layer's output path writes it), `mask`
    /// (unless 0) of `B·N·N` f32, not aliasing each other or the workspace, alive until `stream`
    /// has run the work; `stream` must be a live stream of this device.
    #[allow(clippy::too_many_arguments)]
    unsafe fn enqueue(
        &self,
        prep: &HipPrepared,
        ws: &HipWorkspace,
        problem: &Problem,
        x: u64,
        mask: u64,
        y: u64,
        stream: sys::hipStream_t,
    ) -> Result<()> {
        // In place, x is read only by stage 1 and y written only by stage 3, so one buffer serves;
        // the stage kernels use 16-byte vector loads and stores (common/compat.h's tm_f4, tm_u128).
        check_device_forward(&prep.config, problem, x, mask, y)?;
        check_same_weights(ws.weights_of, prep.id)?;
        if !self.workspace_fits(ws, problem) {
            return Err(Error::InvalidArgument("workspace was made for another problem shape".into()));
        }
        self.bind()?;
        // The stages, with rocBLAS bound to the call's stream.
        let stages = |blas: &BlasHandle| -> Result<()> {
            let Config { c, .. } = problem.config;
            let m = problem.shape.rows();
            let api = self.ctx.api;
            let poison = self.ctx.poison.load(Ordering::Relaxed);
            let base = CommonParams::new(problem, Addresses { x, mask, y, ..prep.tensors.addresses() })?;
            if problem.io != Precision::F32Io && prep.output != HipKernelOutput::Mfma {
                // input_norm reads 16-bit x, but the rocBLAS output GEMM writes f32 y.
                return Err(Error::Dtype(format!(
                    "{} x and y on HIP need the MFMA output kernel; this layer's output stage runs on rocBLAS (f32 y): \
                     convert x to f32",
                    problem.io
                )));
            }
            if poison && !problem.in_place {
                // SAFETY: y holds M·C elements of the I/O type per the contract.
                unsafe { result::memset_async(api, y, POISON_BYTE, m * c * problem.io.io_bytes(), stream)? };
            }
            let e = Enqueue { blas, prep, problem, base: &base, poison, stream };
            // SAFETY: forwarded from this function's contract; the layouts' buffers are sized by
            // their plans for this problem.
            unsafe {
                match &ws.layout {
                    Layout::OnePass(o) => self.enqueue_one_pass(&e, o),
                    Layout::Chunked(ch) => self.enqueue_chunked(&e, ch),
                }
            }
        };
        // SAFETY: forwarded from this function's contract (the stream is live for the work).
        unsafe { self.with_blas_on(stream, stages) }
    }

    /// Runs `f` with the rocBLAS handle bound to `stream` (a caller's, or our own), and binds it
    /// back to our own stream afterwards, also when `f` failed, before the lock is released: later
    /// calls never use a caller's stream. `f`'s error comes first, then the rebinding's.
    ///
    /// # Safety
    /// `stream` is a live stream of this device until the work `f` enqueues on it has run.
    unsafe fn with_blas_on<R>(&self, stream: sys::hipStream_t, f: impl FnOnce(&BlasHandle) -> Result<R>) -> Result<R> {
        let blas = self.ctx.blas.lock().map_err(poisoned)?;
        let own = self.ctx.stream.raw();
        if stream != own {
            // SAFETY: this function's contract; the handle goes back to our stream below.
            unsafe { blas.set_stream(stream)? };
        }
        let run = f(&blas);
        let restored = if stream != own {
            // SAFETY: our own stream lives as long as the context that owns the handle.
            unsafe { blas.set_stream(own) }
        } else {
            Ok(())
        };
        let out = run?;
        restored?;
        Ok(out)
    }

    /// The fastest plan: the projection chunk by chunk into left, right and the gate for every
    /// position, one contraction, one output stage.
    ///
    /// # Safety
    /// As for [`HipBackend::enqueue`], with `e.blas` bound to `e.stream` and `ws` planned for
    /// `e.problem`.
    unsafe fn enqueue_one_pass(&self, e: &Enqueue<'_>, ws: &OnePass) -> Result<()> {
        let Enqueue { blas, prep, problem, base, poison, stream } = *e;
        let plan = &ws.plan;
        let (c, h) = (plan.c, plan.h);
        let k = &self.ctx.kernels;
        let t_or_own = ws.projection.as_ref().unwrap_or(&ws.t);
        if poison {
            for buf in [&ws.left, &ws.right, &ws.gate, &ws.t].into_iter().chain(ws.projection.as_ref()) {
                // SAFETY: a workspace allocation of this device; `stream` per the contract.
                unsafe { buf.memset(stream, POISON_BYTE)? };
            }
        }
        let (z, proj) = (Plan::require(plan.z, "z")?, Plan::require(plan.proj, "proj")?);
        let base_of = |b: Buffer| match b {
            Buffer::T | Buffer::Projection => t_or_own.addr(),
            _ => 0,
        };
        if z.buffer != if ws.projection.is_some() { Buffer::Projection } else { Buffer::T } {
            return Err(Error::Internal("the projection's z is not where the workspace put it".into()));
        }
        let tr = launch_params::gating_tile_rows(h);
        let input = InputParams {
            common: *base,
            z: Plan::address(z, base_of),
            proj: Plan::address(proj, base_of),
            proj_bias: prep.tensors.proj_bias_address(),
            left: ws.left.addr(),
            right: ws.right.addr(),
            gate: ws.gate.addr(),
            proj_h: to_i32(h, "H")?,
            proj_g: to_i32(plan.g, "G")?,
            tile_rows: to_i32(tr, "positions per block")?,
            ..InputParams::default()
        };

        // SAFETY (all launches and GEMMs below): every address in `input` and the output stage's
        // is a prepared-weight or workspace allocation sized by `ws.plan` for this problem, or x,
        // mask and y from this function's contract; `stream` is live and `blas` is bound to it.

        // 1. LN_C, projection, gating: one fused MFMA kernel over every position, or chunk by
        // chunk (z and proj inside t or their own buffer).
        if let Some(kernel) = prep.input.as_ref() {
            let p = InputParams { common: base.with_input_weights(prep.tensors.w_in.addr())?, ..input };
            let grid = problem.shape.rows().div_ceil(kernels::INPUT_PROJECTION_ROWS);
            // SAFETY: the invariant stated at the top of this section holds for these addresses;
            // w_in is the prepared [4H + G, C] f16 block the kernel reads (C % 4 == 0 and the LDS
            // size were checked when the layer chose the kernel: `kernels::input_rule`).
            unsafe { launch(kernel, stream, grid, kernels::input_projection_smem_bytes(c), &p)? };
        } else {
            for (row0, rows) in plan.input_chunks() {
                let p = InputParams { common: base.over(row0, rows)?, ..input };
                let g = RocblasGemm::from_spec(&GemmSpec::projection(rows, c, plan.p), DataType::F16, DataType::F16)?;
                // SAFETY: the invariant stated at the top of this section holds for these addresses.
                unsafe {
                    launch(
                        &self.ctx.kernels.input_norm,
                        stream,
                        rows.div_ceil(INPUT_NORM_ROWS_PER_BLOCK as usize),
                        0,
                        &p,
                    )?;
                    gemm(blas, &g, 1.0, prep.tensors.w_in.addr(), input.z, 0.0, input.proj)?;
                    launch(&k.input_gating, stream, rows.div_ceil(tr), launch_params::gating_smem_bytes(h, tr), &p)?;
                }
            }
        }

        // 2. Contraction: A = right, B = left, D = t, one N×N matrix per (b, h).
        let spec = GemmSpec::contraction(problem.direction, problem.shape.batch * h, problem.shape.n);
        let g = RocblasGemm::from_spec(&spec, DataType::F16, DataType::F16)?;
        // SAFETY: the invariant stated at the top of this section holds for these addresses.
        unsafe { gemm(blas, &g, 1.0, ws.right.addr(), ws.left.addr(), 0.0, ws.t.addr())? };

        // 3. Output stage of every position.
        let output = OutputParams {
            common: *base,
            t: ws.t.addr(),
            a: ws.left.addr(),
            gate: ws.gate.addr(),
            buf_row0: 0,
            ..OutputParams::default()
        };
        // SAFETY: as above; `a` (= left) holds M·H halves and the gate every position.
        unsafe { self.enqueue_output(e, &output, ws.ones.as_ref()) }
    }

    /// A plan within a memory limit: the steps of [`staged_steps::steps`] with our launches and
    /// rocBLAS.
    ///
    /// # Safety
    /// As for [`HipBackend::enqueue_one_pass`].
    unsafe fn enqueue_chunked(&self, e: &Enqueue<'_>, ws: &Chunked) -> Result<()> {
        let Enqueue { blas, prep, problem, base, poison, stream } = *e;
        let k = &self.ctx.kernels;
        if poison {
            for buf in [&ws.t, &ws.scratch] {
                // SAFETY: a workspace allocation of this device; `stream` per the contract.
                unsafe { buf.memset(stream, POISON_BYTE)? };
            }
        }
        let pass_w = match (ws.plan.caps.input, ws.pass_w.as_ref()) {
            // SAFETY: forwarded from this function's contract.
            (InputStage::Fused, _) => return unsafe { self.enqueue_fused_chunked(e, ws) },
            (InputStage::Staged, Some(pass_w)) => pass_w,
            (InputStage::Staged, None) => {
                return Err(Error::Internal("a chunked plan of the stage kernels without its weight copies".into()))
            }
        };
        let bufs = StagedBuffers {
            scratch: ws.scratch.addr(),
            pass_w: pass_w.addr(),
            t: ws.t.addr(),
            w_in: prep.tensors.w_in.addr(),
            proj_bias: prep.tensors.proj_bias_address(),
        };
        // SAFETY (every launch and GEMM below): the steps' addresses lie inside the workspace's
        // buffers, the prepared weights and the call's x, mask and y, as the plan lays them out
        // (`staged_steps::tests::steps_stay_inside_their_buffers_and_cover_the_problem`); `blas` is
        // bound to `stream`.
        for step in staged_steps::steps(&ws.plan, problem, base, bufs)? {
            match step {
                StagedStep::Norm(p) => {
                    let grid = p.common.rows().div_ceil(INPUT_NORM_ROWS_PER_BLOCK as usize);
                    unsafe { launch(&k.input_norm, stream, grid, 0, &p)? };
                }
                StagedStep::Gemm { spec, a, b, d } => {
                    let g = RocblasGemm::from_spec(&spec, DataType::F16, DataType::F16)?;
                    unsafe { gemm(blas, &g, 1.0, a, b, 0.0, d)? };
                }
                StagedStep::Gating { params, tile_rows, smem } => {
                    let grid = params.common.rows().div_ceil(tile_rows);
                    unsafe { launch(&k.input_gating, stream, grid, smem, &params)? };
                }
                StagedStep::PassesDone => {}
                StagedStep::Output(chunk) => unsafe { self.enqueue_output(e, &chunk, ws.ones.as_ref())? },
            }
        }
        Ok(())
    }

    /// A chunked plan of the fused input kernel (`FUSED_CAPS`), as CUDA's: per hidden pass,
    /// `input_projection`'s work items of the pass's channels into left/right `[B, hn, N, N]`, then
    /// one contraction per batch into the pass's channels of t; then per row chunk its gate work
    /// items into the gate chunk, and the output stage. Each pass normalises x again (the kernel
    /// keeps z in LDS only).
    ///
    /// # Safety
    /// As for [`HipBackend::enqueue_one_pass`].
    unsafe fn enqueue_fused_chunked(&self, e: &Enqueue<'_>, ws: &Chunked) -> Result<()> {
        let Enqueue { blas, prep, problem, base, stream, .. } = *e;
        let kernel = prep.input.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "this workspace was planned for the fused MFMA input kernel, which this layer does not run".into(),
            )
        })?;
        let plan = &ws.plan;
        let (c, h) = (plan.c, plan.h);
        let (batch, n, m) = (problem.shape.batch, problem.shape.n, problem.shape.rows());
        let nn = n * n;
        let fused = base.with_input_weights(prep.tensors.w_in.addr())?;
        let proj_bias = prep.tensors.proj_bias_address();
        let (hidden_items, gate_items) = kernels::input_projection_items(h, plan.g);
        let tile = kernels::INPUT_PROJECTION_TILE;
        let smem = kernels::input_projection_smem_bytes(c);
        let blocks = |rows: usize| rows.div_ceil(kernels::INPUT_PROJECTION_ROWS);
        let base_of = |b: Buffer| match b {
            Buffer::Y => base.y(),
            Buffer::Scratch => ws.scratch.addr(),
            _ => 0,
        };
        let (left, right) = (Plan::address(plan.left, base_of), Plan::address(plan.right, base_of));

        // SAFETY (every launch and GEMM below): left, right, the gate and a lie inside y (out of
        // place) or the scratch as the plan lays them out for this problem
        // (`plan::tests::every_plan_keeps_its_regions_apart_and_covers_the_problem`), t holds every
        // channel of every position, w_in and its bias are the prepared `[4H + G, C]` block the
        // kernel reads (C and the LDS size checked by `kernels::input_rule`); x, mask and y per the
        // contract; `blas` is bound to `stream`.
        let every_row = fused.over(0, m)?;
        for (h0, hn) in plan.passes() {
            let p = InputParams {
                common: every_row,
                proj_bias,
                left,
                right,
                chunk_begin: to_i32(h0 / tile, "first work item of a pass")?,
                chunk_end: to_i32((h0 + hn).div_ceil(tile), "last work item of a pass")?,
                lr_h0: to_i32(h0, "first channel of a pass")?,
                lr_h: to_i32(hn, "channels of a pass")?,
                ..InputParams::default()
            };
            unsafe { launch(kernel, stream, blocks(m), smem, &p)? };
            // t's channels of a pass are contiguous within a batch only.
            let g =
                RocblasGemm::from_spec(&GemmSpec::contraction(problem.direction, hn, n), DataType::F16, DataType::F16)?;
            for b in 0..batch {
                let off = (b * hn * nn * 2) as u64;
                let t = ws.t.addr() + ((b * h + h0) * nn * 2) as u64;
                unsafe { gemm(blas, &g, 1.0, right + off, left + off, 0.0, t)? };
            }
        }
        let gate = Plan::address(Plan::require(plan.gate, "gate")?, base_of);
        let a = Plan::address(plan.a, base_of);
        for (r0, rows) in plan.output_chunks() {
            let buf_row0 = to_i64(r0, "first position of a chunk")?;
            let p = InputParams {
                common: fused.over(r0, rows)?,
                proj_bias,
                gate,
                buf_row0,
                chunk_begin: to_i32(hidden_items, "first gate work item")?,
                chunk_end: to_i32(hidden_items + gate_items, "last gate work item")?,
                ..InputParams::default()
            };
            let chunk = OutputParams {
                common: base.over(r0, rows)?,
                t: ws.t.addr(),
                a,
                gate,
                buf_row0,
                ..OutputParams::default()
            };
            unsafe {
                launch(kernel, stream, blocks(rows), smem, &p)?;
                self.enqueue_output(e, &chunk, ws.ones.as_ref())?;
            }
        }
        Ok(())
    }

    /// The output stage of `p`'s positions: the gate (and, on the rocBLAS path, the operand `a`)
    /// in buffers holding positions from `p.buf_row0`, t whole, y written at those rows.
    ///
    /// # Safety
    /// As for [`HipBackend::enqueue_one_pass`]; `p.gate` and `p.a` hold `p`'s positions, `ones`
    /// at least that many f32 ones.
    unsafe fn enqueue_output(&self, e: &Enqueue<'_>, p: &OutputParams, ones: Option<&DeviceMem>) -> Result<()> {
        let Enqueue { blas, prep, stream, .. } = *e;
        let k = &self.ctx.kernels;
        let (rows, c, h) = (p.common.rows(), p.common.c(), p.common.h());
        // f32 y: only the rocBLAS branch below uses this, and 16-bit I/O is refused there.
        let y = p.common.y() + (p.common.row0() as u64) * (c as u64) * 4;
        // SAFETY (every launch and GEMM below): the addresses satisfy this function's contract.
        match prep.output {
            HipKernelOutput::Mfma => {
                let kernel = prep.mfma.as_ref().ok_or_else(|| Error::NoKernels {
                    arch: self.ctx.arch.clone(),
                    reason: "MFMA output kernel selected but not loaded".into(),
                })?;
                // Wout and its bias are in `p.common` (CommonParams::new).
                let (grid, smem) =
                    (rows.div_ceil(kernels::OUTPUT_PROJECTION_ROWS), kernels::output_projection_smem_bytes(h));
                unsafe { launch(kernel, stream, grid, smem, p)? };
            }
            HipKernelOutput::Blas => {
                let tp = launch_params::output_norm_tile_rows(h);
                let np = OutputParams { tile_rows: to_i32(tp, "positions per block")?, ..*p };
                let g = RocblasGemm::from_spec(&GemmSpec::output(rows, c, h), DataType::F16, DataType::F32)?;
                unsafe {
                    launch(
                        &k.output_norm,
                        stream,
                        rows.div_ceil(tp),
                        launch_params::output_norm_smem_bytes(h, tp),
                        &np,
                    )?;
                    gemm(blas, &g, 1.0, prep.tensors.w_out.addr(), p.a, 0.0, y)?;
                }
                if let Some(bias) = &prep.tensors.out_bias {
                    let ones = ones.ok_or_else(|| {
                        Error::InvalidArgument("workspace has no ones vector for the af3 bias".into())
                    })?;
                    let g = RocblasGemm::from_spec(&bias_update_spec(rows, c), DataType::F32, DataType::F32)?;
                    unsafe { gemm(blas, &g, 1.0, bias.addr(), ones.addr(), 1.0, y)? };
                }
                if p.common.formulation() == Formulation::Af3 {
                    let grid = (rows * c).div_ceil(STAGE_THREADS as usize * 8).clamp(1, OUTPUT_GATE_MAX_GRID);
                    let gp = OutputParams { gate_blocks: to_i32(grid, "output_gate blocks")?, ..*p };
                    unsafe { launch(&k.output_gate, stream, grid, 0, &gp)? };
                }
            }
        }
        Ok(())
    }
}

/// Loads one stage for the device with target id `target_id`: its prebuilt code object when
/// this build has one for the arch and it loads, otherwise the embedded source compiled with
/// hipRTC. Returns the kernel and where it came from.
fn load_stage(
    api: &'static sys::HipApi,
    target_id: &str,
    stage: &'static str,
    force: bool,
) -> Result<(Kernel, String)> {
    if force {
        // Asked for run-time compilation: without hipRTC that is an error, not a silent fallback.
        sys::hiprtc()?;
    }
    // hipRTC is loaded only when it may be needed (it is a large library).
    let arch = arch::normalize_arch(target_id).unwrap_or_default();
    let prebuilt = kernels::HIP_STAGES
        .iter()
        .find(|s| s.name == stage)
        .is_some_and(|s| s.code_objects.iter().any(|(a, _)| *a == arch));
    let rtc = || sys::hiprtc().map(|_| ()).map_err(|e| e.to_string());
    let compile = |source: &str, options: &[String], arch: &str| -> Result<(Kernel, String)> {
        let rtc = sys::hiprtc()?;
        let code = result::rtc_compile(rtc, source, stage, options)?;
        Ok((Kernel::load(api, &code, stage)?, format!("{stage}: hipRTC {arch} ({})", rtc.path)))
    };
    let avail = if force || !prebuilt { rtc() } else { Err("not needed".to_string()) };
    match kernels::select(kernels::HIP_STAGES, stage, target_id, avail, force)? {
        KernelImage::Prebuilt { code, arch, .. } => match Kernel::load(api, code, stage) {
            Ok(k) => Ok((k, format!("{stage}: code object {arch}"))),
            // A runtime that rejects the object (e.g. a code-object version it predates) may still
            // compile the source; if it cannot, the load error is the one worth reporting.
            Err(load_err) => match kernels::select(kernels::HIP_STAGES, stage, target_id, rtc(), true) {
                Ok(KernelImage::Compile { source, options, arch, .. }) => compile(source, &options, &arch),
                _ => Err(load_err),
            },
        },
        KernelImage::Compile { source, options, arch, .. } => compile(source, &options, &arch),
    }
}

fn load_kernels(api: &'static sys::HipApi, target_id: &str, force_rtc: bool) -> Result<Kernels> {
    let mut origin = Vec::new();
    let mut get = |stage: &'static str| -> Result<Kernel> {
        let (k, o) = load_stage(api, target_id, stage, force_rtc)?;
        origin.push(o);
        Ok(k)
    };
    let k = Kernels {
        input_norm: get(kernels::INPUT_NORM)?,
        input_gating: get(kernels::INPUT_GATING)?,
        output_norm: get(kernels::OUTPUT_NORM)?,
        output_gate: get(kernels::OUTPUT_GATE)?,
        prepare_weights: get(kernels::PREPARE_WEIGHTS)?,
        origin: String::new(),
    };
    Ok(Kernels { origin: origin.join(", "), ..k })
}

/// The MFMA kernels a layer runs: the output stage's, the input stage's.
type StageKernels = (Option<Arc<Kernel>>, Option<Arc<Kernel>>);

impl HipBackend {
    /// The workspace of `prepared`'s narrowest chunked plan for `problem`, whatever the memory
    /// (the validation's chunked case).
    fn narrowest_workspace(&self, prepared: &HipPrepared, problem: &Problem) -> Result<HipWorkspace> {
        check_prepared_for(&prepared.config, problem)?;
        self.bind()?;
        let plan = Plan::narrowest(problem, chunked_caps(prepared))?;
        Ok(HipWorkspace::new(prepared, problem, Layout::Chunked(self.chunked_buffers(prepared, plan)?)))
    }
}

impl HipWorkspace {
    fn new(prepared: &HipPrepared, problem: &Problem, layout: Layout) -> HipWorkspace {
        // A workspace holding copies of the weights serves those weights alone.
        let weights_of = matches!(&layout, Layout::Chunked(ch) if ch.pass_w.is_some()).then_some(prepared.id);
        HipWorkspace { problem: *problem, layout, weights_of, caller_base: None }
    }

    /// Whether this is a one-pass workspace.
    fn is_one_pass(&self) -> bool {
        matches!(self.layout, Layout::OnePass(_))
    }

    /// Moves a caller-memory workspace's buffers into `span` (checked: aligned, large enough).
    fn bind(&mut self, span: DeviceSpan) -> Result<()> {
        let HipWorkspace { caller_base, layout, .. } = self;
        caller_workspace::bind(
            caller_base,
            span,
            move || match layout {
                Layout::OnePass(o) => Ok([&mut o.left, &mut o.right, &mut o.gate, &mut o.t]
                    .into_iter()
                    .chain(o.projection.as_mut())
                    .chain(o.ones.as_mut())),
                Layout::Chunked(_) => Err(caller_workspace::not_in_caller_memory()),
            },
            DeviceMem::rebase,
        )
    }
}

impl Backend for HipBackend {
    type Buffer = HipBuffer;
    type Prepared = HipPrepared;
    type Workspace = HipWorkspace;

    fn kind(&self) -> BackendKind {
        BackendKind::Hip
    }

    fn info(&self) -> DeviceInfo {
        let mut info = self.ctx.info.clone();
        info.versions.extend(self.verdict_lines());
        info
    }

    fn prepare(&self, w: &Weights) -> Result<HipPrepared> {
        w.validate()?;
        self.bind()?;
        // The MFMA kernels are validated here on first use for this C and H (`validate.rs`).
        let stages = self.stages_for(&w.config(), true)?;
        self.prepare_as(w, stages)
    }

    fn prepared_bytes(&self, p: &HipPrepared) -> u64 {
        p.tensors.bytes()
    }

    fn exec_plan(ws: &HipWorkspace) -> ExecPlan {
        match &ws.layout {
            Layout::OnePass(o) => o.plan.summary(),
            Layout::Chunked(c) => c.plan.summary(),
        }
    }

    fn host_io_staged(&self) -> bool {
        true
    }

    fn half_io_native(&self, prepared: &HipPrepared) -> bool {
        // input_norm reads x in every precision; of the output paths only the MFMA kernel writes
        // 16-bit y (the rocBLAS GEMM writes f32).
        prepared.output == HipKernelOutput::Mfma
    }

    fn workspace(&self, prepared: &HipPrepared, problem: &Problem, limit: Option<u64>) -> Result<HipWorkspace> {
        check_prepared_for(&prepared.config, problem)?;
        self.bind()?;
        let plan = Plan::one_pass(problem, ROCM_CAPS, false)?;
        let (b, n) = (problem.shape.batch, problem.shape.n);
        let what = format!("the workspace for B={b} N={n}");
        let (free, _) = result::mem_get_info(self.ctx.api)?;
        let cap = limit.unwrap_or(u64::MAX).min(free);
        let layout = if plan.workspace_bytes() <= cap {
            Layout::OnePass(self.one_pass_buffers(plan)?)
        } else {
            match Plan::widest_chunked(problem, chunked_caps(prepared), cap)? {
                Some(chunked) => Layout::Chunked(self.chunked_buffers(prepared, chunked)?),
                None => {
                    return Err(Error::OutOfMemory {
                        backend: BackendKind::Hip,
                        what: format!("{what} (narrowest chunked plan)"),
                        needed: Plan::narrowest(problem, chunked_caps(prepared))?.workspace_bytes(),
                        available: cap,
                    })
                }
            }
        };
        Ok(HipWorkspace::new(prepared, problem, layout))
    }

    fn workspace_fits(&self, ws: &HipWorkspace, problem: &Problem) -> bool {
        // The mask and the direction change only kernel arguments and transposes, not buffers;
        // in place moves a chunked plan's left/right out of y.
        ws.problem.config == problem.config
            && ws.problem.shape == problem.shape
            && ws.problem.in_place == problem.in_place
            && match &ws.layout {
                Layout::OnePass(o) => o.plan.serves(problem, ROCM_CAPS),
                // Left and right inside y need room for them in y's I/O precision: a plan made
                // for f32 y may not hold them in 16-bit y (the widened path runs the other way).
                Layout::Chunked(ch) => ch.plan.serves(problem, ch.plan.caps),
            }
    }

    fn workspace_bytes(&self, _prepared: &HipPrepared, problem: &Problem) -> u64 {
        if problem.validate().is_err() {
            return u64::MAX; // no plan for a problem Problem::new refuses
        }
        Plan::one_pass(problem, ROCM_CAPS, false).map_or(u64::MAX, |p| p.workspace_bytes())
    }

    fn min_workspace_bytes(&self, prepared: &HipPrepared, problem: &Problem) -> u64 {
        if problem.validate().is_err() {
            return u64::MAX;
        }
        let one_pass = self.workspace_bytes(prepared, problem);
        Plan::narrowest(problem, chunked_caps(prepared)).map_or(one_pass, |c| c.workspace_bytes().min(one_pass))
    }

    fn alloc(&self, len: usize) -> Result<HipBuffer> {
        self.bind()?;
        let bytes = len.checked_mul(4).ok_or_else(|| Error::Shape(format!("a buffer of {len} f32 overflows")))?;
        Ok(HipBuffer { mem: self.alloc_mem(bytes)?, len })
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

    unsafe fn upload_async(&self, src: HostWords<'_>, dst: &mut HipBuffer) -> Result<()> {
        self.bind()?;
        // HIP's copies wait for themselves (`DeviceMem::upload`): nothing is left queued.
        match src {
            HostWords::F32(v) => dst.mem.upload(&self.ctx.stream, 0, v),
            HostWords::Half(v) => dst.mem.upload(&self.ctx.stream, 0, v),
        }
    }

    fn download_words(&self, src: &HipBuffer, dst: HostWordsMut<'_>) -> Result<()> {
        self.bind()?;
        match dst {
            HostWordsMut::F32(v) => src.mem.download(&self.ctx.stream, 0, v),
            HostWordsMut::Half(v) => src.mem.download(&self.ctx.stream, 0, v),
        }
    }

    fn buffer_io<'a>(x: Option<&'a HipBuffer>, mask: Option<&'a HipBuffer>, y: &'a mut HipBuffer) -> ForwardIo<'a> {
        let arg = |b: &HipBuffer| (b.mem.addr(), b.len);
        // SAFETY: the buffers are this backend's allocations of the lengths given, borrowed for
        // 'a (y mutably, so it aliases neither x nor the mask); they are freed through hipFree,
        // which waits for the work enqueued on them.
        unsafe { ForwardIo::device_buffers(x.map(arg), mask.map(arg), arg(y), Precision::F32Io) }
    }

    fn forward(
        &self,
        prepared: &HipPrepared,
        workspace: &mut HipWorkspace,
        problem: &Problem,
        io: ForwardIo<'_>,
    ) -> Result<()> {
        let (d, span) = device_operands(&io, problem, BackendKind::Hip, workspace.caller_base.is_some())?;
        let stream = io.stream().map_or(self.stream(), |s| s as sys::hipStream_t);
        if let Some(span) = span {
            workspace.bind(span)?;
            // The ones vector of af3's bias update lives in the caller's memory too: written on
            // the call's stream before the stages read it.
            if let Layout::OnePass(OnePass { ones: Some(ones), plan, .. }) = &workspace.layout {
                self.bind()?;
                let kp = fill_params(ones.addr(), plan.rows, 1.0, self.prepare_grid(plan.rows as u64));
                // SAFETY: `ones` lies in the span just bound (the I/O's contract keeps it alive
                // and unshared) and holds `rows` f32 values.
                unsafe { launch_prepare(&self.ctx.kernels.prepare_weights, stream, &kp)? };
            }
        }
        // SAFETY: `d` and the span carry the contract of the I/O's constructor (see
        // `device_operands`); the workspace's buffers are its own or views into that span.
        unsafe { self.enqueue(prepared, workspace, problem, d.x(), d.mask(), d.y(), stream) }
    }

    fn backward(&self, prepared: &HipPrepared, problem: &Problem, io: BackwardIo<'_>) -> Result<Gradients> {
        check_prepared_for(&prepared.config, problem)?;
        let BackwardIo { x, mask, dy } = io;
        super::check_backward_io(problem, x.len(), mask.map(<[f32]>::len), dy.len(), None)?;
        self.check_backward_fits(problem)?;
        self.bind()?;
        let up = |v: &[f32]| -> Result<HipBuffer> { Ok(HipBuffer { mem: self.upload_f32(v)?, len: v.len() }) };
        let (xd, dyd) = (up(x)?, up(dy)?);
        let maskd = mask.map(up).transpose()?;
        let mut dx = self.alloc(x.len())?;
        let mut g = self.backward_buffers(prepared, problem, &xd, maskd.as_ref(), &dyd, &mut dx)?;
        g.x = vec![0f32; x.len()];
        self.download(&dx, &mut g.x)?;
        Ok(g)
    }

    fn backward_buffers(
        &self,
        prepared: &HipPrepared,
        problem: &Problem,
        x: &HipBuffer,
        mask: Option<&HipBuffer>,
        dy: &HipBuffer,
        dx: &mut HipBuffer,
    ) -> Result<Gradients> {
        // The buffers are f32 whatever precision the problem names.
        let problem = &problem.with_io(Precision::F32Io);
        check_prepared_for(&prepared.config, problem)?;
        super::check_backward_io(problem, x.len, mask.map(|m| m.len), dy.len, Some(dx.len))?;
        let io = (x.mem.addr(), mask.map_or(0, |m| m.mem.addr()), dy.mem.addr(), dx.mem.addr());
        // SAFETY: the buffers are this backend's allocations of the lengths checked above,
        // borrowed until this call returns, which waits for the work; `dx` is borrowed mutably,
        // so it aliases none of the others. The backend's own stream: its buffers were written
        // there.
        unsafe { self.backward_device(prepared, problem, io, self.stream() as u64, None) }
    }

    unsafe fn backward_device(
        &self,
        prepared: &HipPrepared,
        problem: &Problem,
        (x, mask, dy, dx): (u64, u64, u64, u64),
        stream: u64,
        workspace: Option<DeviceSpan>,
    ) -> Result<Gradients> {
        super::check_device_backward(&prepared.config, problem, (x, mask, dy, dx))?;
        problem.validate()?;
        self.check_backward_fits(problem)?;
        self.bind()?;
        // SAFETY: forwarded from this method's contract; 0 is the null stream, as in a forward on
        // caller memory.
        unsafe { self.backward_on_device(prepared, problem, (x, mask, dy, dx), stream as sys::hipStream_t, workspace) }
    }

    unsafe fn backward_device_async(
        &self,
        prepared: &HipPrepared,
        problem: &Problem,
        io: BackwardDeviceIo,
    ) -> Result<()> {
        super::check_device_backward(&prepared.config, problem, io.tensors)?;
        problem.validate()?;
        self.check_backward_fits(problem)?;
        self.bind()?;
        // SAFETY: forwarded from this method's contract.
        unsafe { self.backward_on_device_async(prepared, problem, io) }
    }

    fn backward_workspace_bytes(&self, prepared: &HipPrepared, problem: &Problem) -> Result<u64> {
        check_prepared_for(&prepared.config, problem)?;
        self.backward_span_bytes(problem)
    }

    fn free_backward_buffers(&self) {
        self.drop_backward_buffers();
    }

    fn buffer_addr(buffer: &HipBuffer) -> Option<u64> {
        Some(buffer.mem.addr())
    }

    fn stream_handle(&self) -> u64 {
        self.stream() as u64
    }

    fn prepared_device_bytes(&self, config: &Config, biases: bool) -> Result<u64> {
        config.validate()?;
        Ok(PreparedLayout::new(config, None, biases, biases).bytes)
    }

    unsafe fn prepare_device(&self, weights: &DeviceWeights, storage: DeviceSpan, stream: u64) -> Result<HipPrepared> {
        // SAFETY: forwarded from this method's contract.
        unsafe { self.prepare_on_device(weights, storage, stream as sys::hipStream_t) }
    }

    fn caller_workspace(
        &self,
        prepared: &HipPrepared,
        problem: &Problem,
        limit: Option<u64>,
    ) -> Result<(HipWorkspace, u64)> {
        self.plan_caller_workspace(prepared, problem, limit)
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

    fn measure_ceilings(&self) -> Result<Ceilings> {
        self.bind()?;
        let stream = self.stream();
        let n = gpu_ceilings::GEMM_N;
        let host = gpu_ceilings::gemm_operand();
        let a = self.alloc_mem(2 * n * n)?;
        a.upload(&self.ctx.stream, 0, &host)?;
        let b = self.alloc_mem(2 * n * n)?;
        b.upload(&self.ctx.stream, 0, &host)?;
        let d = self.alloc_mem(2 * n * n)?;
        let g = RocblasGemm::from_spec(&GemmSpec::projection(n, n, n), DataType::F16, DataType::F16)?;
        let blas = self.ctx.blas.lock().map_err(poisoned)?;
        // SAFETY: a, b, d are n×n f16 allocations alive until the synchronising timer returns;
        // the handle is bound to our stream.
        let run = || unsafe { gemm(&blas, &g, 1.0, a.addr(), b.addr(), 0.0, d.addr()) };
        let gemm_ms = gpu_ceilings::mean_ms(self, run)?;
        drop(blas);
        drop((a, b, d));
        let len = gpu_ceilings::COPY_BYTES;
        let src = self.alloc_mem(len)?;
        // SAFETY: our allocation, our stream.
        unsafe { src.memset(stream, 0x3C)? };
        let dst = self.alloc_mem(len)?;
        // SAFETY: two distinct `len`-byte allocations of this device, alive until the timed work
        // has finished (elapsed_ms waits for it).
        let copy = || unsafe { result::copy_dtod_async(self.ctx.api, dst.addr(), src.addr(), len, stream) };
        let copy_ms = gpu_ceilings::mean_ms(self, copy)?;
        Ok(gpu_ceilings::ceilings("rocBLAS gemm_ex", gemm_ms, copy_ms))
    }

    fn elapsed_ms(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        self.bind()?;
        let timer = Timer::new(self.ctx.api)?;
        timer.start(&self.ctx.stream)?;
        work()?;
        timer.stop(&self.ctx.stream)?;
        timer.elapsed_ms()
    }

    fn peak_memory(&self) -> Option<u64> {
        Some(self.ctx.tracker.peak())
    }

    fn reset_peak_memory(&self) {
        self.ctx.tracker.reset_peak();
    }
}

// ----------------------------------------------------------------------- launches and GEMMs
//
// Every device address these helpers pass comes from a `DeviceMem` of a prepared layer, a
// workspace that `workspace_fits` the problem (its `Plan` serves it: `Plan::serves`), or a
// caller buffer whose length `ForwardIo::check` checked (or whose size the caller of the unsafe
// `ForwardIo::device` guarantees); the kernels and GEMMs touch only the index ranges those sizes
// cover (layouts in common/params.h, spans in `RocblasGemm`). The buffers outlive the work:
// forward callers hold them until they synchronise, and dropping a `DeviceMem` frees it with
// hipFree, which waits for the device.

/// Launches a stage (`kernel(TmInputParams)` or `kernel(TmOutputParams)`) with `STAGE_THREADS`
/// threads per block.
///
/// # Safety
/// `P` is the struct the stage declares; the addresses in `params` satisfy the invariant above;
/// `stream` is live.
unsafe fn launch<P: StageParams>(
    kernel: &Kernel,
    stream: sys::hipStream_t,
    grid: usize,
    smem: usize,
    params: &P,
) -> Result<()> {
    // SAFETY: `P` is the stage's parameter struct (this function's contract); the addresses in it
    // satisfy the invariant stated above this section.
    unsafe { launch_by_value(kernel, stream, grid, STAGE_THREADS, smem, params) }
}

/// Launches `prepare_weights(TmPrepareParams)` over `p.grid` blocks.
///
/// # Safety
/// Every source and destination in `p` is device memory of this device with the element counts
/// its segments say, alive until `stream` has run the launch; `stream` is live.
unsafe fn launch_prepare(kernel: &Kernel, stream: sys::hipStream_t, p: &PrepareParams) -> Result<()> {
    let mut p = *p;
    let grid = p.grid.max(1) as u32;
    let mut args = [(&mut p as *mut PrepareParams).cast::<c_void>()];
    // SAFETY: one argument, a TmPrepareParams by value (mirrored by PrepareParams), as the kernel
    // is declared; the addresses in it are this function's contract.
    unsafe { kernel.launch(stream, grid, PREP_THREADS, 0, &mut args) }
}

/// One rocBLAS call on the stream `blas` is bound to; `c` aliases `d`.
///
/// # Safety
/// `a`, `b` and `d` span at least what `g` says (invariant above); `blas`'s stream is live.
unsafe fn gemm(blas: &BlasHandle, g: &RocblasGemm, alpha: f32, a: u64, b: u64, beta: f32, d: u64) -> Result<()> {
    // SAFETY: `g` was built from the GemmSpec of this problem, whose spans fit the buffers behind
    // a, b and d (invariant above this section).
    unsafe { blas.gemm(g, alpha, a, b, beta, d) }
}
