//! The shared conformance suite on the HIP backend running on the fake ROCm (see
//! tests/hip_fake_rocm.rs), both output paths. Slow (the kernels run in a CPU emulation, one host
//! thread per GPU lane), so it runs only when asked:
//!
//! ```text
//! TRIMUL_FAKE_ROCM_CONFORMANCE=1 cargo test --features rocm --test conformance_hip_fake
//! ```
//!
//! The GPU MODE cases are limited to N ≤ 32 here; the rest of the suite runs as on a device.
#![cfg(feature = "rocm")]

#[path = "hip_emu/fake.rs"]
mod fake;

#[macro_use]
#[allow(dead_code)] // the CPU profile constant is not used here
mod conformance;

use std::io::Write;

const ENABLE: &str = "TRIMUL_FAKE_ROCM_CONFORMANCE";

/// The HIP backend on the fake, with the MFMA output kernel or rocBLAS, if enabled and buildable.
fn hip_on_fake(mfma: bool) -> Option<trimul::Device> {
    if std::env::var_os(ENABLE).is_none() {
        let _ = writeln!(std::io::stderr(), "SKIPPED: conformance on the fake ROCm is slow; set {ENABLE}=1 to run it");
        return None;
    }
    // The guard serialises with nothing else here (this binary never changes the fake's arch), so
    // it is released at once and the suite's tests run in parallel.
    drop(fake::fake()?);
    let backend = trimul::backend::hip::HipBackend::new(0).inspect(|b| {
        b.set_poison(true);
        b.set_mfma_kernels(Some(mfma));
    });
    conformance::device_or_skip("hip on the fake ROCm", backend.map(trimul::Device::Hip))
}

const PROFILE: conformance::Profile = conformance::Profile { max_suite_n: 32, ..conformance::Profile::gpu_mode(5e-3) };

mod rocblas_output {
    use super::*;
    conformance_suite!(hip_on_fake(false), PROFILE);
}

mod mfma_output {
    use super::*;
    conformance_suite!(hip_on_fake(true), PROFILE);
}
