//! The shared conformance suite on the HIP backend running on the fake ROCm (see
//! tests/hip_fake_rocm.rs), twice: `mfma_output` with both MFMA kernels forced on (each test's
//! launch record shows they ran), `rocblas_output` with both off (the staged kernels and rocBLAS,
//! with the same check that no MFMA kernel ran). The kernels run in a CPU emulation; both halves
//! take a few minutes on 2 cores and run in CI.
//!
//! The GPU MODE cases are limited to N ≤ 32 here; the rest of the suite runs as on a device.
#![cfg(feature = "rocm")]

#[path = "hip_emu/fake.rs"]
mod fake;

#[macro_use]
#[allow(dead_code)] // the CPU profile constant is not used here
mod conformance;

/// The HIP backend on the fake, with both MFMA kernels or the staged kernels and rocBLAS, if
/// buildable.
fn hip_on_fake(mfma: bool) -> Option<trimul::Device> {
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

/// Runs one conformance test with both MFMA kernels off, then shows from this thread's launch
/// record that its forwards launched neither.
fn through_staged_kernels(test: &str, device: &trimul::Device, body: impl FnOnce(&trimul::Device)) {
    let mfma = ["input_projection", "output_projection"];
    let before = mfma.map(fake::thread_launches);
    body(device);
    assert_eq!(mfma.map(fake::thread_launches), before, "{test}: an MFMA kernel ran with both turned off");
}

mod rocblas_output {
    use super::*;
    conformance_suite!(hip_on_fake(false), PROFILE, around = through_staged_kernels);
}

/// The staged kernels the MFMA kernels replace.
const STAGED: [&str; 4] = ["input_norm", "input_gating", "output_norm", "output_gate"];

/// Runs one conformance test with both MFMA kernels on, then shows from this thread's part of the
/// fake's launch record (a launch runs on the thread that makes it) that the test's forwards ran
/// them: both kernels and none of the staged kernels they replace, the chunked plans' windowed
/// launches of the input kernel where the test runs a tight budget. Only `odd_channel_widths`
/// runs the staged kernels: none of its widths suits either MFMA kernel (C = 37, 1, 2: no multiple
/// of 4 for the input kernel's 8-byte loads; H = 19, 1, 2: no multiple of 8, its K step).
fn through_mfma_kernels(test: &str, device: &trimul::Device, body: impl FnOnce(&trimul::Device)) {
    const INPUT: &str = "input_projection";
    const PART: &str = "input_projection (part)";
    const OUTPUT: &str = "output_projection";
    let kernels = [INPUT, PART, OUTPUT, STAGED[0], STAGED[1], STAGED[2], STAGED[3]];
    let before = kernels.map(fake::thread_launches);
    body(device);
    let ran = |k: &str| {
        let i = kernels.iter().position(|&n| n == k).expect("a recorded kernel");
        fake::thread_launches(k) - before[i]
    };
    let (expected, staged): (&[&str], &[&str]) = match test {
        // Refused before anything is launched.
        "bad_lengths_are_shape_errors" | "mismatched_weights_are_weights_errors" => (&[], &STAGED),
        "odd_channel_widths" => (&[], &[]),
        // Budgets that force hidden passes and row chunks.
        "tight_budget_runs_in_chunks"
        | "in_place_equals_out_of_place"
        | "half_precision_io_matches_reference"
        | "budget_below_the_minimum_is_out_of_memory" => (&[INPUT, PART, OUTPUT], &STAGED),
        _ => (&[INPUT, OUTPUT], &STAGED),
    };
    for k in expected {
        assert!(ran(k) > 0, "{test}: its forwards never launched {k}");
    }
    for k in staged {
        assert_eq!(ran(k), 0, "{test}: a forward ran the staged {k} where an MFMA kernel applies");
    }
}

mod mfma_output {
    use super::*;
    conformance_suite!(hip_on_fake(true), PROFILE, around = through_mfma_kernels);
}
