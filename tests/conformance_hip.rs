//! The conformance suite on the HIP backend, on both output paths: the default one (rocBLAS), and
//! the fused MFMA output kernel, which is opt-in until this passes on hardware. Skips with a
//! visible message without an AMD GPU (a failure with `TRIMUL_REQUIRE_DEVICE` set), and the MFMA
//! half on a GPU without MFMA instructions. The same suite on the fake ROCm is
//! `tests/conformance_hip_fake.rs` (a binary of its own: the fake takes over the process's HIP
//! libraries).
#![cfg(feature = "rocm")]
#[macro_use]
#[allow(dead_code)] // the CPU profile constant is not used here
mod conformance;

mod default_output {
    use super::*;
    conformance_suite!(
        conformance::device_or_skip("hip", trimul::Device::hip(0)),
        conformance::Profile::gpu_mode(5e-3)
    );
}

mod mfma_output {
    use super::*;

    fn hip_mfma() -> Option<trimul::Device> {
        let backend = trimul::backend::hip::HipBackend::new(0).inspect(|b| b.set_mfma_kernels(Some(true)));
        let mfma = backend.as_ref().is_ok_and(|b| b.has_mfma());
        let device = conformance::device_or_skip("hip (MFMA output)", backend.map(trimul::Device::Hip))?;
        let arch = device.info().arch;
        if !mfma {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED: hip (MFMA output): {arch} has no MFMA instructions");
            return None;
        }
        Some(device)
    }

    conformance_suite!(hip_mfma(), conformance::Profile::gpu_mode(5e-3));
}
