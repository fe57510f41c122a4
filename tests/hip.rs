//! The conformance suite on the HIP backend with its default output path (rocBLAS). Skips with a
//! visible message without an AMD GPU (a failure with `TRIMUL_REQUIRE_DEVICE` set).
#![cfg(feature = "rocm")]
#[macro_use]
#[allow(dead_code)] // the CPU profile constant is not used here
mod conformance;
conformance_suite!(conformance::device_or_skip("hip", trimul::Device::hip(0)), conformance::Profile::gpu_mode(5e-3));
