//! The HIP backend's device state, below its root (`mod.rs`) so that the backend's parts
//! (`backward.rs`) can reach it without importing the root: the backend handle and its shared
//! context (stream, rocBLAS handle, loaded kernels, kept buffers), the prepared weights, and the
//! small helpers every part uses.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use super::kernels::{self, HipFastPath, HipKernelOutput, KernelImage};
use super::result::{self, AllocTracker, BlasHandle, DeviceMem, Kernel, Stream};
use super::sys;
use crate::backend::backward_params::BackwardSizes;
use crate::backend::backward_steps::BackwardKernel;
use crate::backend::params::STAGE_THREADS;
use crate::backend::prepared::{DeviceBytes, PreparedTensors};
use crate::backend::DeviceInfo;
use crate::error::{Error, Result};
use crate::problem::Config;
use crate::validation::{Verdict, VerdictStore};

/// Byte that makes every f16 and f32 element a NaN: poisons buffers in checks.
pub(super) const POISON_BYTE: u8 = 0xFF;

/// A HIP device with its stream, rocBLAS handle and loaded kernels. Cheap to clone (shared).
#[derive(Clone)]
pub struct HipBackend {
    pub(super) ctx: Arc<Context>,
}

impl std::fmt::Debug for HipBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HipBackend({} {}, device {})", self.ctx.info.name, self.ctx.target_id, self.ctx.ordinal)
    }
}

pub(super) struct Context {
    // Drop order is field order: the rocBLAS handle and the modules go before the stream.
    /// rocBLAS handles are not thread-safe; the lock is held for a whole forward.
    pub(super) blas: Mutex<BlasHandle>,
    pub(super) kernels: Kernels,
    /// The MFMA output kernel, loaded when a layer first selects it.
    pub(super) mfma: Mutex<Option<Arc<Kernel>>>,
    /// The MFMA input kernel, loaded when a layer first selects it.
    pub(super) mfma_input: Mutex<Option<Arc<Kernel>>>,
    /// The ten backward kernels, loaded on the first backward.
    pub(super) backward: Mutex<Option<Arc<BackwardKernels>>>,
    /// The block the last backward's intermediates lived in, kept for the next backward of the
    /// same sizes (`Backend::free_backward_buffers` drops it).
    pub(super) backward_block: Mutex<Option<(BackwardSizes, DeviceMem)>>,
    pub(super) stream: Stream,
    pub(super) api: &'static sys::HipApi,
    pub(super) tracker: Arc<AllocTracker>,
    pub(super) poison: AtomicBool,
    /// `Some(on)` overrides `TRIMUL_HIP_MFMA` for layers prepared from now on.
    pub(super) mfma_setting: Mutex<Option<bool>>,
    /// The verdicts on the fast paths looked up or made in this process, per (path, C, H);
    /// `None` where the verdict file had none.
    pub(super) verdicts: Mutex<HashMap<(HipFastPath, usize, usize), Option<Verdict>>>,
    /// Where verdicts are kept between processes.
    pub(super) store: VerdictStore,
    /// Every stage compiled with hipRTC, prebuilt objects ignored.
    pub(super) force_rtc: bool,
    pub(super) ordinal: i32,
    /// Raw target id, e.g. `gfx942:sramecc+:xnack-`.
    pub(super) target_id: String,
    /// Normalised processor, e.g. `gfx942`.
    pub(super) arch: String,
    pub(super) info: DeviceInfo,
}

impl Drop for Context {
    fn drop(&mut self) {
        // Work still queued may use modules unloaded right after; wait for it.
        let _ = self.stream.synchronize();
    }
}

/// The portable stage kernels, loaded once per device.
pub(super) struct Kernels {
    pub(super) input_norm: Kernel,
    pub(super) input_gating: Kernel,
    pub(super) output_norm: Kernel,
    pub(super) output_gate: Kernel,
    pub(super) prepare_weights: Kernel,
    /// Where each came from, for `trimul info`.
    pub(super) origin: String,
}

/// The stages a layer runs: the fused input kernel or not, and the output path.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Stages {
    pub(super) fused_input: bool,
    pub(super) output: HipKernelOutput,
}

/// Weights fused, cast and uploaded for this device.
pub struct HipPrepared {
    pub(super) config: Config,
    /// Which prepared weights these are ([`super::next_weights_id`]).
    pub(super) id: u64,
    /// The f16 projections, f32 biases and LayerNorm parameters.
    pub(super) tensors: PreparedTensors<DeviceMem, DeviceMem>,
    pub(super) output: HipKernelOutput,
    pub(super) mfma: Option<Arc<Kernel>>,
    /// The fused input kernel, when the layer's forwards use it (one-pass and chunked plans).
    pub(super) input: Option<Arc<Kernel>>,
}

// The prepared weights' buffers (`backend/prepared.rs`).
impl DeviceBytes for DeviceMem {
    fn address(&self) -> u64 {
        self.addr()
    }

    fn byte_len(&self) -> u64 {
        self.bytes() as u64
    }
}

pub(super) fn poisoned<T>(_: std::sync::PoisonError<T>) -> Error {
    Error::InvalidArgument("a previous HIP call panicked while holding the device lock".into())
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

/// The code object (or source) holding the ten kernels (`hip/backward.hip`).
const STAGE: &str = "backward";

/// The backward kernels' entry points, loaded for one device.
pub(super) struct BackwardKernels(Vec<Kernel>);

impl BackwardKernels {
    /// The entry point of one step's kernel (its 16-bit one when `sixteen`).
    pub(super) fn kernel(&self, kernel: BackwardKernel, sixteen: bool) -> &Kernel {
        &self.0[kernel.index(sixteen)]
    }

    /// Loads the entry points from the `backward` stage's code object for `target_id`, or from
    /// its source compiled once with hipRTC (archs without a prebuilt object, or `force_rtc`).
    /// Unlike the forward's stages, a prebuilt object the runtime rejects is an error here, not
    /// a retry with hipRTC.
    pub(super) fn load(api: &'static sys::HipApi, target_id: &str, force_rtc: bool) -> Result<BackwardKernels> {
        if force_rtc {
            sys::hiprtc()?;
        }
        let arch = super::arch::normalize_arch(target_id).unwrap_or_default();
        let prebuilt = kernels::HIP_STAGES
            .iter()
            .find(|s| s.name == STAGE)
            .is_some_and(|s| s.code_objects.iter().any(|(a, _)| *a == arch));
        let avail = if force_rtc || !prebuilt {
            sys::hiprtc().map(|_| ()).map_err(|e| e.to_string())
        } else {
            Err("not needed".to_string())
        };
        let code: std::borrow::Cow<'static, [u8]> =
            match kernels::select(kernels::HIP_STAGES, STAGE, target_id, avail, force_rtc)? {
                KernelImage::Prebuilt { code, .. } => code.into(),
                KernelImage::Compile { source, options, .. } => {
                    result::rtc_compile(sys::hiprtc()?, source, STAGE, &options)?.into()
                }
            };
        let kernels = BackwardKernel::entries().map(|(k, sixteen)| Kernel::load(api, &code, &k.entry_name(sixteen)));
        Ok(BackwardKernels(kernels.collect::<Result<_>>()?))
    }
}

/// Launches `kernel` over `grid` blocks of `block` threads with `smem` bytes of LDS (HIP's limits
/// checked by [`geometry`]) and one argument, `params` by value.
///
/// # Safety
/// `P` is the struct `kernel` takes by value, and every device address in `params` is valid for
/// every access the kernel makes at this geometry until `stream` has run the launch.
pub(super) unsafe fn launch_by_value<P: Copy>(
    kernel: &Kernel,
    stream: sys::hipStream_t,
    grid: usize,
    block: u32,
    smem: usize,
    params: &P,
) -> Result<()> {
    let (grid, smem) = geometry(kernel, grid, smem)?;
    let mut p = *params;
    let mut args = [(&mut p as *mut P).cast::<c_void>()];
    // SAFETY: one argument, the kernel's parameter struct by value; its addresses are this
    // function's contract.
    unsafe { kernel.launch(stream, grid, block, smem, &mut args) }
}
