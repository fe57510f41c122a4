//! CUDA backend: cuBLASLt for the contraction, our kernels for the stages around it.
//!
//! One forward over `M = B·N²` positions (the math is in [`crate::reference`]):
//! 1. input: z = LN_C(x), the projections z·Wᵀ (W fused once at prepare time), σ, mask and the
//!    products → left/right in the contraction layout `[B, H, N, N]` f16, and the output gate
//!    σ(og) `[M, G]` f16. Where it applies (sm_80+, C ≤ 512) one fused kernel does all of it,
//!    reading x once (`cuda/input_projection.cu`; on an H100 at C = H = 128 its warp-specialised
//!    build); elsewhere `input_norm`, a cuBLASLt GEMM per chunk of positions and `input_gating`.
//! 2. contraction: one strided-batched cuBLASLt GEMM over the `B·H` matrices, t `[B, H, N, N]` f16.
//! 3. output: LN_H(t) (⊙ gate for gpumode), the projection by Wout (+ bias), af3's ⊙ gate. Where it
//!    applies one fused kernel (`cuda/output_projection.cu`: plain, resident, or for af3 with
//!    16-bit x on an H100 the form that makes the gate from x, [`OutputGate`]); elsewhere
//!    `output_norm`, a cuBLASLt GEMM and `output_gate`.
//!
//! Files: this one holds the backend's construction (device, libraries, kernels, settings),
//! workspace planning and the [`Backend`] implementation; `context.rs` the device
//! state the other parts read ([`CudaBackend`], [`OutputGate`]); `workspace.rs` the prepared
//! weights, the workspaces and the fused kernels' builds and shared-memory sizes; `forward.rs` the
//! one-pass plan's launches and the kernel choices; `chunked.rs` the plans that keep a forward
//! within a memory budget (hidden passes, row chunks, in place); `blas.rs` the cuBLASLt plans;
//! `kernels.rs` the kernel modules; `launch_graph.rs` a one-pass forward's launches recorded and
//! replayed as one CUDA graph; `driver.rs` the driver calls (libraries, events, allocations);
//! `tuning.rs` the per-shape tuning table.
//!
//! Device memory in the one-pass plan: left, right, the gate (unless made from x) and t, each
//! `M × (H or G)` halves, plus the caller's x and y. The portable path's chunk scratch lives
//! inside t, which is unused until the contraction; the GEMMs borrow their workspace from buffers
//! that are dead at that point (y before the output stage, right after the contraction). Nothing
//! is allocated inside a forward and nothing waits on the host. Forwards on host slices are
//! staged above the backends (`src/staging.rs`), with the copies of [`Backend::upload_async`]
//! and [`Backend::download_words`].

mod backward;
mod blas;
mod chunked;
mod context;
mod driver;
mod forward;
mod kernels;
mod launch_graph;
mod prepare;
mod shard;
mod tuning;
mod workspace;

pub use context::{CudaBackend, OutputGate};
use context::{Inner, MAX_GEMM_WORKSPACE};
pub use shard::ShardWorkspace;
pub(crate) use shard::{min_max_over_ranks, AGREE};
pub use tuning::{Tuning, TuningEntry, TuningTable};
use workspace::{BlasInput, FusedInput, Layout};
pub use workspace::{CudaPrepared, CudaWorkspace};

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys::{CUdevice_attribute, CUstream};
use cudarc::driver::CudaContext;

use self::blas::{BlasHandle, Elem, MatmulPlan};
pub use self::driver::DeviceBuffer;
pub(crate) use self::driver::EventPair;
use self::driver::{probe_libraries, AllocTracker, DriverResult, StreamHold, Timeline};
use self::kernels::Kernels;
use self::launch_graph::GraphCache;
use super::caller_workspace::{self, Rebase, SpanCarver};
use super::gemm::GemmSpec;
use super::gpu_ceilings;
use super::params::FusedInputLayout;
use super::prepared::{f16_words, PreparedTensors};
use super::{check_prepared_for, device_operands, Backend, Ceilings, DeviceInfo, MemoryInfo};
use crate::device_io::{BackwardDeviceIo, BackwardIo, DeviceSpan, DeviceWeights, ForwardIo, HostWords, HostWordsMut};
use crate::error::{BackendKind, Error, Result};
use crate::gradients::Gradients;
use crate::plan::{Blas, Capabilities, ExecPlan, InputStage, Plan};
use crate::problem::{Config, Precision, Problem};
use crate::weights::Weights;

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
            (
                "programmatic dependent launch".to_string(),
                if kernels.pdl { "on (sm_90; TRIMUL_CUDA_PDL=0 turns it off)" } else { "off" }.to_string(),
            ),
        ];
        // NCCL is needed only for forwards sharded across GPUs (`crate::sharded`).
        versions.push((
            "NCCL".to_string(),
            crate::collective::nccl_version().unwrap_or_else(|_| "not found (no sharded forwards across GPUs)".into()),
        ));
        if driver::nvrtc_present() {
            let (mut ma, mut mi) = (0, 0);
            // SAFETY: writes two ints; NVRTC was found loadable just above.
            let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut ma, &mut mi) };
            versions.push(("NVRTC".to_string(), format!("{ma}.{mi}")));
        }
        let smem_per_sm = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR) as usize;
        let mut info = DeviceInfo {
            vendor: "NVIDIA".into(),
            name: ctx.name().unwrap_or_else(|_| "unknown NVIDIA GPU".into()),
            arch: format!("sm_{}{}", cc.0, cc.1),
            compute_units: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) as u32,
            memory_bytes: ctx.total_mem().unwrap_or(0) as u64,
            versions,
        };
        // `TRIMUL_CUDA_TUNING=path` replaces the table shipped for this architecture.
        let (tuning, source) = match std::env::var_os("TRIMUL_CUDA_TUNING") {
            Some(path) => (TuningTable::from_file(std::path::Path::new(&path))?, path.to_string_lossy().into_owned()),
            None => (TuningTable::embedded(&info.arch)?, format!("embedded for {}", info.arch)),
        };
        let applying = tuning.entries_for(&info.arch, &info.name);
        info.versions.push(("tuning table".into(), format!("{applying} entries for this GPU ({source})")));
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
                warp_specialised: AtomicBool::new(std::env::var("TRIMUL_CUDA_WS").map_or(true, |v| v.trim() != "0")),
                register_operand_input: AtomicBool::new(
                    std::env::var("TRIMUL_CUDA_INPUT_RS").map_or(true, |v| v.trim() != "0"),
                ),
                fused_output: AtomicBool::new(true),
                // `TRIMUL_CUDA_WGMMA=0` starts with the mma.sync input kernel, to compare the two.
                warpgroup_mma: AtomicBool::new(std::env::var("TRIMUL_CUDA_WGMMA").map_or(true, |v| v.trim() != "0")),
                tuning,
                tuning_override: std::sync::Mutex::new(None),
                smem_per_sm,
                timeline: std::sync::Mutex::new(None),
                backward_block: std::sync::Mutex::new(None),
                backward_gemms: std::sync::Mutex::new(Default::default()),
                vector_gating: std::env::var("TRIMUL_CUDA_VECTOR_GATING").map_or(true, |v| v.trim() != "0"),
                resident_output: AtomicBool::new(
                    std::env::var("TRIMUL_CUDA_RESIDENT_OUTPUT").map_or(true, |v| v.trim() != "0"),
                ),
                resident_launches: std::sync::atomic::AtomicU64::new(0),
                ws_launches: std::sync::atomic::AtomicU64::new(0),
                rs_launches: std::sync::atomic::AtomicU64::new(0),
                output_gate: std::sync::atomic::AtomicU8::new(OutputGate::from_env() as u8),
                xgate_launches: std::sync::atomic::AtomicU64::new(0),
                launch_graphs: AtomicBool::new(std::env::var("TRIMUL_CUDA_GRAPHS").is_ok_and(|v| v.trim() == "1")),
                graph_launches: std::sync::atomic::AtomicU64::new(0),
            }),
        })
    }

    /// Makes this GPU's context current on the calling thread.
    pub(crate) fn bind_to_thread(&self) -> Result<()> {
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")
    }

    /// The CUDA device number this backend runs on.
    pub fn ordinal(&self) -> usize {
        self.inner.ctx.ordinal()
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

    /// Whether forwards from now on may take the warp-specialised persistent input build where
    /// it applies (sm_90a, C = H = 128; see `WsBuild::takes`). Default on, or off when the
    /// environment has `TRIMUL_CUDA_WS=0`; off, those launches take the two- and
    /// three-blocks-per-SM builds, to test and compare them.
    pub fn set_warp_specialised(&self, on: bool) {
        self.inner.warp_specialised.store(on, Ordering::Relaxed);
    }

    /// Whether the warp-specialised input build's launches with 16-bit x and no gate chunk take
    /// its register-operand form: one-pass forwards whose output stage makes af3's gate from x
    /// ([`OutputGate::FromX`], or [`OutputGate::Auto`] where memory is short), and the input
    /// launches of chunked plans and of the sharded forward that run every hidden channel in one
    /// pass and leave the gate to a pass of its own. That form (`input_projection_sm90_rs`) keeps
    /// z in registers as the MMAs' A operand and runs a chunk's MMAs under the previous chunk's
    /// epilogue. Default on, or off when the environment has `TRIMUL_CUDA_INPUT_RS=0`, to compare.
    /// Layers plan new workspaces on their next forward.
    pub fn set_register_operand_input(&self, on: bool) {
        self.inner.register_operand_input.store(on, Ordering::Relaxed);
    }

    /// The per-shape choices (see [`TuningTable`]) forwards of `problem` use: the override, else the
    /// table's entry, else the built-in rules.
    pub fn tuning_for(&self, problem: &Problem) -> Tuning {
        let forced = self.inner.tuning_override.lock().ok().and_then(|g| *g);
        let info = &self.inner.info;
        forced.or_else(|| self.inner.tuning.lookup(&info.arch, &info.name, problem)).unwrap_or_default()
    }

    /// Replaces the tuning table's choices for every shape (`None`: back to the table). Layers
    /// plan new workspaces on their next forward. `trimul tune` sweeps with this.
    pub fn set_tuning(&self, tuning: Option<Tuning>) {
        if let Ok(mut g) = self.inner.tuning_override.lock() {
            *g = tuning;
        }
    }

    /// The table of measured choices this backend applies.
    pub fn tuning_table(&self) -> &TuningTable {
        &self.inner.tuning
    }

    /// Whether forwards on an H100 (sm_90) run the fused input kernel's warpgroup-MMA build
    /// (default on, unless `TRIMUL_CUDA_WGMMA=0`). Off takes the mma.sync build that other GPUs
    /// run, to test and compare it on the same chip.
    pub fn set_warpgroup_mma(&self, on: bool) {
        self.inner.warpgroup_mma.store(on, Ordering::Relaxed);
    }

    /// Whether forwards use the fused output kernel (LN_H + gate + projection) where it takes
    /// the shape (default on). Off forces output_norm + the cuBLASLt GEMM, to test and compare.
    pub fn set_fused_output(&self, on: bool) {
        self.inner.fused_output.store(on, Ordering::Relaxed);
    }

    /// Whether forwards take the resident form of the fused output kernel where it applies
    /// (default on, unless `TRIMUL_CUDA_RESIDENT_OUTPUT=0`). Off runs the plain kernel there, to
    /// test and compare the two on the same chip.
    pub fn set_resident_output(&self, on: bool) {
        self.inner.resident_output.store(on, Ordering::Relaxed);
    }

    /// How many times this backend has launched the resident output kernel.
    pub fn resident_output_launches(&self) -> u64 {
        self.inner.resident_launches.load(Ordering::Relaxed)
    }

    /// Where one-pass forwards get af3's output gate where the kernel that makes it from x
    /// applies ([`OutputGate`]; default [`OutputGate::Auto`], or `TRIMUL_CUDA_OUTPUT_GATE=auto`,
    /// `stored` or `from-x`). Layers plan new workspaces on their next forward.
    pub fn set_output_gate(&self, mode: OutputGate) {
        self.inner.output_gate.store(mode as u8, Ordering::Relaxed);
    }

    /// The [`OutputGate`] mode forwards are planned with.
    pub fn output_gate(&self) -> OutputGate {
        OutputGate::from_u8(self.inner.output_gate.load(Ordering::Relaxed))
    }

    /// Whether one-pass forwards enqueue their launches as one CUDA graph (`launch_graph.rs`):
    /// the first call of a new shape of launches runs them as they are, the second captures
    /// them, and later ones replay the graph with each call's arguments, which takes a fraction
    /// of the host time. Off by default (`TRIMUL_CUDA_GRAPHS=1` starts with it on): capturing
    /// briefly forbids other threads from synchronising the device, which a program with threads
    /// that free device memory while forwards run may not want. The Python package turns it on.
    pub fn set_launch_graphs(&self, on: bool) {
        self.inner.launch_graphs.store(on, Ordering::Relaxed);
    }

    /// How many forwards this backend has enqueued as a launch of a launch graph (each capturing
    /// forward, which launches the graph it made, included).
    pub fn launch_graph_replays(&self) -> u64 {
        self.inner.graph_launches.load(Ordering::Relaxed)
    }

    /// How many times this backend has launched the output kernel that makes the gate from x.
    pub fn gate_from_x_launches(&self) -> u64 {
        self.inner.xgate_launches.load(Ordering::Relaxed)
    }

    /// The `set_*` kernel switches as bits, recorded in each workspace: a workspace planned under
    /// other switches is planned again rather than run with kernels it has no buffers for.
    fn switches(&self) -> u8 {
        let i = &self.inner;
        [
            &i.fused_input,
            &i.warp_specialised,
            &i.fused_output,
            &i.warpgroup_mma,
            &i.resident_output,
            &i.register_operand_input,
        ]
        .iter()
        .enumerate()
        .fold(0, |bits, (k, flag)| bits | (u8::from(flag.load(Ordering::Relaxed)) << k))
    }

    /// A workspace of `plan` for `problem` in this backend's own memory, made for no weights in
    /// particular and under the switches now set: its layout and t, and its contraction and
    /// output GEMM plans, each with the plan of a shorter last pass or row chunk where there is one.
    fn workspace_of(
        &self,
        problem: &Problem,
        plan: Plan,
        tuning: Tuning,
        (layout, t): (Layout, DeviceBuffer<u16>),
        (contraction, contraction_tail): (MatmulPlan, Option<MatmulPlan>),
        (output, output_tail): (MatmulPlan, Option<MatmulPlan>),
    ) -> CudaWorkspace {
        CudaWorkspace {
            problem: *problem,
            plan,
            layout,
            t,
            contraction,
            contraction_tail,
            output,
            output_tail,
            tuning,
            output_gate: self.output_gate(),
            weights_of: None,
            switches: self.switches(),
            caller_base: None,
            graphs: GraphCache::default(),
        }
    }

    /// How many times this backend has launched the warp-specialised input build.
    pub fn warp_specialised_launches(&self) -> u64 {
        self.inner.ws_launches.load(Ordering::Relaxed)
    }

    /// How many times this backend has launched the register-operand input build (counted also
    /// as warp-specialised launches: it takes theirs).
    pub fn register_operand_launches(&self) -> u64 {
        self.inner.rs_launches.load(Ordering::Relaxed)
    }

    /// Why this GPU cannot run `problem` with 16-bit x and y, if it cannot: only the fused
    /// kernels read and write bf16/f16.
    fn half_io_unsupported(&self, prepared: &CudaPrepared, problem: &Problem) -> Option<String> {
        if problem.io == Precision::F32Io {
            return None;
        }
        let cfg = &problem.config;
        let input = self.chunk_kernel(prepared, Tuning::default()).is_some();
        let output = self.fused_output_for(problem, Tuning::default()).is_some();
        (!input || !output).then(|| {
            format!(
                "{} x and y on CUDA need the fused kernels (sm_80 or newer, C a multiple of 8 up to 512, H a \
                 multiple of 16 up to 128); this layer has C={} H={} on {}",
                problem.io, cfg.c, cfg.h, self.inner.info.arch
            )
        })
    }

    /// The fused input kernel's weight layout for a layer of `config`, when that kernel takes the
    /// shape on this GPU (and is switched on): weights are then prepared in its order too.
    fn fused_layout(&self, config: &Config) -> Option<FusedInputLayout> {
        let layout = FusedInputLayout::new(config)?;
        (self.inner.kernels.input_projection.is_some()
            && self.inner.fused_input.load(Ordering::Relaxed)
            && FusedInput::smem_bytes_of(&layout) <= self.inner.kernels.max_smem)
            .then_some(layout)
    }

    fn upload_f32(&self, v: &[f32]) -> Result<DeviceBuffer<f32>> {
        let mut b = self.alloc_buffer::<f32>(v.len())?;
        b.upload(v, self.stream())?;
        Ok(b)
    }

    fn upload_f16(&self, words: &[u16]) -> Result<DeviceBuffer<u16>> {
        let mut b = self.alloc_buffer::<u16>(words.len())?;
        b.upload(words, self.stream())?;
        Ok(b)
    }
}

impl CudaBackend {
    /// Copies 16-bit values (bf16 or f16 bit patterns) into a device buffer of the same length;
    /// waits for the copy.
    pub fn upload_bits(&self, src: &[u16], dst: &mut DeviceBuffer<u16>) -> Result<()> {
        dst.upload(src, self.stream())
    }

    /// Copies a 16-bit device buffer to host memory of the same length after pending work.
    pub fn download_bits(&self, src: &DeviceBuffer<u16>, dst: &mut [u16]) -> Result<()> {
        src.download(dst, self.stream())
    }

    /// Copies raw bytes into a device buffer of the same length; waits for the copy.
    pub fn upload_bytes(&self, src: &[u8], dst: &mut DeviceBuffer<u8>) -> Result<()> {
        dst.upload(src, self.stream())
    }

    /// Copies a byte buffer to host memory of the same length after pending work.
    pub fn download_bytes(&self, src: &DeviceBuffer<u8>, dst: &mut [u8]) -> Result<()> {
        src.download(dst, self.stream())
    }
}

impl CudaBackend {
    /// A forward's I/O on device buffers holding `x` and `y` in the 16-bit precision `io` (`x`
    /// `None` in place: `y` holds x), the mask f32, on the backend's stream: what
    /// [`Layer::forward_buffers_half`](crate::Layer::forward_buffers_half) runs.
    pub(crate) fn half_buffer_io<'a>(
        x: Option<&'a DeviceBuffer<u16>>,
        mask: Option<&'a DeviceBuffer<f32>>,
        y: &'a mut DeviceBuffer<u16>,
        io: Precision,
    ) -> ForwardIo<'a> {
        let arg = |b: &DeviceBuffer<u16>| (b.ptr(), b.len());
        // SAFETY: the buffers are this backend's allocations of the lengths given, borrowed for
        // 'a (y mutably, so nothing else reads or writes it meanwhile); they are freed through
        // cuMemFree, which waits for the work enqueued on them.
        unsafe { ForwardIo::device_buffers(x.map(arg), mask.map(|m| (m.ptr(), m.len())), arg(y), io) }
    }

    /// The backward on device buffers holding x, dy and dx in `problem`'s 16-bit precision, the
    /// mask f32, on the backend's stream: what
    /// [`Layer::backward_buffers_half`](crate::Layer::backward_buffers_half) runs. Waits.
    pub(crate) fn backward_buffers_half(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        (x, mask, dy): (&DeviceBuffer<u16>, Option<&DeviceBuffer<f32>>, &DeviceBuffer<u16>),
        dx: &mut DeviceBuffer<u16>,
    ) -> Result<Gradients> {
        if problem.io == Precision::F32Io {
            return Err(Error::Dtype("16-bit device buffers were given with the precision f32-io".into()));
        }
        super::check_backward_io(problem, x.len(), mask.map(DeviceBuffer::len), dy.len(), Some(dx.len()))?;
        let io = (x.ptr(), mask.map_or(0, |m| m.ptr()), dy.ptr(), dx.ptr());
        // SAFETY: the buffers are this backend's allocations of the lengths checked above (in
        // 16-bit elements; the mask f32), borrowed until this call returns, which waits for the
        // work; `dx` is borrowed mutably, so it aliases none of the others. The backend's own
        // stream: its buffers were written there.
        unsafe { self.backward_device(prepared, problem, io, self.stream() as u64, None) }
    }
}

impl CudaBackend {
    /// What this backend's input stage is for `problem`: the fused kernel where it takes the
    /// shape, else the stage kernels around cuBLASLt.
    pub(super) fn caps(&self, prepared: &CudaPrepared, problem: &Problem, tuning: Tuning) -> Capabilities {
        let fused = self.fused_kernel_for(prepared, problem, tuning).is_some();
        Capabilities { input: if fused { InputStage::Fused } else { InputStage::Staged }, blas: Blas::CublasLt }
    }

    /// The capabilities of a chunked plan: the fused kernel's hidden passes where this layer
    /// has one, else the staged passes (f32 I/O only); `None`: no chunked plan.
    fn chunked_caps(&self, prepared: &CudaPrepared, problem: &Problem) -> Option<Capabilities> {
        match self.chunk_kernel(prepared, Tuning::default()) {
            Some(_) => Some(Capabilities { input: InputStage::Fused, blas: Blas::CublasLt }),
            None if problem.io == Precision::F32Io => {
                Some(Capabilities { input: InputStage::Staged, blas: Blas::CublasLt })
            }
            None => None,
        }
    }

    /// The one-pass plan of `problem`.
    pub(super) fn one_pass_plan(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        tuning: Tuning,
        gate_from_x: bool,
    ) -> Result<Plan> {
        Plan::one_pass(problem, self.caps(prepared, problem, tuning), gate_from_x)
    }

    /// Bytes of the one-pass workspace (`u64::MAX` for a problem no plan takes).
    pub(super) fn one_pass_bytes(&self, prepared: &CudaPrepared, problem: &Problem, from_x: bool) -> u64 {
        self.one_pass_plan(prepared, problem, self.tuning_for(problem), from_x)
            .map_or(u64::MAX, |p| p.workspace_bytes())
    }

    /// The one-pass workspace of `plan` (left, right, the gate unless made from x, and t, each
    /// from `alloc`, in halves) with its cuBLASLt plans.
    fn one_pass_workspace(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        tuning: Tuning,
        plan: Plan,
        alloc: &mut dyn FnMut(usize) -> Result<DeviceBuffer<u16>>,
    ) -> Result<CudaWorkspace> {
        let cfg = problem.config;
        let m = problem.shape.rows();
        let blas = &self.inner.blas;
        let blas_input = match (plan.caps.input, plan.projection_ws) {
            (InputStage::Fused, _) => None,
            (InputStage::Staged, Some(ws)) => {
                let proj = |rows| {
                    MatmulPlan::new(
                        blas,
                        GemmSpec::projection(rows, cfg.c, cfg.fused_proj_width()),
                        Elem::F16,
                        false,
                        ws.bytes,
                    )
                };
                let tail = m % plan.input_rows;
                Some(BlasInput {
                    proj_full: proj(plan.input_rows)?,
                    proj_tail: if tail > 0 { Some(proj(tail)?) } else { None },
                })
            }
            (InputStage::Staged, None) => {
                return Err(Error::Internal("a staged one-pass plan without a projection workspace".into()))
            }
        };
        let bh = problem.shape.batch * cfg.h;
        let contraction_ws = plan.contraction_ws.map_or(0, |r| r.bytes);
        let output_ws = plan.output_ws.map_or(0, |r| r.bytes);
        let layout = Layout::OnePass {
            left: alloc(plan.left_bytes / 2)?,
            right: alloc(plan.left_bytes / 2)?,
            gate: if plan.gate.is_some() { Some(alloc(plan.gate_bytes / 2)?) } else { None },
            blas_input,
        };
        let t = alloc(plan.t_bytes / 2)?;
        let contraction = MatmulPlan::new_ranked(
            blas,
            GemmSpec::contraction(problem.direction, bh, problem.shape.n),
            Elem::F16,
            false,
            MAX_GEMM_WORKSPACE.min(contraction_ws),
            tuning.contraction_rank as usize,
        )?;
        let output = MatmulPlan::new(
            blas,
            GemmSpec::output(m, cfg.c, cfg.h),
            Elem::F32,
            prepared.tensors.out_bias.is_some(),
            MAX_GEMM_WORKSPACE.min(output_ws),
        )?;
        Ok(self.workspace_of(problem, plan, tuning, (layout, t), (contraction, None), (output, None)))
    }

    /// A one-pass workspace whose buffers are views into caller memory, laid out from address
    /// 0 (so their addresses are offsets) until [`CudaWorkspace::bind`] moves them to the span
    /// of a call; and the bytes that span needs. The gate is made from x where the stored one
    /// would not fit `limit` and the kernel applies, as in [`Backend::workspace`].
    fn plan_caller_workspace(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        limit: Option<u64>,
    ) -> Result<(CudaWorkspace, u64)> {
        check_prepared_for(&prepared.config, problem)?;
        if let Some(why) = self.half_io_unsupported(prepared, problem) {
            return Err(Error::Dtype(why));
        }
        let tuning = self.tuning_for(problem);
        let limit = limit.unwrap_or(u64::MAX);
        let gate_from_x = self.gate_from_x_for(prepared, problem, tuning)
            && match self.output_gate() {
                OutputGate::FromX => true,
                OutputGate::Stored => false,
                OutputGate::Auto => self.one_pass_bytes(prepared, problem, false) > limit,
            };
        let inner = &self.inner;
        let mut span = SpanCarver::default();
        let mut carve = |len: usize| -> Result<DeviceBuffer<u16>> {
            let bytes = (len as u64).checked_mul(2).ok_or_else(|| Error::Shape("workspace too large".into()))?;
            Ok(span.carve(bytes, |at| DeviceBuffer::borrowed(&inner.ctx, &inner.tracker, at, len)))
        };
        let mut ws = match self.chunked_plan_within(prepared, problem, gate_from_x, limit)? {
            Some(plan) => {
                let t = carve(plan.t_bytes / 2)?;
                let scratch = span.carve(plan.scratch_bytes as u64, |at| {
                    DeviceBuffer::borrowed(&inner.ctx, &inner.tracker, at, plan.scratch_bytes)
                });
                self.chunked_workspace(prepared, problem, plan, t, scratch)?
            }
            None => {
                let plan = self.one_pass_plan(prepared, problem, tuning, gate_from_x)?;
                self.one_pass_workspace(prepared, problem, tuning, plan, &mut carve)?
            }
        };
        let end = span.workspace_within(BackendKind::Cuda, problem, Some(limit))?;
        ws.caller_base = Some((0, end));
        Ok((ws, end))
    }

    /// The widest chunked plan of the fused input kernel within `limit` when the one-pass plan
    /// does not fit it; `None` when one pass fits, or when no such chunked plan exists (the
    /// one-pass plan's size then makes the out-of-memory error). The staged chunked plans are
    /// not offered for caller memory: they keep copies of the weights in their workspace.
    fn chunked_plan_within(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        gate_from_x: bool,
        limit: u64,
    ) -> Result<Option<Plan>> {
        if self.one_pass_bytes(prepared, problem, gate_from_x) <= limit {
            return Ok(None);
        }
        match self.chunked_caps(prepared, problem) {
            Some(caps) if caps.input == InputStage::Fused => Plan::widest_chunked(problem, caps, limit),
            _ => Ok(None),
        }
    }
}

impl CudaWorkspace {
    /// Moves a caller-memory workspace's buffers into `span` (checked: aligned, large enough).
    fn bind(&mut self, span: DeviceSpan) -> Result<()> {
        let CudaWorkspace { caller_base, t, layout, .. } = self;
        caller_workspace::bind(
            caller_base,
            span,
            move || -> Result<Vec<&mut dyn Rebase>> {
                match layout {
                    Layout::OnePass { left, right, gate, .. } => {
                        let mut views: Vec<&mut dyn Rebase> = vec![t, left, right];
                        views.extend(gate.as_mut().map(|g| g as &mut dyn Rebase));
                        Ok(views)
                    }
                    Layout::Chunked { scratch } => Ok(vec![t, scratch]),
                    Layout::Staged(_) => Err(caller_workspace::not_in_caller_memory()),
                }
            },
            |view, from, to| view.rebase(from, to),
        )
    }
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
        // Weights whose tensors disagree with their config are an error here, not a panic in the
        // packing below or out-of-bounds reads in a kernel.
        w.validate()?;
        let cfg = w.config();
        let fused_input = match self.fused_layout(&cfg) {
            Some(layout) => {
                let (mat, bias) = layout.pack(w);
                Some(FusedInput {
                    layout,
                    w: self.upload_f16(&f16_words("the input projections", &mat)?)?,
                    bias: bias.map(|b| self.upload_f32(&b)).transpose()?,
                })
            }
            None => None,
        };
        Ok(CudaPrepared {
            config: cfg,
            id: super::next_weights_id(),
            fused: fused_input,
            tensors: PreparedTensors::upload(w, |h| self.upload_f16(h), |v| self.upload_f32(v))?,
        })
    }

    fn prepared_bytes(&self, p: &CudaPrepared) -> u64 {
        let f = p.fused.as_ref().map_or(0, |f| f.w.bytes() + f.bias.as_ref().map_or(0, |b| b.bytes()));
        f + p.tensors.bytes()
    }

    fn workspace_bytes(&self, prepared: &CudaPrepared, problem: &Problem) -> u64 {
        if problem.validate().is_err() {
            return u64::MAX; // no plan for a problem Problem::new refuses
        }
        let from_x = self.output_gate() == OutputGate::FromX
            && self.gate_from_x_for(prepared, problem, self.tuning_for(problem));
        self.one_pass_bytes(prepared, problem, from_x)
    }

    fn min_workspace_bytes(&self, prepared: &CudaPrepared, problem: &Problem) -> u64 {
        if problem.validate().is_err() {
            return u64::MAX;
        }
        let from_x = self.gate_from_x_for(prepared, problem, self.tuning_for(problem));
        let one_pass = self.one_pass_bytes(prepared, problem, from_x);
        let narrowest = self.chunked_caps(prepared, problem).and_then(|caps| Plan::narrowest(problem, caps).ok());
        narrowest.map_or(one_pass, |p| one_pass.min(p.workspace_bytes()))
    }

    fn exec_plan(ws: &CudaWorkspace) -> ExecPlan {
        ws.plan.summary()
    }

    fn host_io_staged(&self) -> bool {
        true
    }

    fn half_io_native(&self, _prepared: &CudaPrepared) -> bool {
        true
    }

    fn workspace(&self, prepared: &CudaPrepared, problem: &Problem, limit: Option<u64>) -> Result<CudaWorkspace> {
        check_prepared_for(&prepared.config, problem)?;
        let free = self.memory_info()?.map(|m| m.free);
        // No limit given: the device's free memory is one (callers of the trait directly get a
        // chunked plan rather than an out-of-memory error when the one-pass plan cannot fit).
        let limit = limit.unwrap_or(u64::MAX).min(free.unwrap_or(u64::MAX));
        // The gate made from x where it applies and is asked for, or (auto) where the one-pass
        // plan fits only without the stored gate.
        let tuning = self.tuning_for(problem);
        let gate_from_x = self.gate_from_x_for(prepared, problem, tuning)
            && match self.output_gate() {
                OutputGate::FromX => true,
                OutputGate::Stored => false,
                OutputGate::Auto => self.one_pass_bytes(prepared, problem, false) > limit,
            };
        let one_pass = self.one_pass_bytes(prepared, problem, gate_from_x);
        let what = || {
            format!(
                "the workspace for B={} N={} C={} H={}",
                problem.shape.batch, problem.shape.n, problem.config.c, problem.config.h
            )
        };
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        if let Some(why) = self.half_io_unsupported(prepared, problem) {
            return Err(Error::Dtype(why));
        }
        if one_pass > limit {
            let Some(caps) = self.chunked_caps(prepared, problem) else {
                return Err(Error::OutOfMemory {
                    backend: BackendKind::Cuda,
                    what: format!("{} (16-bit I/O has no chunked plan without the fused input kernel)", what()),
                    needed: one_pass,
                    available: limit,
                });
            };
            let Some(plan) = Plan::widest_chunked(problem, caps, limit)? else {
                return Err(Error::OutOfMemory {
                    backend: BackendKind::Cuda,
                    what: match caps.input {
                        InputStage::Fused => format!("{} (narrowest chunked plan)", what()),
                        InputStage::Staged => format!("{} (narrowest chunked plan of the stage kernels)", what()),
                    },
                    needed: Plan::narrowest(problem, caps)?.workspace_bytes(),
                    available: limit,
                });
            };
            return match caps.input {
                InputStage::Fused => {
                    let (t, scratch) = (self.alloc_buffer(plan.t_bytes / 2)?, self.alloc_buffer(plan.scratch_bytes)?);
                    self.chunked_workspace(prepared, problem, plan, t, scratch)
                }
                InputStage::Staged => self.staged_workspace(prepared, problem, plan),
            };
        }
        if let Some(free) = free.filter(|&f| one_pass > f) {
            return Err(Error::OutOfMemory {
                backend: BackendKind::Cuda,
                what: what(),
                needed: one_pass,
                available: free,
            });
        }
        let plan = self.one_pass_plan(prepared, problem, tuning, gate_from_x)?;
        self.one_pass_workspace(prepared, problem, tuning, plan, &mut |len| self.alloc_buffer(len))
    }

    fn workspace_fits(&self, ws: &CudaWorkspace, problem: &Problem) -> bool {
        // The mask only changes a kernel argument, not the buffers or plans.
        ws.problem.config == problem.config
            && ws.problem.shape == problem.shape
            && ws.problem.direction == problem.direction
            && ws.problem.in_place == problem.in_place
            && ws.problem.io == problem.io
            && ws.tuning == self.tuning_for(problem)
            && ws.output_gate == self.output_gate()
            && ws.switches == self.switches()
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        self.alloc_buffer(len)
    }

    fn buffer_len(buffer: &DeviceBuffer<f32>) -> usize {
        buffer.len()
    }

    fn buffer_addr(buffer: &DeviceBuffer<f32>) -> Option<u64> {
        Some(buffer.ptr())
    }

    fn stream_handle(&self) -> u64 {
        self.stream() as u64
    }

    fn upload(&self, src: &[f32], dst: &mut DeviceBuffer<f32>) -> Result<()> {
        dst.upload(src, self.stream())
    }

    fn download(&self, src: &DeviceBuffer<f32>, dst: &mut [f32]) -> Result<()> {
        src.download(dst, self.stream())
    }

    unsafe fn upload_async(&self, src: HostWords<'_>, dst: &mut DeviceBuffer<f32>) -> Result<()> {
        // SAFETY: `src` outlives the copy (this method's contract); the buffer checks the fit.
        unsafe { dst.upload_host_async(src, self.stream()) }
    }

    fn download_words(&self, src: &DeviceBuffer<f32>, dst: HostWordsMut<'_>) -> Result<()> {
        src.download_host(dst, self.stream())
    }

    fn buffer_io<'a>(
        x: Option<&'a DeviceBuffer<f32>>,
        mask: Option<&'a DeviceBuffer<f32>>,
        y: &'a mut DeviceBuffer<f32>,
    ) -> ForwardIo<'a> {
        let arg = |b: &DeviceBuffer<f32>| (b.ptr(), b.len());
        // SAFETY: the buffers are this backend's allocations of the lengths given, borrowed for
        // 'a (y mutably, so it aliases neither x nor the mask); they are freed through cuMemFree,
        // which waits for the work enqueued on them.
        unsafe { ForwardIo::device_buffers(x.map(arg), mask.map(arg), arg(y), Precision::F32Io) }
    }

    fn forward(
        &self,
        prepared: &CudaPrepared,
        workspace: &mut CudaWorkspace,
        problem: &Problem,
        io: ForwardIo<'_>,
    ) -> Result<()> {
        let (d, span) = device_operands(&io, problem, BackendKind::Cuda, workspace.caller_base.is_some())?;
        if let Some(span) = span {
            workspace.bind(span)?;
        }
        let stream = io.stream().map_or(self.stream(), |s| s as CUstream);
        // SAFETY: `d` carries its constructor's contract (see `device_operands`); the workspace's
        // buffers are its own allocations or views into the span just bound, which that
        // contract keeps alive and unshared.
        unsafe { self.enqueue(prepared, workspace, problem, d.x(), d.mask(), d.y(), stream) }
    }

    fn backward(&self, prepared: &CudaPrepared, problem: &Problem, io: BackwardIo<'_>) -> Result<Gradients> {
        check_prepared_for(&prepared.config, problem)?;
        let BackwardIo { x, mask, dy } = io;
        super::check_backward_io(problem, x.len(), mask.map(<[f32]>::len), dy.len(), None)?;
        let upload = |v: &[f32]| self.upload_f32(v);
        let (xd, dyd) = (upload(x)?, upload(dy)?);
        let maskd = mask.map(upload).transpose()?;
        let mut dx = self.alloc_buffer::<f32>(x.len())?;
        let mut g = self.backward_buffers(prepared, problem, &xd, maskd.as_ref(), &dyd, &mut dx)?;
        g.x = vec![0f32; x.len()];
        dx.download(&mut g.x, self.stream())?;
        Ok(g)
    }

    fn backward_buffers(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        x: &DeviceBuffer<f32>,
        mask: Option<&DeviceBuffer<f32>>,
        dy: &DeviceBuffer<f32>,
        dx: &mut DeviceBuffer<f32>,
    ) -> Result<Gradients> {
        // The buffers are f32 whatever precision the problem names.
        let problem = &problem.with_io(Precision::F32Io);
        check_prepared_for(&prepared.config, problem)?;
        super::check_backward_io(problem, x.len(), mask.map(DeviceBuffer::len), dy.len(), Some(dx.len()))?;
        // SAFETY: the buffers are this backend's allocations of the lengths checked above,
        // borrowed until this call returns, which waits for the work (the download of the sums);
        // `dx` is borrowed mutably, so it aliases none of the others. The backend's own stream:
        // its buffers were written there.
        unsafe {
            let io = (x.ptr(), mask.map_or(0, |m| m.ptr()), dy.ptr(), dx.ptr());
            self.backward_device(prepared, problem, io, self.stream() as u64, None)
        }
    }

    unsafe fn backward_device(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        (x, mask, dy, dx): (u64, u64, u64, u64),
        stream: u64,
        workspace: Option<DeviceSpan>,
    ) -> Result<Gradients> {
        super::check_device_backward(&prepared.config, problem, (x, mask, dy, dx))?;
        self.check_backward_fits(problem)?;
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        // SAFETY: forwarded from this method's contract; 0 is the legacy default stream (the
        // null CUstream), as in a forward on caller memory.
        unsafe { self.backward_on_device(prepared, problem, (x, mask, dy, dx), stream as CUstream, workspace) }
    }

    unsafe fn backward_device_async(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        io: BackwardDeviceIo,
    ) -> Result<()> {
        super::check_device_backward(&prepared.config, problem, io.tensors)?;
        self.check_backward_fits(problem)?;
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        // SAFETY: forwarded from this method's contract.
        unsafe { self.backward_on_device_async(prepared, problem, io) }
    }

    fn backward_workspace_bytes(&self, prepared: &CudaPrepared, problem: &Problem) -> Result<u64> {
        check_prepared_for(&prepared.config, problem)?;
        self.backward_span_bytes(problem)
    }

    fn free_backward_buffers(&self) {
        self.drop_backward_buffers();
    }

    fn prepared_device_bytes(&self, config: &Config, biases: bool) -> Result<u64> {
        config.validate()?;
        Ok(self.prepared_layout(config, biases, biases).bytes)
    }

    unsafe fn prepare_device(&self, weights: &DeviceWeights, storage: DeviceSpan, stream: u64) -> Result<CudaPrepared> {
        // SAFETY: forwarded from this method's contract.
        unsafe { self.prepare_on_device(weights, storage, stream as CUstream) }
    }

    fn caller_workspace(
        &self,
        prepared: &CudaPrepared,
        problem: &Problem,
        limit: Option<u64>,
    ) -> Result<(CudaWorkspace, u64)> {
        self.plan_caller_workspace(prepared, problem, limit)
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
        let n = gpu_ceilings::GEMM_N;
        let host = gpu_ceilings::gemm_operand();
        let mut a = self.alloc_buffer::<u16>(n * n)?;
        let mut b = self.alloc_buffer::<u16>(n * n)?;
        a.upload(&host, stream)?;
        b.upload(&host, stream)?;
        let d = self.alloc_buffer::<u16>(n * n)?;
        let ws = self.alloc_buffer::<u8>(MAX_GEMM_WORKSPACE)?;
        let spec = GemmSpec::projection(n, n, n);
        let mut plan = MatmulPlan::new(&self.inner.blas, spec, Elem::F16, false, MAX_GEMM_WORKSPACE)?;
        let gemm = || {
            // SAFETY: a, b, d are n×n f16 allocations and ws holds MAX_GEMM_WORKSPACE bytes, all
            // alive until the synchronising timer returns.
            unsafe { plan.run(&self.inner.blas, a.ptr(), b.ptr(), d.ptr(), 0, ws.ptr(), MAX_GEMM_WORKSPACE, stream) }
        };
        let gemm_ms = gpu_ceilings::mean_ms(self, gemm)?;
        drop((a, b, d, ws));
        let len = gpu_ceilings::COPY_BYTES;
        let mut src = self.alloc_buffer::<u8>(len)?;
        src.memset_async(0x3C, stream)?;
        let dst = self.alloc_buffer::<u8>(len)?;
        let copy = || {
            // SAFETY: both are `len`-byte allocations of this context, alive until timed work ends.
            unsafe { cu::memcpy_dtod_async(dst.ptr(), src.ptr(), len, stream) }.ctx("cuMemcpyDtoDAsync")
        };
        let copy_ms = gpu_ceilings::mean_ms(self, copy)?;
        Ok(gpu_ceilings::ceilings("cuBLASLt", gemm_ms, copy_ms))
    }

    fn elapsed_ms(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let ev = EventPair::new()?;
        ev.record_start(self.stream())?;
        work()?;
        ev.record_stop(self.stream())?;
        ev.elapsed_ms()
    }

    fn held_elapsed_ms(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        self.inner.ctx.bind_to_thread().ctx("cuCtxSetCurrent")?;
        let ev = EventPair::new()?;
        let hold = StreamHold::new(self.stream())?;
        hold.enqueue(|| {
            ev.record_start(self.stream())?;
            work()?;
            ev.record_stop(self.stream())
        })?;
        ev.elapsed_ms()
    }

    fn peak_memory(&self) -> Option<u64> {
        Some(self.inner.tracker.peak())
    }

    fn reset_peak_memory(&self) {
        self.inner.tracker.reset_peak();
    }
}
