//! The [`Backend`] trait every backend implements, and the backends.
//!
//! A backend owns a device (or the host), a stream of work on it, and the vendor libraries it
//! drives. The trait is shaped by what the GPU backends need:
//! - weights are *prepared* once per layer ([`Backend::prepare`]): fused into one projection
//!   matrix, cast and transposed for that backend, uploaded;
//! - *workspaces* hold every intermediate for one problem shape and are reused across calls, so a
//!   forward allocates nothing;
//! - [`Backend::forward`] is the one forward entry: it enqueues work on the I/O a [`ForwardIo`]
//!   describes (the backend's buffers, caller device memory with its stream and workspace, or
//!   host slices where the backend computes on the host) and may return before it finishes;
//!   [`Backend::synchronize`] is the explicit sync point. Forwards on host slices for GPU
//!   backends are staged above the backends, once for all of them (`src/staging.rs`: uploads
//!   into buffers kept across calls, 16-bit widened where [`Backend::half_io_native`] says so),
//!   with the copies of [`Backend::upload_async`] and [`Backend::download_words`].
//!
//! Runtime choice is an enum, not a trait object: [`crate::Device`] (in `src/device.rs`, above
//! the backends) forwards to the compiled-in backends. Detection order is HIP, then CUDA, then
//! CPU; [`BACKEND_ENV`] (`TRIMUL_BACKEND=cpu|cuda|hip`) overrides it.

// The backward kernels' argument structs, geometry and buffer layout (CUDA's and HIP's backward).
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) mod backward_params;
// The backward's steps, written once for CUDA and HIP.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) mod backward_steps;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) mod caller_workspace;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) mod device_prepare;
pub mod device_weights;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) mod gemm;
#[cfg(feature = "rocm")]
pub mod hip;
// The one unsafe call the CPU backend needs (`gemm::gemm`), behind a bounds-checked safe API.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) mod gpu_ceilings;
pub(crate) mod host_gemm;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) mod params;
// The prepared weights' buffers and addresses, shared by CUDA and HIP.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) mod prepared;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) mod staged_steps;

use crate::device_io::{BackwardDeviceIo, BackwardIo, DeviceOperands, DeviceSpan, DeviceWeights, ForwardIo, Operands};
pub use crate::device_io::{HostWords, HostWordsMut};
use crate::error::{BackendKind, Error, Result};
use crate::gradients::Gradients;
use crate::plan::ExecPlan;
use crate::problem::{Config, Problem};
use crate::weights::Weights;

/// Environment variable that forces a backend (`cpu`, `cuda` or `hip`).
pub const BACKEND_ENV: &str = "TRIMUL_BACKEND";

/// What a backend found about its device and libraries (for `trimul info` and bench reports).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct DeviceInfo {
    /// Vendor (`NVIDIA`, `AMD`, or the CPU vendor string).
    pub vendor: String,
    /// Marketing name of the device or CPU.
    pub name: String,
    /// Normalised architecture: `sm_90`, `gfx942`, `x86_64`.
    pub arch: String,
    /// SMs, CUs or CPU threads used.
    pub compute_units: u32,
    /// Device memory in bytes (host memory for the CPU backend).
    pub memory_bytes: u64,
    /// Versions of the driver/runtime and each library, as `(name, version)`.
    pub versions: Vec<(String, String)>,
}

/// Ceilings measured on the device in the same run as a benchmark, for floor ratios.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Ceilings {
    /// Rate of a large GEMM in the precision the backend computes in (TFLOP/s).
    pub gemm_tflops: f64,
    /// What that GEMM was (e.g. "cuBLASLt f16·f16→f32 8192³").
    pub gemm_desc: String,
    /// Device-to-device copy bandwidth, counting bytes read plus bytes written (GB/s).
    pub copy_gbs: f64,
}

/// Device memory as reported by the driver.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryInfo {
    /// Bytes free on the device.
    pub free: u64,
    /// Bytes the device has in all.
    pub total: u64,
}

/// The error of a GPU backend given host slices: they reach it through the layer's host staging.
#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
fn host_operands(kind: BackendKind) -> Error {
    Error::InvalidArgument(format!(
        "the {kind} backend computes on device memory: host slices go through the layer's host staging \
         (Layer::forward_into, trimul::staging::HostStaging)"
    ))
}

/// What a GPU backend's forward takes from its I/O, after [`ForwardIo::check`]: the device
/// operands (which carry the contract of the `ForwardIo` constructor that made them: live
/// allocations of the backend's context with the problem's element counts, y apart from x and
/// the mask unless in place, alive until the stream has run the work) and the workspace span to
/// bind, if any. `in_caller_memory`: the workspace lives in caller memory, so a span is needed.
#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
pub(crate) fn device_operands(
    io: &ForwardIo<'_>,
    problem: &Problem,
    kind: BackendKind,
    in_caller_memory: bool,
) -> Result<(DeviceOperands, Option<DeviceSpan>)> {
    io.check(problem)?;
    let Operands::Device(operands) = io.operands() else {
        return Err(host_operands(kind));
    };
    if in_caller_memory && io.workspace().is_none() {
        return Err(Error::InvalidArgument("this workspace lives in caller memory: pass its span".into()));
    }
    Ok((*operands, io.workspace()))
}

/// Weights prepared for the layer `prepared` serve only problems of that layer, and only valid
/// ones ([`Problem::validate`]: its fields are public, so it may not have come from `new`).
pub(crate) fn check_prepared_for(prepared: &Config, problem: &Problem) -> Result<()> {
    problem.validate()?;
    if *prepared != problem.config {
        return Err(Error::InvalidArgument(format!(
            "weights prepared for {prepared:?} used with a problem of {:?}",
            problem.config
        )));
    }
    Ok(())
}

/// A fresh identity for a set of prepared weights. Chunked workspaces copy the pass rows of the
/// weights they were planned with, so they remember whose they are ([`check_same_weights`]).
#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
pub(crate) fn next_weights_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A workspace that holds copies of some prepared weights (`holds`, the id of
/// [`next_weights_id`]) serves only forwards with those weights: with another layer's weights
/// of the same shape it would compute with the wrong ones and return Ok.
#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
pub(crate) fn check_same_weights(holds: Option<u64>, prepared: u64) -> Result<()> {
    match holds {
        Some(id) if id != prepared => Err(Error::InvalidArgument(
            "this workspace was planned in chunks for other prepared weights and holds copies of them; \
             make a workspace with these weights"
                .into(),
        )),
        _ => Ok(()),
    }
}

/// Checks the lengths of a backward's operands against `problem`: `x` and `dy` (and `dx`, where
/// the caller passes one) of `B·N·N·C` values each, a mask of `B·N·N` exactly when the problem is
/// masked. Every backend's backward on slices or buffers runs it first.
pub(crate) fn check_backward_io(
    problem: &Problem,
    x: usize,
    mask: Option<usize>,
    dy: usize,
    dx: Option<usize>,
) -> Result<()> {
    let (shape, c) = (problem.shape, problem.config.c);
    for (name, len) in [("x", Some(x)), ("dy", Some(dy)), ("dx", dx)] {
        if let Some(len) = len.filter(|&l| l != problem.x_len()) {
            return Err(Error::Shape(format!(
                "{name} has {len} elements, expected B·N·N·C = {}·{}·{}·{c} = {}",
                shape.batch,
                shape.n,
                shape.n,
                problem.x_len()
            )));
        }
    }
    check_backward_mask(problem, mask.is_some())?;
    match mask {
        Some(m) if m != shape.rows() => {
            Err(Error::Shape(format!("the mask has {m} elements, expected B·N·N = {}", shape.rows())))
        }
        _ => Ok(()),
    }
}

/// A backward's mask is given exactly when its problem is masked.
pub(crate) fn check_backward_mask(problem: &Problem, given: bool) -> Result<()> {
    match (given, problem.masked) {
        (true, false) => Err(Error::InvalidArgument("a mask was given for an unmasked problem".into())),
        (false, true) => Err(Error::InvalidArgument("the problem is masked but no mask was given".into())),
        _ => Ok(()),
    }
}

/// The checks a device backward makes before it launches anything: the weights were prepared
/// for this problem's layer, the mask is given exactly when the problem is masked (`mask` 0: none),
/// x, dy and dx are non-null and 16-byte aligned, the mask 4-byte aligned.
#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
pub(crate) fn check_device_backward(
    prepared: &Config,
    problem: &Problem,
    (x, mask, dy, dx): (u64, u64, u64, u64),
) -> Result<()> {
    check_prepared_for(prepared, problem)?;
    check_backward_mask(problem, mask != 0)?;
    for (name, ptr) in [("x", x), ("dy", dy), ("dx", dx)] {
        if ptr == 0 || ptr % 16 != 0 {
            return Err(Error::InvalidArgument(format!(
                "{name} must be a non-null, 16-byte aligned device pointer (got {ptr:#x})"
            )));
        }
    }
    if mask % 4 != 0 {
        return Err(Error::InvalidArgument(format!("the mask must be 4-byte aligned (got {mask:#x})")));
    }
    Ok(())
}

/// The checks a device forward makes before it launches anything: the weights were prepared for
/// this problem's layer (their sizes are the kernels' loop bounds), `y` is `x` exactly when the
/// problem is in place, and every device pointer is 16-byte aligned (the stage kernels load and
/// store 16 bytes at a time). `mask` 0 means no mask.
#[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(dead_code))]
pub(crate) fn check_device_forward(prepared: &Config, problem: &Problem, x: u64, mask: u64, y: u64) -> Result<()> {
    check_prepared_for(prepared, problem)?;
    if (x == y) != problem.in_place {
        return Err(Error::InvalidArgument(if problem.in_place {
            "an in-place forward needs y = x".into()
        } else {
            "y must not alias x (use the in-place forward to overwrite x)".into()
        }));
    }
    for (name, ptr) in [("x", x), ("mask", mask), ("y", y)] {
        if ptr % 16 != 0 {
            return Err(Error::InvalidArgument(format!("{name} must be 16-byte aligned on the device (got {ptr:#x})")));
        }
    }
    Ok(())
}

/// The error of a backend without forwards on caller device memory.
pub(crate) fn no_device_io(kind: BackendKind) -> Error {
    Error::InvalidArgument(match kind {
        BackendKind::Cpu => "the CPU backend works on host slices: it has no device memory to be given".into(),
        other => format!("forwards on caller device memory are not built for the {other} backend yet"),
    })
}

/// One compute backend. See the module docs for the life cycle.
pub trait Backend: Clone + Send + Sync {
    /// Storage for `f32` tensors on this backend's device (host memory for the CPU).
    type Buffer: Send;
    /// Weights fused, cast and uploaded for this backend.
    type Prepared: Send;
    /// Every intermediate of one problem shape; reused across calls of that shape.
    type Workspace: Send;

    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// Device, arch and library versions.
    fn info(&self) -> DeviceInfo;

    /// Fuse, cast, transpose and upload the weights of one layer. Done once per layer.
    fn prepare(&self, weights: &Weights) -> Result<Self::Prepared>;

    /// Device bytes the prepared weights take (they count against a memory budget).
    fn prepared_bytes(&self, prepared: &Self::Prepared) -> u64;

    /// Allocate the intermediates for `problem`, planned to take at most `limit` bytes (`None`:
    /// the widest plan, the fastest). Narrower limits split the work into hidden-channel and
    /// row chunks (see [`crate::plan`]). Fails with [`Error::OutOfMemory`] before allocating
    /// when no plan fits the limit or the device.
    fn workspace(&self, prepared: &Self::Prepared, problem: &Problem, limit: Option<u64>) -> Result<Self::Workspace>;

    /// Whether `workspace` can serve `problem` without reallocation.
    fn workspace_fits(&self, workspace: &Self::Workspace, problem: &Problem) -> bool;

    /// Device bytes the one-pass (fastest) workspace for `problem` takes.
    fn workspace_bytes(&self, prepared: &Self::Prepared, problem: &Problem) -> u64;

    /// Device bytes of the narrowest plan this backend can run `problem` with; a limit below
    /// this cannot be met. Backends without chunked plans return [`Backend::workspace_bytes`].
    fn min_workspace_bytes(&self, prepared: &Self::Prepared, problem: &Problem) -> u64 {
        self.workspace_bytes(prepared, problem)
    }

    /// The plan a workspace was made with.
    fn exec_plan(workspace: &Self::Workspace) -> ExecPlan;

    /// Whether forwards on host slices copy `x`, the mask and `y` into device buffers (GPU
    /// backends, through the host staging), which a memory plan made for a host forward must
    /// leave room for; false where the backend computes on host memory (the CPU).
    fn host_io_staged(&self) -> bool {
        false
    }

    /// Whether 16-bit `x` and `y` stay 16-bit in this backend's memory for a layer with these
    /// prepared weights (CUDA's fused kernels read and write them; on HIP, input_norm and the
    /// MFMA output kernel), or are widened to f32 copies first by the host staging; memory
    /// budgets count the f32 bytes then, and [`Backend::forward`] refuses 16-bit device I/O.
    fn half_io_native(&self, prepared: &Self::Prepared) -> bool {
        let _ = prepared;
        false
    }

    /// A buffer of `len` f32 values. Contents are unspecified.
    fn alloc(&self, len: usize) -> Result<Self::Buffer>;

    /// Number of f32 values a buffer holds.
    fn buffer_len(buffer: &Self::Buffer) -> usize;

    /// The device address of a buffer, for the [`crate::device_io`] descriptors (`None` on the
    /// CPU, whose buffers are host memory).
    fn buffer_addr(buffer: &Self::Buffer) -> Option<u64> {
        let _ = buffer;
        None
    }

    /// The backend's own stream as an integer handle (what [`Backend::forward`] enqueues on), for
    /// calls that take a stream; 0 on the CPU.
    fn stream_handle(&self) -> u64 {
        0
    }

    /// Copy host data into a buffer of the same length.
    fn upload(&self, src: &[f32], dst: &mut Self::Buffer) -> Result<()>;

    /// Copy a buffer into host memory of the same length; waits for pending work.
    fn download(&self, src: &Self::Buffer, dst: &mut [f32]) -> Result<()>;

    /// Copies host words into the start of `dst` on the backend's stream; may return before
    /// the copy has run. Host staging (`src/staging.rs`) uploads x and the mask with it; a
    /// 16-bit tensor of `n` words sits in a buffer of `n.div_ceil(2)` f32 slots. Backends that
    /// read host memory where it lies ([`Backend::host_io_staged`] false) have nothing to stage.
    ///
    /// # Safety
    /// `src` stays alive and unchanged until the backend's stream has run the copy: until a
    /// later [`Backend::download_words`] or [`Backend::synchronize`] on this backend returns.
    unsafe fn upload_async(&self, src: HostWords<'_>, dst: &mut Self::Buffer) -> Result<()> {
        let _ = (src, dst);
        Err(Error::InvalidArgument(format!("the {} backend reads host memory itself: nothing to stage", self.kind())))
    }

    /// Copies the start of `src` into host words after the work enqueued on the backend's
    /// stream; waits for it.
    fn download_words(&self, src: &Self::Buffer, dst: HostWordsMut<'_>) -> Result<()> {
        let _ = (src, dst);
        Err(Error::InvalidArgument(format!("the {} backend reads host memory itself: nothing to stage", self.kind())))
    }

    /// A forward's I/O on this backend's buffers: `x` (`None` in place: `y` holds x), the mask
    /// and `y`, f32, on the backend's stream.
    fn buffer_io<'a>(
        x: Option<&'a Self::Buffer>,
        mask: Option<&'a Self::Buffer>,
        y: &'a mut Self::Buffer,
    ) -> ForwardIo<'a>;

    /// Enqueues one forward on the I/O `io` describes (see [`ForwardIo`]): the backend's own
    /// buffers, host slices (the CPU's memory; GPU backends get them through the layer's host
    /// staging) or caller device memory with a stream and a workspace span. May return before
    /// the work completes. With `io.workspace()`, `workspace` must come from
    /// [`Backend::caller_workspace`] and is bound to that span; without, it is one of
    /// [`Backend::workspace`]'s. Checks the I/O against the problem ([`ForwardIo::check`]) and
    /// the weights and workspace against both before anything is enqueued.
    fn forward(
        &self,
        prepared: &Self::Prepared,
        workspace: &mut Self::Workspace,
        problem: &Problem,
        io: ForwardIo<'_>,
    ) -> Result<()>;

    /// The gradients of a scalar loss `L` with respect to `x` and every weight and bias, given
    /// `dy = ∂L/∂y`, on host slices in f32 (`x`, `dy`: `[B,N,N,C]`, `mask`: `[B,N,N]`). The
    /// forward's intermediates are recomputed from `x`. Operands that do not match `problem`
    /// are an error before any work (`check_backward_io`). Backends without a backward return
    /// [`Error::Unsupported`].
    fn backward(&self, prepared: &Self::Prepared, problem: &Problem, io: BackwardIo<'_>) -> Result<Gradients> {
        let _ = (prepared, problem, io);
        Err(Error::Unsupported { backend: self.kind(), what: "the backward pass".into() })
    }

    /// [`Backend::backward`] on this backend's f32 buffers: writes `∂L/∂x` into `dx` and returns
    /// the weight and bias gradients (on the host: a few hundred KiB) with an empty `x`. Waits
    /// for the work. `dx` must not alias `x`, `mask` or `dy` (its `&mut` borrow says so).
    fn backward_buffers(
        &self,
        prepared: &Self::Prepared,
        problem: &Problem,
        x: &Self::Buffer,
        mask: Option<&Self::Buffer>,
        dy: &Self::Buffer,
        dx: &mut Self::Buffer,
    ) -> Result<Gradients> {
        let _ = (prepared, problem, x, mask, dy, dx);
        Err(Error::Unsupported { backend: self.kind(), what: "the backward pass".into() })
    }

    /// [`Backend::backward_buffers`] on caller device memory and the caller's stream (a raw
    /// `CUstream`/`hipStream_t` as an integer, 0 the legacy default stream, as
    /// [`crate::DeviceIo::stream`]), for bindings whose tensors the backend did not allocate:
    /// `x`, `dy` and `dx` are `[B,N,N,C]` in `problem.io` (f32, bf16 or f16), `mask` `[B,N,N]` f32
    /// or 0. The intermediates are
    /// carved from `workspace` (at least [`Backend::backward_workspace_bytes`]) when given, else
    /// from a block the backend allocates and keeps for the next backward. Waits for the work.
    ///
    /// # Safety
    /// Each non-zero pointer, and the workspace, is a device allocation of this backend's device
    /// holding the problem's element count (the span's bytes), alive and not used by anyone else
    /// until this returns; `dx` and the workspace overlap none of the others.
    unsafe fn backward_device(
        &self,
        prepared: &Self::Prepared,
        problem: &Problem,
        (x, mask, dy, dx): (u64, u64, u64, u64),
        stream: u64,
        workspace: Option<DeviceSpan>,
    ) -> Result<Gradients> {
        let _ = (prepared, problem, x, mask, dy, dx, stream, workspace);
        Err(Error::Unsupported { backend: self.kind(), what: "the backward pass on device memory".into() })
    }

    /// [`Backend::backward_device`] with the weight gradients kept on the device: once the
    /// stream has run the backward, each is copied (f32) to its destination in `io.grads`.
    /// Returns once the work is enqueued: nothing waits, so the workspace, where the sums are
    /// made, is required.
    ///
    /// # Safety
    /// As [`Backend::backward_device`], until the stream has run the work; each non-zero
    /// destination is a device allocation of this backend holding its weight's element count of
    /// f32, overlapping none of the other tensors.
    unsafe fn backward_device_async(
        &self,
        prepared: &Self::Prepared,
        problem: &Problem,
        io: BackwardDeviceIo,
    ) -> Result<()> {
        let _ = (prepared, problem, io);
        Err(Error::Unsupported { backend: self.kind(), what: "the backward pass on device memory".into() })
    }

    /// Bytes of the caller workspace a [`Backend::backward_device`] of `problem` needs.
    fn backward_workspace_bytes(&self, prepared: &Self::Prepared, problem: &Problem) -> Result<u64> {
        let _ = (prepared, problem);
        Err(Error::Unsupported { backend: self.kind(), what: "the backward pass on device memory".into() })
    }

    /// Frees what the last backward kept for the next one of the same sizes (GPU backends keep
    /// their intermediates between backward calls, as a layer keeps its forward workspace).
    fn free_backward_buffers(&self) {}

    /// Device bytes [`Backend::prepare_device`] needs for a layer of `config` (`biases`: whether
    /// any linear layer has one).
    fn prepared_device_bytes(&self, config: &Config, biases: bool) -> Result<u64> {
        let _ = (config, biases);
        Err(no_device_io(self.kind()))
    }

    /// Prepares weights the caller holds on the device into `storage` (at least
    /// [`Backend::prepared_device_bytes`] bytes) with one kernel enqueued on `stream`: no host
    /// copy, no allocation, no wait. The result reads `storage` in every forward.
    ///
    /// # Safety
    /// Every tensor of `weights` is a live device allocation of its length in this backend's
    /// context, unchanged until `stream` has run the preparation; `storage` is a live allocation
    /// of its size, used by nothing else, alive and unchanged for as long as the result is used;
    /// `stream` is a stream of this context (0: the legacy default stream). Work that reads the
    /// result on another stream (a forward on it, or on the backend's own stream, which a forward
    /// without a caller workspace uses) must be ordered after `stream` by the caller (an event).
    unsafe fn prepare_device(
        &self,
        weights: &DeviceWeights,
        storage: DeviceSpan,
        stream: u64,
    ) -> Result<Self::Prepared> {
        let _ = (weights, storage, stream);
        Err(no_device_io(self.kind()))
    }

    /// A workspace for `problem` whose buffers will live in caller memory, and the bytes that
    /// memory must hold. Planned once (buffers and GEMM plans); each
    /// [`Backend::forward`] binds it to the span its I/O gives. `limit` caps its bytes.
    fn caller_workspace(
        &self,
        prepared: &Self::Prepared,
        problem: &Problem,
        limit: Option<u64>,
    ) -> Result<(Self::Workspace, u64)> {
        let _ = (prepared, problem, limit);
        Err(no_device_io(self.kind()))
    }

    /// Block until all enqueued work has finished, surfacing any deferred device error.
    fn synchronize(&self) -> Result<()>;

    /// Free and total device memory, where the backend can tell.
    fn memory_info(&self) -> Result<Option<MemoryInfo>>;

    /// Measures the GEMM and copy ceilings of this device (takes a second or two).
    fn measure_ceilings(&self) -> Result<Ceilings>;

    /// Milliseconds the work enqueued by `work` takes on the device. GPU backends time with
    /// device events around it; the default synchronises and uses the host clock.
    fn elapsed_ms(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        self.synchronize()?;
        let start = std::time::Instant::now();
        work()?;
        self.synchronize()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }

    /// Milliseconds the device spends on the work `work` enqueues, with the host's time to enqueue
    /// it hidden: the stream is held until `work` has returned, so device events around the work
    /// see its launches back to back, as a stream that a model keeps busy does. [`elapsed_ms`]
    /// (events around work enqueued on an idle device) counts the host's time before the first
    /// launch too. Only the CUDA backend holds its stream; the others refuse.
    ///
    /// [`elapsed_ms`]: Backend::elapsed_ms
    fn held_elapsed_ms(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let _ = work;
        Err(Error::Unsupported { backend: self.kind(), what: "timing with the stream held".into() })
    }

    /// Peak bytes this backend has had allocated on its device since the last
    /// [`Backend::reset_peak_memory`] (weights, workspaces and buffers), where it tracks them.
    fn peak_memory(&self) -> Option<u64> {
        None
    }

    /// Starts a new high-water mark for [`Backend::peak_memory`] at what is allocated now.
    fn reset_peak_memory(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Direction, Formulation, Shape};

    fn problem(c: usize, in_place: bool) -> Problem {
        let config = Config::new(Formulation::GpuMode, c, 128).unwrap();
        let mut p = Problem::new(config, Shape::new(1, 32), Direction::Outgoing, false).unwrap();
        p.in_place = in_place;
        p
    }

    #[test]
    fn device_forward_checks_name_what_is_wrong() {
        let p = problem(128, false);
        assert!(check_device_forward(&p.config, &p, 0x1000, 0, 0x2000).is_ok());
        let other = problem(256, false).config;
        let e = check_device_forward(&other, &p, 0x1000, 0, 0x2000).unwrap_err().to_string();
        assert!(e.contains("weights prepared for"), "{e}");
        let e = check_device_forward(&p.config, &p, 0x1000, 0, 0x1000).unwrap_err().to_string();
        assert!(e.contains("must not alias x"), "{e}");
        let e = check_device_forward(&p.config, &p, 0x1000, 0x3008, 0x2000).unwrap_err().to_string();
        assert!(e.contains("mask must be 16-byte aligned"), "{e}");
        let q = problem(128, true);
        assert!(check_device_forward(&q.config, &q, 0x1000, 0, 0x1000).is_ok());
        let e = check_device_forward(&q.config, &q, 0x1000, 0, 0x2000).unwrap_err().to_string();
        assert!(e.contains("needs y = x"), "{e}");
    }
}
