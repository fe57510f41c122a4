//! The CUDA device the GPU tests run on, with NaN poisoning on, or `None` with a visible
//! message when the build or the machine has none (`TRIMUL_REQUIRE_DEVICE` makes that a failure).

use trimul::backend::cuda::CudaBackend;

#[path = "skip.rs"]
mod skip;

/// GPU MODE's rule: every element within TOL + TOL·|ref|.
pub const TOL: f64 = 2e-2;
/// f16 intermediates with f32 accumulation land near 5e-4 (SPEC.md); this leaves room for Cauchy
/// inputs without letting a wrong layout (error ~1) through.
pub const MAX_REL_L2: f64 = 5e-3;

pub fn cuda() -> Option<CudaBackend> {
    skip::poisoned_or_skip("CUDA", CudaBackend::new(0), |b| b.set_poison(true))
}
