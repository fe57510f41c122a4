//! The shared conformance suite on the CUDA backend (skips visibly without a device).
#![cfg(feature = "cuda")]
#[macro_use]
#[allow(dead_code)] // the CPU profile constant is not used here
mod conformance;
conformance_suite!(conformance::device_or_skip("cuda", trimul::Device::cuda(0)), conformance::Profile::gpu_mode(5e-3));
