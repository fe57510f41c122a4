//! The conformance suite (tests/conformance/mod.rs) on the CPU backend.
#[macro_use]
mod conformance;
conformance_suite!(conformance::device_or_skip("cpu", Ok(trimul::Device::cpu())), conformance::Profile::CPU_F32);
