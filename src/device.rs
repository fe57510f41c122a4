//! The backend chosen at run time: [`Device`] holds one of the compiled backends, found by
//! probing the vendor libraries (HIP, then CUDA, then the CPU) or named by `TRIMUL_BACKEND`.
//!
//! It sits above the backends (it names each of them) and below the public API that builds
//! layers on it; the backends themselves know nothing of it.

#[cfg(feature = "cuda")]
use crate::backend::cuda;
#[cfg(feature = "rocm")]
use crate::backend::hip;
use crate::backend::{cpu, Backend, Ceilings, DeviceInfo, MemoryInfo, BACKEND_ENV};
use crate::error::{BackendKind, Error, Result};

/// A backend chosen at run time.
#[derive(Clone)]
#[non_exhaustive]
pub enum Device {
    /// The CPU backend.
    Cpu(cpu::CpuBackend),
    /// An NVIDIA GPU (`--features cuda`).
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaBackend),
    /// An AMD GPU (`--features rocm`).
    #[cfg(feature = "rocm")]
    Hip(hip::HipBackend),
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({})", self.kind())
    }
}

/// Forwards an expression to whichever backend's value `$value` holds, for an enum with one
/// variant per backend (`Cpu`, `Cuda`, `Hip`, each compiled in with its feature): a [`Device`],
/// a [`TriMul`](crate::TriMul).
macro_rules! with_backend {
    ($enum:ident, $value:expr, $b:ident => $body:expr) => {
        match $value {
            $enum::Cpu($b) => $body,
            #[cfg(feature = "cuda")]
            $enum::Cuda($b) => $body,
            #[cfg(feature = "rocm")]
            $enum::Hip($b) => $body,
        }
    };
}
pub(crate) use with_backend;

impl Device {
    /// The CPU backend (always available).
    pub fn cpu() -> Device {
        Device::Cpu(cpu::CpuBackend::new())
    }

    /// CUDA device `ordinal`, or an error saying why not (not compiled in, library missing, no device).
    pub fn cuda(ordinal: usize) -> Result<Device> {
        #[cfg(feature = "cuda")]
        {
            cuda::CudaBackend::new(ordinal).map(Device::Cuda)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ordinal;
            Err(Error::NotCompiled { backend: BackendKind::Cuda, feature: "cuda" })
        }
    }

    /// HIP device `ordinal`, or an error saying why not.
    pub fn hip(ordinal: usize) -> Result<Device> {
        #[cfg(feature = "rocm")]
        {
            hip::HipBackend::new(ordinal).map(Device::Hip)
        }
        #[cfg(not(feature = "rocm"))]
        {
            let _ = ordinal;
            Err(Error::NotCompiled { backend: BackendKind::Hip, feature: "rocm" })
        }
    }

    /// Device 0 of the given backend.
    pub fn of_kind(kind: BackendKind) -> Result<Device> {
        match kind {
            BackendKind::Cpu => Ok(Device::cpu()),
            BackendKind::Cuda => Device::cuda(0),
            BackendKind::Hip => Device::hip(0),
        }
    }

    /// The backend named by `TRIMUL_BACKEND` if set (an error if it is unusable), otherwise the
    /// first usable of HIP, CUDA, CPU.
    pub fn detect() -> Result<Device> {
        match std::env::var(BACKEND_ENV) {
            Ok(v) if !v.trim().is_empty() => {
                let kind: BackendKind =
                    v.parse().map_err(|e: Error| Error::InvalidArgument(format!("{BACKEND_ENV}={v:?}: {e}")))?;
                Device::of_kind(kind)
            }
            // Set but unreadable is a mistake to report, not a variable to ignore.
            Err(std::env::VarError::NotUnicode(v)) => Err(Error::InvalidArgument(format!(
                "{BACKEND_ENV}={v:?} is not valid UTF-8: expected cpu, cuda or hip"
            ))),
            _ => Ok(Device::detect_auto()),
        }
    }

    /// The best usable backend, ignoring the environment: HIP, then CUDA, then CPU.
    pub fn detect_auto() -> Device {
        Device::hip(0).or_else(|_| Device::cuda(0)).unwrap_or_else(|_| Device::cpu())
    }

    /// `Some(kind)` picks that backend (error if unusable); `None` means [`Device::detect`].
    pub fn select(kind: Option<BackendKind>) -> Result<Device> {
        match kind {
            Some(k) => Device::of_kind(k),
            None => Device::detect(),
        }
    }

    /// Tries every backend and reports what it found or why it is unusable, in detection order.
    pub fn probe_all() -> Vec<(BackendKind, Result<DeviceInfo>)> {
        BackendKind::ALL.iter().map(|&k| (k, Device::of_kind(k).map(|d| d.info()))).collect()
    }

    /// Backends compiled into this build.
    pub fn compiled() -> Vec<BackendKind> {
        let mut v = vec![BackendKind::Cpu];
        if cfg!(feature = "cuda") {
            v.push(BackendKind::Cuda);
        }
        if cfg!(feature = "rocm") {
            v.push(BackendKind::Hip);
        }
        v
    }

    /// Which backend this device is.
    pub fn kind(&self) -> BackendKind {
        with_backend!(Device, self, b => b.kind())
    }

    /// Device, arch and library versions ([`Backend::info`]).
    pub fn info(&self) -> DeviceInfo {
        with_backend!(Device, self, b => b.info())
    }

    /// Blocks until the device has finished the work enqueued on the backend's stream.
    pub fn synchronize(&self) -> Result<()> {
        with_backend!(Device, self, b => b.synchronize())
    }

    /// Free and total device memory, where the backend can tell.
    pub fn memory_info(&self) -> Result<Option<MemoryInfo>> {
        with_backend!(Device, self, b => b.memory_info())
    }

    /// See [`Backend::measure_ceilings`].
    pub fn measure_ceilings(&self) -> Result<Ceilings> {
        with_backend!(Device, self, b => b.measure_ceilings())
    }

    /// See [`Backend::elapsed_ms`].
    pub fn elapsed_ms(&self, work: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        with_backend!(Device, self, b => b.elapsed_ms(work))
    }

    /// See [`Backend::peak_memory`].
    pub fn peak_memory(&self) -> Option<u64> {
        with_backend!(Device, self, b => b.peak_memory())
    }

    /// See [`Backend::reset_peak_memory`].
    pub fn reset_peak_memory(&self) {
        with_backend!(Device, self, b => b.reset_peak_memory())
    }

    /// Fill outputs and intermediates with NaN before each forward (GPU backends), so that an
    /// element a kernel fails to write cannot pass a check by holding a stale value. A no-op on
    /// the CPU, whose buffers are the caller's host memory (a caller pre-fills `y` itself).
    pub fn set_poison(&self, on: bool) {
        match self {
            Device::Cpu(_) => {
                let _ = on;
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => b.set_poison(on),
            #[cfg(feature = "rocm")]
            Device::Hip(b) => b.set_poison(on),
        }
    }
}
