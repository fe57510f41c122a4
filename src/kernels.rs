//! Kernels embedded at build time, looked up by stage name.
//!
//! `build.rs` writes one table per vendor: for each stage the include-expanded source (always,
//! for run-time compilation) and, when a compiler was found at build time and worked, the compiled
//! binary (a CUDA fatbin; HIP code objects per arch). `CUDA_BUILD` and `HIP_BUILD` say in words
//! whether the kernels are prebuilt or compiled at run time (NVRTC, hipRTC) and why; a device's
//! `kernels` entry in [`DeviceInfo::versions`](crate::DeviceInfo) (and `trimul info`) repeats it
//! with what was loaded.

/// One CUDA stage: `cuda/<name>.cu`.
#[derive(Copy, Clone, Debug)]
pub struct EmbeddedStage {
    /// The stage's file stem (`cuda/<name>.cu`).
    pub name: &'static str,
    /// Source with `common/` includes expanded (compiles under NVRTC with no include path).
    pub source: &'static str,
    /// Fatbin (sm_80, sm_90a, compute_80 PTX) when nvcc was found at build time.
    pub binary: Option<&'static [u8]>,
}

#[cfg(feature = "cuda")]
mod cuda_table {
    use super::EmbeddedStage;
    include!(concat!(env!("OUT_DIR"), "/cuda_kernels.rs"));
}
#[cfg(feature = "cuda")]
pub use cuda_table::{CUDA_BUILD, CUDA_STAGES};

/// Whether every CUDA stage is prebuilt (an nvcc fatbin); `false` when NVRTC compiles them the
/// first time a device is opened in a process.
#[cfg(feature = "cuda")]
pub fn cuda_prebuilt() -> bool {
    CUDA_STAGES.iter().all(|s| s.binary.is_some())
}

/// One HIP stage: `hip/<name>.hip`.
#[derive(Copy, Clone, Debug)]
pub struct EmbeddedHipStage {
    /// File stem, which is also the kernel's `extern "C"` name.
    pub name: &'static str,
    /// Source with `#include "…"` lines expanded (compiles under hipRTC with no include path).
    pub source: &'static str,
    /// `(processor, linked code object)` for each arch clang built it for (gfx942, gfx90a), empty
    /// when the build had no clang with the AMDGPU target.
    pub code_objects: &'static [(&'static str, &'static [u8])],
}

#[cfg(feature = "rocm")]
mod hip_table {
    use super::EmbeddedHipStage;
    include!(concat!(env!("OUT_DIR"), "/hip_kernels.rs"));
}
#[cfg(feature = "rocm")]
pub use hip_table::{HIP_BUILD, HIP_PREBUILT_ARCHS, HIP_STAGES};

/// The stage called `name` in `table`.
pub fn find(table: &'static [EmbeddedStage], name: &str) -> Option<&'static EmbeddedStage> {
    table.iter().find(|s| s.name == name)
}
