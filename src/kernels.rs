//! Kernels embedded at build time, looked up by stage name.
//!
//! `build.rs` writes one table per vendor: for each stage the include-expanded source (always,
//! for run-time compilation) and, when a compiler was found at build time, the compiled binary
//! (a CUDA fatbin; HIP code objects per arch).

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
