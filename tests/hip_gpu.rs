//! The HIP backend on a real AMD GPU, checked against the f64 reference (`trimul::reference`).
//!
//! None of this has run yet: there was no AMD GPU where it was written. Every test is ignored so
//! that `cargo test` passes everywhere; on a machine with an MI300/MI200 run
//!
//! ```text
//! TRIMUL_REQUIRE_DEVICE=1 cargo test --release --features rocm --test hip_gpu -- --ignored --nocapture
//! ```
//!
//! (`TRIMUL_REQUIRE_DEVICE` turns "no device" into a failure instead of a visible skip). Both
//! output paths are checked: the default rocBLAS one and the MFMA kernel, which stays opt-in until
//! these tests pass on hardware. Inputs are fresh per run; each test prints its seed
//! (`TRIMUL_TEST_SEED` replays one).
#![cfg(feature = "rocm")]

use std::io::Write;

use trimul::backend::hip::HipBackend;
use trimul::backend::hip::HipKernelOutput;
use trimul::reference;
use trimul::suite::{self, Case, Dist};

#[path = "support/gpu_checks.rs"]
mod gpu_checks;
#[path = "support/skip.rs"]
mod skip;
#[path = "support/seed.rs"]
mod test_seed;
use gpu_checks::{check_case, MAX_REL_L2, TOL};
use test_seed::this_test_seed as seed;
use trimul::{Backend, Device, Direction, Formulation, Layer, Options, TriMul, Weights};

/// The backend with the given output path, or `None` after a visible skip (a failure with
/// `TRIMUL_REQUIRE_DEVICE` set).
fn hip(mfma: bool) -> Option<HipBackend> {
    skip::poisoned_or_skip("HIP", HipBackend::new(0), |b| {
        b.set_poison(true);
        b.set_mfma_kernels(Some(mfma));
    })
}

/// Runs `check` on the backend with each output path, rocBLAS and then MFMA (the flag), and
/// returns early after a visible skip when there is no device.
fn on_both_output_paths(mut check: impl FnMut(&HipBackend, bool)) {
    for mfma in [false, true] {
        let Some(b) = hip(mfma) else { return };
        check(&b, mfma);
    }
}

#[test]
#[ignore = "needs an AMD GPU: run `cargo test --features rocm -- --ignored`"]
fn device_info_names_an_amd_gpu_with_versions() {
    let Some(b) = hip(false) else { return };
    let info = b.info();
    eprintln!("{info:#?}");
    assert_eq!(info.vendor, "AMD");
    assert!(info.arch.starts_with("gfx") && !info.arch.contains(':'), "arch not normalised: {}", info.arch);
    assert!(info.compute_units > 0 && info.memory_bytes > 0);
    for key in ["HIP runtime", "rocBLAS", "target id", "kernels"] {
        let v = info.versions.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str()).unwrap_or("");
        assert!(!v.is_empty() && !v.starts_with("unknown"), "{key}: {v:?}");
    }
    let mem = b.memory_info().unwrap().unwrap();
    assert!(mem.free > 0 && mem.free <= mem.total);
}

#[test]
#[ignore = "needs an AMD GPU: run `cargo test --features rocm -- --ignored`"]
fn gpumode_suite_all_18_cases_rocblas_output() {
    let Some(b) = hip(false) else { return };
    let s = seed();
    for case in suite::test_cases() {
        check_case(&b, &case, Formulation::GpuMode, Direction::Outgoing, false, s);
    }
}

#[test]
#[ignore = "needs an AMD GPU: run `cargo test --features rocm -- --ignored`"]
fn gpumode_suite_all_18_cases_mfma_output() {
    let Some(b) = hip(true) else { return };
    let s = seed();
    let probe = Weights::random(suite::test_cases()[0].config(Formulation::GpuMode).unwrap(), false, 1).unwrap();
    if b.prepare(&probe).unwrap().output_path() != HipKernelOutput::Mfma {
        let _ = writeln!(std::io::stderr(), "SKIPPED: {} has no MFMA instructions", b.arch());
        return;
    }
    for case in suite::test_cases() {
        check_case(&b, &case, Formulation::GpuMode, Direction::Outgoing, false, s);
    }
}

#[test]
#[ignore = "needs an AMD GPU: run `cargo test --features rocm -- --ignored`"]
fn af3_with_and_without_biases_both_directions_both_output_paths() {
    let s = seed();
    on_both_output_paths(|b, _| {
        for case in [Case::new(64, 2, 256, true, Dist::Normal), Case::new(256, 1, 128, false, Dist::Cauchy)] {
            for dir in [Direction::Outgoing, Direction::Incoming] {
                check_case(b, &case, Formulation::Af3, dir, true, s);
                check_case(b, &case, Formulation::Af3, dir, false, s);
            }
        }
    });
}

#[test]
#[ignore = "needs an AMD GPU: run `cargo test --features rocm -- --ignored`"]
fn incoming_and_odd_sizes_both_output_paths() {
    let s = seed();
    on_both_output_paths(|b, mfma| {
        for n in [1, 33, 127, 1000] {
            for dir in [Direction::Outgoing, Direction::Incoming] {
                check_case(b, &Case::new(n, 1, 128, true, Dist::Normal), Formulation::GpuMode, dir, false, s);
            }
        }
        // C not a multiple of 32 (column tails in the MFMA kernel), H = 64, B = 3.
        let case = Case::new(33, 3, 72, true, Dist::Cauchy);
        let cfg = trimul::Config::new(Formulation::Af3, 72, 64).unwrap();
        let problem = trimul::Problem::new(cfg, case.shape(), Direction::Incoming, true).unwrap();
        let weights = Weights::random(cfg, true, s).unwrap();
        let inputs = suite::generate_inputs(&case, s ^ 1);
        let mut layer = Layer::new(b, &weights, Options::new(Direction::Incoming)).unwrap();
        let mut y = vec![f32::NAN; inputs.x.len()];
        layer.forward_into(&inputs.x, inputs.mask.as_deref(), &mut y, case.shape()).unwrap();
        let cmp = reference::check(&weights, &problem, &inputs.x, inputs.mask.as_deref(), &y, TOL, TOL).unwrap();
        assert!(cmp.passed() && cmp.rel_l2 <= MAX_REL_L2, "C=72 H=64 mfma={mfma}: {cmp}");
    });
}

#[test]
#[ignore = "needs an AMD GPU: run `cargo test --features rocm -- --ignored`"]
fn hiprtc_compiled_kernels_match_the_reference() {
    // The path every arch without a prebuilt object takes, exercised on this one.
    // Open the device the ordinary way first, so that "no GPU" skips like the other tests.
    if hip(false).is_none() {
        return;
    }
    let b = HipBackend::with_runtime_compilation(0).unwrap_or_else(|e| panic!("hipRTC path unavailable: {e}"));
    b.set_poison(true);
    eprintln!("kernels: {:?}", b.info().versions.iter().find(|(k, _)| k == "kernels"));
    let s = seed();
    check_case(&b, &Case::new(64, 2, 256, true, Dist::Normal), Formulation::GpuMode, Direction::Incoming, false, s);
    check_case(&b, &Case::new(48, 1, 128, false, Dist::Cauchy), Formulation::Af3, Direction::Outgoing, true, s);
}

#[test]
#[ignore = "needs an AMD GPU: run `cargo test --features rocm -- --ignored`"]
fn all_zero_mask_matches_reference() {
    let Some(b) = hip(false) else { return };
    gpu_checks::all_zero_mask_matches_reference(&b, 5, 6);
}

#[test]
#[ignore = "needs an AMD GPU: run `cargo test --features rocm -- --ignored`"]
fn device_buffer_forward_and_caller_stream_forward_agree_with_reference() {
    let Some(b) = hip(false) else { return };
    let case = Case::new(96, 2, 128, true, Dist::Normal);
    let problem = case.problem(Formulation::Af3, Direction::Incoming).unwrap();
    let weights = Weights::random(problem.config, true, 11).unwrap();
    let inputs = suite::generate_inputs(&case, 12);
    let mut layer = Layer::new(&b, &weights, Options::new(Direction::Incoming)).unwrap();
    gpu_checks::buffers_and_caller_stream_match(&b, &mut layer, &weights, &problem, &inputs);
}

#[test]
#[ignore = "needs an AMD GPU: run `cargo test --features rocm -- --ignored`"]
fn timing_ceilings_and_memory_accounting() {
    let Some(b) = hip(false) else { return };
    let c = b.measure_ceilings().unwrap();
    eprintln!("{c:?}");
    // MI300X: ~1300 TFLOP/s f16 dense peak, 5.3 TB/s; MI250X GCD: ~190, 1.6 TB/s. Loose bounds
    // that still catch a timer in the wrong unit.
    assert!(c.gemm_tflops > 20.0 && c.gemm_tflops < 3000.0, "{c:?}");
    assert!(c.copy_gbs > 200.0 && c.copy_gbs < 20_000.0, "{c:?}");
    b.reset_peak_memory();
    let case = Case::new(256, 1, 128, false, Dist::Normal);
    let weights = Weights::random(case.config(Formulation::GpuMode).unwrap(), false, 3).unwrap();
    let inputs = suite::generate_inputs(&case, 4);
    let device = Device::Hip(b.clone());
    let mut layer = TriMul::new(&device, &weights, Options::default()).unwrap();
    let y = layer.forward(&inputs.x, None, case.shape()).unwrap();
    assert!(y.iter().all(|v| v.is_finite()));
    let peak = b.peak_memory().unwrap();
    let ws = layer.workspace_bytes(case.shape(), false).unwrap();
    assert!(peak >= ws, "peak {peak} below the workspace {ws}");
}

#[test]
#[ignore = "needs an AMD GPU: run `cargo test --features rocm -- --ignored`"]
fn bad_inputs_are_errors_not_panics() {
    let Some(b) = hip(false) else { return };
    let device = Device::Hip(b);
    gpu_checks::bad_inputs_are_errors(&device);
    assert!(Device::hip(1000).is_err());
}
