//! The conformance suite, written once and instantiated per backend.
//!
//! Every test body is a function of a [`Device`] and a [`Profile`] (the tolerances that backend
//! promises); [`conformance_suite!`] stamps each out as a `#[test]`. A backend's test file is
//! three lines:
//!
//! ```ignore
//! #[macro_use]
//! mod conformance;
//! conformance_suite!(conformance::device_or_skip("cuda", trimul::Device::cuda(0)), conformance::Profile::gpu_mode(5e-3));
//! ```
//!
//! Everything goes through the public API (`TriMul::new`, `forward`, `forward_into`) and is judged
//! against the f64 reference only ([`trimul::reference`]); backends never check each other.
//! Inputs are fresh each run: the base seed comes from the clock unless `TRIMUL_TEST_SEED` is set,
//! and every test prints the value that replays it.

use trimul::reference::{self, Comparison};
use trimul::suite::{self, Case, Dist, Inputs};

#[path = "../support/skip.rs"]
mod skip;
#[path = "../support/seed.rs"]
mod test_seed;
use test_seed::test_seed as seed;
use trimul::{Device, Direction, Error, Formulation, Linear, Options, Precision, Problem, Shape, TriMul, Weights};

/// What one backend promises.
#[derive(Copy, Clone, Debug)]
pub struct Profile {
    /// GPU MODE's elementwise rule: `|got − ref| ≤ atol + rtol·|ref|`.
    pub rtol: f64,
    pub atol: f64,
    /// Bound on `‖got − ref‖/‖ref‖`: the rule above alone lets a systematic error of 1% pass.
    pub max_rel_l2: f64,
    /// Relative and absolute bound between two calls that compute the same function by the
    /// backend's own routes (absent mask vs all-ones mask, zero biases vs none).
    pub equivalent: f64,
    /// Largest N of the GPU MODE cases to run: the f64 reference and the input generation cost
    /// CPU time whatever the backend (N = 1024, C = 768 is 3.2 GB of input per case).
    pub max_suite_n: usize,
    /// Whether the backend keeps left, right and t in 16 bits (the GPUs) rather than f32.
    pub half_intermediates: bool,
}

impl Profile {
    /// GPU MODE's `rtol = atol = 2e-2`, the given relative-L2 bound, suite cases with N ≤ 256.
    pub const fn gpu_mode(max_rel_l2: f64) -> Profile {
        Profile { rtol: 2e-2, atol: 2e-2, max_rel_l2, equivalent: 1e-6, max_suite_n: 256, half_intermediates: true }
    }

    /// The CPU backend computes in f32 with f64 LayerNorm statistics: measured relative L2 errors
    /// are 1.3e-7 to 3.9e-7 on every case up to N = 256, C = 768. 1e-5 leaves a 25× margin (and
    /// room for longer sums) while failing an f16 intermediate (~5e-4) or a wrong constant.
    pub const CPU_F32: Profile = Profile { half_intermediates: false, ..Profile::gpu_mode(1e-5) };
}

/// The device, or `None` after saying on stderr (past the test harness's capture, so it shows
/// in a normal `cargo test` run) why this backend's tests are skipped. With
/// `TRIMUL_REQUIRE_DEVICE` set a missing device is a failure instead, for machines that have one.
pub fn device_or_skip(name: &str, device: trimul::Result<Device>) -> Option<Device> {
    skip::poisoned_or_skip(name, device, |d| d.set_poison(true))
}

/// Stamps out every conformance test for one backend: `conformance_suite!(device, profile)` with
/// `device: Option<Device>` (see [`device_or_skip`]) and `profile: Profile`;
/// `conformance_suite!(device, profile, around = f)` runs each test body through
/// `f(test_name, &device, body)`, which may check what the body did ([`run_plain`] just runs it).
macro_rules! conformance_suite {
    ($device:expr, $profile:expr) => {
        conformance_suite!($device, $profile, around = conformance::run_plain);
    };
    ($device:expr, $profile:expr, around = $around:path) => {
        conformance_suite!(@tests $device, $profile, $around;
            suite_gpumode_outgoing,
            suite_gpumode_incoming,
            suite_af3_outgoing,
            suite_af3_incoming,
            n_equals_one,
            odd_n,
            odd_channel_widths,
            batch_of_three,
            all_zero_mask,
            layer_norms_in_the_eps_regime,
            absent_mask_equals_all_ones,
            af3_zero_biases_equal_no_biases,
            incoming_is_outgoing_of_the_transpose,
            nan_in_x_poisons_what_the_reference_poisons,
            nan_prefilled_output_is_overwritten,
            workspace_reuse_across_shapes,
            bad_lengths_are_shape_errors,
            mismatched_weights_are_weights_errors,
            inputs_are_not_modified,
            tight_budget_runs_in_chunks,
            in_place_equals_out_of_place,
            budget_below_the_minimum_is_out_of_memory,
            half_precision_io_matches_reference,
        );
    };
    (@tests $device:expr, $profile:expr, $around:path; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                if let Some(device) = $device {
                    $around(stringify!($name), &device, |d: &trimul::Device| conformance::$name(d, &$profile));
                }
            }
        )*
    };
}

/// Runs a conformance test's body as it is (what [`conformance_suite!`] does by default).
pub fn run_plain(_test: &str, device: &Device, body: impl FnOnce(&Device)) {
    body(device)
}

// ---------------------------------------------------------------------------------------------
// Seeds, inputs, runs

fn mix(seed: u64, k: u64) -> u64 {
    trimul::rand::Rng::new(seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64()
}

fn layer(device: &Device, weights: &Weights, direction: Direction) -> TriMul {
    TriMul::new(device, weights, Options::new(direction))
        .unwrap_or_else(|e| panic!("TriMul::new failed for valid weights: {e}"))
}

fn weights(case: &Case, f: Formulation, biases: bool, seed: u64) -> Weights {
    let mut w = Weights::random(case.config(f).expect("valid config"), biases, seed).expect("random weights");
    if case.c == 1 && case.h == 1 {
        without_cancellation(&mut w);
    }
    w
}

/// At C = H = 1 both LayerNorms output their bias β, so y is one number at every position, for
/// af3 `σ(w_g·β_in + b_g)·(w_p·β_out + b_p)`. Where the output bias nearly cancels its product,
/// the GPUs' f16 rounding of β_out and w_p (2⁻¹¹ relative, by design) is amplified without bound
/// in that number: TRIMUL_TEST_SEED=8351379529235391017 drew 2.171 − 2.107 and a 1.7% error,
/// inside GPU MODE's rule but past the relative-L2 bound, which exists to catch systematic errors
/// of a sum of many terms. Giving b_p its product's sign keeps that sum well conditioned, so the
/// bound still tests that width one is computed right. (The gate's sum needs nothing: σ damps
/// its error, σ' ≤ 1/4.)
fn without_cancellation(w: &mut Weights) {
    let product = w.out_proj.weight[0] * w.norm_out.bias[0];
    if let Some(b) = &mut w.out_proj.bias {
        b[0] = b[0].abs().copysign(product);
    }
}

fn problem(case: &Case, f: Formulation, d: Direction) -> Problem {
    case.problem(f, d).expect("valid problem")
}

fn forward(device: &Device, w: &Weights, d: Direction, inputs: &Inputs, shape: Shape) -> Vec<f32> {
    layer(device, w, d)
        .forward(&inputs.x, inputs.mask.as_deref(), shape)
        .unwrap_or_else(|e| panic!("forward failed on valid inputs: {e}"))
}

/// `Err(message)` unless the comparison passes GPU MODE's rule and the relative-L2 bound.
fn judge(label: &str, cmp: &Comparison, p: &Profile) -> Result<(), String> {
    if cmp.passed() && cmp.rel_l2 <= p.max_rel_l2 {
        eprintln!("ok   {label}: {cmp}");
        Ok(())
    } else {
        Err(format!("{label}: {cmp} (rel L2 bound {:.0e})", p.max_rel_l2))
    }
}

fn finish(test: &str, failures: Vec<String>) {
    assert!(failures.is_empty(), "{test}: {} failed:\n  {}", failures.len(), failures.join("\n  "));
}

/// Runs `case` on the device and checks it against the reference.
fn check_case(
    device: &Device,
    p: &Profile,
    case: &Case,
    f: Formulation,
    d: Direction,
    biases: bool,
    seed: u64,
) -> Result<(), String> {
    let w = weights(case, f, biases, mix(seed, 1));
    let inputs = suite::generate_inputs(case, mix(seed, 2));
    let y = forward(device, &w, d, &inputs, case.shape());
    let cmp = reference::check(&w, &problem(case, f, d), &inputs.x, inputs.mask.as_deref(), &y, p.rtol, p.atol)
        .map_err(|e| format!("reference failed: {e}"))?;
    let label = format!("{case} {f}{} {d}", if biases { "+biases" } else { "" });
    judge(&label, &cmp, p)
}

const FORMULATIONS: [Formulation; 2] = [Formulation::GpuMode, Formulation::Af3];
const DIRECTIONS: [Direction; 2] = [Direction::Outgoing, Direction::Incoming];

/// Every formulation and direction on each case; af3 alternates biases and none.
fn check_all_combinations(device: &Device, p: &Profile, test: &str, cases: &[Case]) {
    let s = seed(test);
    let mut failures = Vec::new();
    let mut k = 0u64;
    for case in cases {
        for f in FORMULATIONS {
            for d in DIRECTIONS {
                k += 1;
                let biases = f == Formulation::Af3 && k % 2 == 0;
                if let Err(e) = check_case(device, p, case, f, d, biases, mix(s, k)) {
                    failures.push(e);
                }
            }
        }
    }
    finish(test, failures);
}

/// `check(k, f, d, failures)` for the k-th of every (formulation, direction) pair, pushing what it
/// judges failed; the test fails at the end with all of them.
fn for_every_combination(test: &str, mut check: impl FnMut(u64, Formulation, Direction, &mut Vec<String>)) {
    let mut failures = Vec::new();
    for (k, (f, d)) in FORMULATIONS.iter().flat_map(|&f| DIRECTIONS.map(|d| (f, d))).enumerate() {
        check(k as u64, f, d, &mut failures);
    }
    finish(test, failures);
}

fn swap_ij<T: Copy>(v: &[T], shape: Shape, width: usize) -> Vec<T> {
    let n = shape.n;
    let mut out = v.to_vec();
    for b in 0..shape.batch {
        for i in 0..n {
            for j in 0..n {
                let (src, dst) = (((b * n + i) * n + j) * width, ((b * n + j) * n + i) * width);
                out[dst..dst + width].copy_from_slice(&v[src..src + width]);
            }
        }
    }
    out
}

/// `|a − b| ≤ tol·(1 + |b|)` everywhere, NaN only where both are NaN.
fn assert_equivalent(label: &str, a: &[f32], b: &[f32], tol: f64) {
    assert_eq!(a.len(), b.len());
    let bad: Vec<usize> = (0..a.len())
        .filter(|&k| {
            let (x, y) = (a[k] as f64, b[k] as f64);
            !(x.is_nan() && y.is_nan() || (x - y).abs() <= tol * (1.0 + y.abs()))
        })
        .collect();
    if let Some(&k) = bad.first() {
        panic!(
            "{label}: {} of {} elements differ by more than {tol:.0e}; first [{k}]: {} vs {}",
            bad.len(),
            a.len(),
            a[k],
            b[k]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// GPU MODE cases

fn suite_cases(p: &Profile, f: Formulation, d: Direction, test: &str, device: &Device) {
    let s = seed(test);
    let mut failures = Vec::new();
    for (k, case) in suite::test_cases().iter().enumerate().filter(|(_, c)| c.n <= p.max_suite_n) {
        // af3 alternates OpenFold-style biases and AF3/Boltz-style none.
        let biases = f == Formulation::Af3 && k % 2 == 0;
        if let Err(e) = check_case(device, p, case, f, d, biases, mix(s, k as u64)) {
            failures.push(e);
        }
    }
    finish(test, failures);
}

pub fn suite_gpumode_outgoing(device: &Device, p: &Profile) {
    suite_cases(p, Formulation::GpuMode, Direction::Outgoing, "suite_gpumode_outgoing", device);
}

pub fn suite_gpumode_incoming(device: &Device, p: &Profile) {
    suite_cases(p, Formulation::GpuMode, Direction::Incoming, "suite_gpumode_incoming", device);
}

pub fn suite_af3_outgoing(device: &Device, p: &Profile) {
    suite_cases(p, Formulation::Af3, Direction::Outgoing, "suite_af3_outgoing", device);
}

pub fn suite_af3_incoming(device: &Device, p: &Profile) {
    suite_cases(p, Formulation::Af3, Direction::Incoming, "suite_af3_incoming", device);
}

// ---------------------------------------------------------------------------------------------
// Edge shapes

pub fn n_equals_one(device: &Device, p: &Profile) {
    let cases = [Case::new(1, 2, 128, true, Dist::Normal), Case::new(1, 1, 128, false, Dist::Cauchy)];
    check_all_combinations(device, p, "n_equals_one", &cases);
}

/// N that no power-of-two tile divides.
pub fn odd_n(device: &Device, p: &Profile) {
    let cases = [Case::new(33, 1, 128, true, Dist::Normal), Case::new(127, 1, 128, false, Dist::Cauchy)];
    check_all_combinations(device, p, "odd_n", &cases);
}

/// C and H that no vector width divides; the API accepts any width from 1 to 4096.
pub fn odd_channel_widths(device: &Device, p: &Profile) {
    // C = H = 1 makes both LayerNorms constant (y ignores x); C = H = 2 is the narrowest layer
    // whose output depends on the contraction. But LN_H over two channels divides t0 − t1 by
    // about |t0 − t1|: where the two nearly cancel, 16-bit left, right and t (the GPUs) are
    // amplified up to 1/√eps ≈ 300 at an element, and with random inputs some positions do (the
    // fake ROCm gave 11 of 162 elements outside the tolerance, TRIMUL_TEST_SEED=
    // 8350585567461198324). H = 3 still goes wrong often enough: one element past the rule in
    // 2 of 25 seeds on the fake ROCm (TRIMUL_TEST_SEED=1021, 1023, 8350294169111282556: |Δ| 2.3e-2
    // to 3.4e-2 where t's three channels nearly agree), the same before and after the
    // twenty-ninth session. Such a backend takes H = 5 there (0 of 40 seeds); the f32 CPU takes
    // H = 2.
    let narrow = if p.half_intermediates { 5 } else { 2 };
    let cases = [
        Case { h: 19, ..Case::new(20, 2, 37, true, Dist::Normal) },
        Case { h: 1, ..Case::new(9, 1, 1, false, Dist::Normal) },
        Case { h: narrow, ..Case::new(9, 1, narrow, true, Dist::Normal) },
    ];
    check_all_combinations(device, p, "odd_channel_widths", &cases);
}

pub fn batch_of_three(device: &Device, p: &Profile) {
    check_all_combinations(device, p, "batch_of_three", &[Case::new(17, 3, 64, true, Dist::Cauchy)]);
}

/// All-zero mask: `left = right = 0`, so `t = 0` and `LN_H(t)` is the norm_out bias. The output
/// is the gate path alone, which is not zero.
pub fn all_zero_mask(device: &Device, p: &Profile) {
    let s = seed("all_zero_mask");
    let case = Case::new(40, 2, 128, true, Dist::Normal);
    for_every_combination("all_zero_mask", |k, f, d, failures| {
        let w = weights(&case, f, f == Formulation::Af3, mix(s, k));
        let mut inputs = suite::generate_inputs(&case, mix(s, 100 + k));
        inputs.mask = Some(vec![0.0; case.batch * case.n * case.n]);
        let y = forward(device, &w, d, &inputs, case.shape());
        let pr = problem(&case, f, d);
        let want = reference::forward(&w, &pr, &inputs.x, inputs.mask.as_deref()).expect("reference");
        assert!(want.iter().any(|v| v.abs() > 1e-2), "the reference output is ~0: the test would prove nothing");
        if let Err(e) = judge(&format!("{f} {d}"), &reference::compare(&y, &want, p.rtol, p.atol), p) {
            failures.push(e);
        }
    });
}

/// Both LayerNorms with variances near eps = 1e-5, where eps shapes the output: x scaled to
/// variance ~1e-5 and the left/right projections scaled down so that `t` is small too. On
/// ordinary inputs eps moves the output by ~3e-6 relative, below any sensible tolerance; here a
/// wrong eps (1e-6, or one applied outside the square root) fails by far.
pub fn layer_norms_in_the_eps_regime(device: &Device, p: &Profile) {
    let s = seed("layer_norms_in_the_eps_regime");
    let case = Case::new(32, 2, 128, true, Dist::Normal);
    for_every_combination("layer_norms_in_the_eps_regime", |k, f, d, failures| {
        let mut w = weights(&case, f, false, mix(s, k));
        for l in [&mut w.left_proj, &mut w.right_proj] {
            l.weight.iter_mut().for_each(|v| *v *= 0.02);
        }
        let mut inputs = suite::generate_inputs(&case, mix(s, 10 + k));
        inputs.x.iter_mut().for_each(|v| *v *= 3e-3);
        let y = forward(device, &w, d, &inputs, case.shape());
        let pr = problem(&case, f, d);
        let cmp = reference::check(&w, &pr, &inputs.x, inputs.mask.as_deref(), &y, p.rtol, p.atol).expect("reference");
        if let Err(e) = judge(&format!("{f} {d}"), &cmp, p) {
            failures.push(e);
        }
    });
}

pub fn absent_mask_equals_all_ones(device: &Device, p: &Profile) {
    let s = seed("absent_mask_equals_all_ones");
    let case = Case::new(48, 2, 128, false, Dist::Normal);
    for f in FORMULATIONS {
        for d in DIRECTIONS {
            let w = weights(&case, f, false, mix(s, 1));
            let mut inputs = suite::generate_inputs(&case, mix(s, 2));
            let none = forward(device, &w, d, &inputs, case.shape());
            inputs.mask = Some(vec![1.0; case.batch * case.n * case.n]);
            let ones = forward(device, &w, d, &inputs, case.shape());
            assert_equivalent(&format!("{f} {d}: no mask vs all-ones mask"), &none, &ones, p.equivalent);
        }
    }
}

pub fn af3_zero_biases_equal_no_biases(device: &Device, p: &Profile) {
    let s = seed("af3_zero_biases_equal_no_biases");
    let case = Case::new(40, 1, 128, true, Dist::Cauchy);
    let without = weights(&case, Formulation::Af3, false, mix(s, 1));
    let mut with = without.clone();
    for l in [
        &mut with.left_proj,
        &mut with.left_gate,
        &mut with.right_proj,
        &mut with.right_gate,
        &mut with.out_gate,
        &mut with.out_proj,
    ] {
        l.bias = Some(vec![0.0; l.out_features]);
    }
    assert!(with.has_biases() && !without.has_biases());
    let inputs = suite::generate_inputs(&case, mix(s, 2));
    for d in DIRECTIONS {
        let a = forward(device, &with, d, &inputs, case.shape());
        let b = forward(device, &without, d, &inputs, case.shape());
        assert_equivalent(&format!("af3 {d}: zero biases vs none"), &a, &b, p.equivalent);
    }
}

/// `incoming(x) = swap_ij(outgoing'(swap_ij(x)))`, where `swap_ij` exchanges i and j in x, the
/// mask and y, and outgoing' has the left and right weights exchanged: the outgoing sum over
/// the swapped input is `Σ_k left[k,j]·right[k,i]`, the incoming `t[j,i]`, so without the exchange
/// the identity does not hold (the reference's own test shows it). Both sides run on the
/// backend, through its two contraction routes.
pub fn incoming_is_outgoing_of_the_transpose(device: &Device, p: &Profile) {
    let s = seed("incoming_is_outgoing_of_the_transpose");
    let case = Case::new(37, 2, 64, true, Dist::Normal);
    let (shape, c) = (case.shape(), case.c);
    let mut failures = Vec::new();
    for (k, f) in FORMULATIONS.into_iter().enumerate() {
        let w = weights(&case, f, f == Formulation::Af3, mix(s, k as u64));
        let inputs = suite::generate_inputs(&case, mix(s, 10 + k as u64));
        let y_in = forward(device, &w, Direction::Incoming, &inputs, shape);

        let mut exchanged = w.clone();
        std::mem::swap(&mut exchanged.left_proj, &mut exchanged.right_proj);
        std::mem::swap(&mut exchanged.left_gate, &mut exchanged.right_gate);
        let swapped =
            Inputs { x: swap_ij(&inputs.x, shape, c), mask: inputs.mask.as_ref().map(|m| swap_ij(m, shape, 1)) };
        let y_out = swap_ij(&forward(device, &exchanged, Direction::Outgoing, &swapped, shape), shape, c);
        let want: Vec<f64> = y_out.iter().map(|&v| v as f64).collect();
        // Two f32 results, each within the profile of the truth: allow twice the L2 bound.
        let cmp = reference::compare(&y_in, &want, p.rtol, p.atol);
        if let Err(e) = judge(&format!("{f}"), &cmp, &Profile { max_rel_l2: 2.0 * p.max_rel_l2, ..*p }) {
            failures.push(e);
        }
    }
    finish("incoming_is_outgoing_of_the_transpose", failures);
}

/// A NaN in `x[b,i,k,·]` poisons `z`, `left`, `right` and the gate at `(b,i,k)`; the reference
/// says which outputs that reaches (row and column `i` of batch `b` outgoing, row and column `k`
/// plus `(b,i,k)` incoming). The backend must poison exactly those: no more (NaN leaking across
/// tiles or batches) and no fewer (a NaN silently dropped).
pub fn nan_in_x_poisons_what_the_reference_poisons(device: &Device, p: &Profile) {
    let s = seed("nan_in_x_poisons_what_the_reference_poisons");
    let mut failures = Vec::new();
    // Unmasked, and masked with the NaN at a position whose mask is 0: NaN·0 is NaN in the
    // reference (as in PyTorch), so a backend that skips masked positions would differ.
    for masked in [false, true] {
        let case = Case::new(24, 2, 128, masked, Dist::Normal);
        let (n, c) = (case.n, case.c);
        for (k, (f, d)) in FORMULATIONS.iter().flat_map(|&f| DIRECTIONS.map(|d| (f, d))).enumerate() {
            let k = k as u64 + if masked { 100 } else { 0 };
            let w = weights(&case, f, false, mix(s, k));
            let mut inputs = suite::generate_inputs(&case, mix(s, 10 + k));
            let (b, i, kk) = (1, 5, 17);
            inputs.x[((b * n + i) * n + kk) * c + 7] = f32::NAN;
            if let Some(m) = inputs.mask.as_mut() {
                m[(b * n + i) * n + kk] = 0.0;
            }
            let y = forward(device, &w, d, &inputs, case.shape());
            let want =
                reference::forward(&w, &problem(&case, f, d), &inputs.x, inputs.mask.as_deref()).expect("reference");
            let poisoned = want.iter().filter(|v| v.is_nan()).count();
            assert!(poisoned >= (2 * n - 1) * c, "{f} {d}: the reference poisons only {poisoned} values");
            assert!(want[..n * n * c].iter().all(|v| v.is_finite()), "{f} {d}: the reference poisons batch 0");
            let cmp = reference::compare(&y, &want, p.rtol, p.atol);
            let nans = y.iter().filter(|v| v.is_nan()).count();
            let what = format!("{f} {d} masked={masked} ({nans} NaN, reference {poisoned})");
            if let Err(e) = judge(&what, &cmp, p) {
                failures.push(e);
            }
        }
    }
    finish("nan_in_x_poisons_what_the_reference_poisons", failures);
}

/// `forward_into` must write every element of `y`: a NaN or huge value left over from the
/// caller's buffer must not survive.
pub fn nan_prefilled_output_is_overwritten(device: &Device, p: &Profile) {
    let s = seed("nan_prefilled_output_is_overwritten");
    let case = Case::new(33, 2, 128, true, Dist::Normal);
    for_every_combination("nan_prefilled_output_is_overwritten", |k, f, d, failures| {
        let w = weights(&case, f, false, mix(s, k));
        let inputs = suite::generate_inputs(&case, mix(s, 10 + k));
        let pr = problem(&case, f, d);
        let mut l = layer(device, &w, d);
        for fill in [f32::NAN, 1e30] {
            let mut y = vec![fill; inputs.x.len()];
            l.forward_into(&inputs.x, inputs.mask.as_deref(), &mut y, case.shape()).expect("forward_into");
            let cmp =
                reference::check(&w, &pr, &inputs.x, inputs.mask.as_deref(), &y, p.rtol, p.atol).expect("reference");
            if let Err(e) = judge(&format!("{f} {d} prefilled {fill}"), &cmp, p) {
                failures.push(e);
            }
        }
    });
}

/// One layer serves calls of different shapes, masked and not, and back: whatever it caches per
/// shape must follow.
pub fn workspace_reuse_across_shapes(device: &Device, p: &Profile) {
    let s = seed("workspace_reuse_across_shapes");
    let a = Case::new(48, 1, 128, false, Dist::Normal);
    let b = Case::new(20, 2, 128, true, Dist::Cauchy);
    let mut failures = Vec::new();
    for f in FORMULATIONS {
        for d in DIRECTIONS {
            let w = weights(&a, f, false, mix(s, 1));
            let mut l = layer(device, &w, d);
            for (k, case) in [a, b, a, b].iter().enumerate() {
                let inputs = suite::generate_inputs(case, mix(s, 10 + k as u64));
                let y = l.forward(&inputs.x, inputs.mask.as_deref(), case.shape()).expect("forward");
                let cmp =
                    reference::check(&w, &problem(case, f, d), &inputs.x, inputs.mask.as_deref(), &y, p.rtol, p.atol)
                        .expect("reference");
                if let Err(e) = judge(&format!("{f} {d} call {k} {case}"), &cmp, p) {
                    failures.push(e);
                }
            }
        }
    }
    finish("workspace_reuse_across_shapes", failures);
}

// ---------------------------------------------------------------------------------------------
// Bad inputs and the caller's data

fn expect_shape_error(r: trimul::Result<()>, names: &str) {
    match r {
        Err(Error::Shape(msg)) => assert!(msg.contains(names), "shape error does not name {names:?}: {msg}"),
        Err(e) => panic!("expected a shape error naming {names:?}, got {e}"),
        Ok(()) => panic!("expected a shape error naming {names:?}, the call succeeded"),
    }
}

pub fn bad_lengths_are_shape_errors(device: &Device, _p: &Profile) {
    let case = Case::new(8, 2, 16, true, Dist::Normal);
    let w = weights(&case, Formulation::GpuMode, false, 1);
    let inputs = suite::generate_inputs(&case, 2);
    let (x, m, shape) = (&inputs.x, inputs.mask.as_deref().expect("masked case"), case.shape());
    for d in DIRECTIONS {
        let mut l = layer(device, &w, d);
        let mut y = vec![0.0f32; x.len()];
        expect_shape_error(l.forward_into(&x[1..], Some(m), &mut y, shape), "x has");
        expect_shape_error(l.forward(&x[1..], Some(m), shape).map(drop), "x has");
        expect_shape_error(l.forward_into(x, Some(&m[1..]), &mut y, shape), "mask has");
        expect_shape_error(l.forward_into(x, Some(m), &mut y[1..], shape), "y has");
        let mut longer = vec![0.0f32; x.len() + 1];
        expect_shape_error(l.forward_into(x, Some(m), &mut longer, shape), "y has");
        expect_shape_error(l.forward_into(x, Some(m), &mut y, Shape::new(2, 0)), "N");
        expect_shape_error(l.forward_into(x, Some(m), &mut y, Shape::new(0, 8)), "B");
        // The layer still works after refusing bad calls.
        l.forward_into(x, Some(m), &mut y, shape).expect("valid call after bad ones");
    }
}

fn expect_weights_error(device: &Device, w: &Weights, what: &str) {
    match TriMul::new(device, w, Options::default()) {
        Err(Error::Weights(msg)) => assert!(msg.contains(what), "weights error does not name {what:?}: {msg}"),
        Err(e) => panic!("{what}: expected a weights error, got {e}"),
        Ok(_) => panic!("{what}: TriMul::new accepted inconsistent weights"),
    }
}

pub fn mismatched_weights_are_weights_errors(device: &Device, _p: &Profile) {
    let case = Case { h: 16, ..Case::new(8, 1, 32, false, Dist::Normal) };
    for f in FORMULATIONS {
        let good = weights(&case, f, false, 3);
        let mut w = good.clone();
        w.right_proj = Linear::new(vec![0.1; 8 * 32], None, 8, 32);
        expect_weights_error(device, &w, "right_proj");
        let mut w = good.clone();
        w.norm_out.weight.truncate(8);
        expect_weights_error(device, &w, "norm_out");
        let mut w = good.clone();
        w.out_proj = Linear::new(vec![0.1; 32 * 8], None, 32, 8);
        expect_weights_error(device, &w, "out_proj");
        let mut w = good.clone();
        w.left_gate.weight.pop();
        expect_weights_error(device, &w, "left_gate");
    }
    let mut w = weights(&case, Formulation::GpuMode, false, 4);
    w.out_gate.bias = Some(vec![0.0; 16]);
    expect_weights_error(device, &w, "out_gate");
}

pub fn inputs_are_not_modified(device: &Device, p: &Profile) {
    let s = seed("inputs_are_not_modified");
    let case = Case::new(32, 2, 128, true, Dist::Cauchy);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    for f in FORMULATIONS {
        for d in DIRECTIONS {
            let w = weights(&case, f, false, mix(s, 1));
            let inputs = suite::generate_inputs(&case, mix(s, 2));
            let (x0, m0) = (bits(&inputs.x), bits(inputs.mask.as_deref().expect("masked")));
            let w0 = w.clone();
            let mut l = layer(device, &w, d);
            let y1 = l.forward(&inputs.x, inputs.mask.as_deref(), case.shape()).expect("forward");
            let y2 = l.forward(&inputs.x, inputs.mask.as_deref(), case.shape()).expect("forward");
            assert_eq!(bits(&inputs.x), x0, "{f} {d}: x was modified");
            assert_eq!(bits(inputs.mask.as_deref().expect("masked")), m0, "{f} {d}: mask was modified");
            assert_eq!(w, w0, "{f} {d}: weights were modified");
            // Same inputs, same layer: the second call sees the same data (and no state from the first).
            assert_equivalent(&format!("{f} {d}: repeated call"), &y2, &y1, p.equivalent);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Memory budgets, chunked plans and in-place mode

/// How close a chunked or in-place result must be to the one-pass result of the same layer:
/// a GPU's GEMM library may pick other algorithms for the smaller chunked GEMMs, which moves an
/// f16 intermediate by an ulp (≈ 1e-3 relative) here and there; five ulps of room, far below what
/// a wrong chunk (an error of order 1) would produce.
const CHUNKED_EQUIVALENT: f64 = 5e-3;

/// The budget that leaves the workspace only its narrowest plan.
fn tightest_budget(l: &TriMul, shape: Shape, masked: bool, in_place: bool) -> u64 {
    l.memory_needs(shape, masked, in_place).expect("memory needs").min_total()
}

/// With the smallest budget the backend accepts, the forward runs its narrowest plan and matches
/// both the reference and the one-pass result of the same layer.
pub fn tight_budget_runs_in_chunks(device: &Device, p: &Profile) {
    let s = seed("tight_budget_runs_in_chunks");
    let cases = [Case::new(40, 2, 64, true, Dist::Normal), Case::new(33, 1, 128, true, Dist::Cauchy)];
    let mut failures = Vec::new();
    for (k, case) in cases.iter().enumerate() {
        for f in FORMULATIONS {
            for d in DIRECTIONS {
                let w = weights(case, f, f == Formulation::Af3, mix(s, k as u64));
                let inputs = suite::generate_inputs(case, mix(s, 10 + k as u64));
                let mut l = layer(device, &w, d);
                let one_pass = l.forward(&inputs.x, inputs.mask.as_deref(), case.shape()).expect("one-pass forward");
                let needs = l.memory_needs(case.shape(), case.masked, false).expect("needs");
                l.set_memory_budget(Some(tightest_budget(&l, case.shape(), case.masked, false)));
                let y = l.forward(&inputs.x, inputs.mask.as_deref(), case.shape()).expect("forward in the budget");
                let plan = l.exec_plan().expect("a plan after a forward");
                if needs.min_workspace < needs.one_pass_workspace {
                    // Out of place a GPU keeps left/right in y, so its narrowest plan may need
                    // one hidden pass; it still must not be the one-pass plan.
                    assert!(
                        plan.hidden_passes > 1 || plan.gate_recomputed,
                        "{case} {f} {d}: the tightest budget ran {}",
                        plan.describe()
                    );
                }
                assert!(plan.workspace_bytes <= needs.min_workspace, "{case} {f} {d}: {plan:?} vs {needs:?}");
                assert_equivalent(&format!("{case} {f} {d} chunked vs one pass"), &y, &one_pass, CHUNKED_EQUIVALENT);
                let cmp =
                    reference::check(&w, &problem(case, f, d), &inputs.x, inputs.mask.as_deref(), &y, p.rtol, p.atol)
                        .expect("reference");
                if let Err(e) = judge(&format!("{case} {f} {d} ({})", plan.describe()), &cmp, p) {
                    failures.push(e);
                }
            }
        }
    }
    finish("tight_budget_runs_in_chunks", failures);
}

/// `forward_in_place` leaves in `x` what `forward` returns, with and without a tight budget (the
/// tight one forces several hidden passes wherever the backend has them).
pub fn in_place_equals_out_of_place(device: &Device, p: &Profile) {
    let s = seed("in_place_equals_out_of_place");
    let case = Case::new(36, 2, 64, true, Dist::Normal);
    let mut failures = Vec::new();
    for (k, f) in FORMULATIONS.into_iter().enumerate() {
        for d in DIRECTIONS {
            let w = weights(&case, f, false, mix(s, k as u64));
            let inputs = suite::generate_inputs(&case, mix(s, 10 + k as u64));
            let mut l = layer(device, &w, d);
            let y = l.forward(&inputs.x, inputs.mask.as_deref(), case.shape()).expect("forward");
            for tight in [false, true] {
                let budget = tight.then(|| tightest_budget(&l, case.shape(), case.masked, true));
                l.set_memory_budget(budget);
                let mut xy = inputs.x.clone();
                l.forward_in_place(&mut xy, inputs.mask.as_deref(), case.shape()).expect("forward_in_place");
                let needs = l.memory_needs(case.shape(), case.masked, true).expect("needs");
                if tight && needs.min_workspace < needs.one_pass_workspace {
                    let plan = l.exec_plan().expect("plan");
                    assert!(plan.hidden_passes > 1, "{f} {d}: tight in-place budget ran {}", plan.describe());
                }
                assert_equivalent(&format!("{f} {d} in place (tight budget: {tight})"), &xy, &y, CHUNKED_EQUIVALENT);
                let cmp =
                    reference::check(&w, &problem(&case, f, d), &inputs.x, inputs.mask.as_deref(), &xy, p.rtol, p.atol)
                        .expect("reference");
                if let Err(e) = judge(&format!("{f} {d} in place, tight {tight}"), &cmp, p) {
                    failures.push(e);
                }
            }
        }
    }
    finish("in_place_equals_out_of_place", failures);
}

/// One byte under the smallest budget, and a budget below x + y alone: `OutOfMemory` naming
/// both byte counts, before anything is written to `y`.
pub fn budget_below_the_minimum_is_out_of_memory(device: &Device, _p: &Profile) {
    let case = Case::new(24, 1, 64, true, Dist::Normal);
    let w = weights(&case, Formulation::GpuMode, false, 5);
    let inputs = suite::generate_inputs(&case, 6);
    let mut l = layer(device, &w, Direction::Outgoing);
    let needs = l.memory_needs(case.shape(), true, false).expect("needs");
    for budget in [needs.min_total() - 1, needs.io / 2] {
        l.set_memory_budget(Some(budget));
        let mut y = vec![f32::NAN; inputs.x.len()];
        match l.forward_into(&inputs.x, inputs.mask.as_deref(), &mut y, case.shape()) {
            Err(Error::OutOfMemory { needed, available, what, .. }) => {
                assert_eq!(available, budget, "{what}");
                assert!(needed > budget && needed >= needs.min_total().min(needs.io), "{what}: {needed}");
                assert!(what.contains("budget"), "{what}");
            }
            other => panic!("budget {budget} < {}: expected OutOfMemory, got {other:?}", needs.min_total()),
        }
        assert!(y.iter().all(|v| v.is_nan()), "a refused forward wrote into y");
    }
    // The same layer still runs once the budget allows it.
    l.set_memory_budget(Some(needs.min_total()));
    l.forward(&inputs.x, inputs.mask.as_deref(), case.shape()).expect("forward within the minimum budget");
    // A budget that fits the in-place forward only: after an in-place forward has planned its
    // workspace, an out-of-place call (y on the device too) must not reuse it past the budget.
    let in_place = l.memory_needs(case.shape(), true, true).expect("needs in place");
    assert!(in_place.min_total() < needs.min_total(), "{in_place:?} {needs:?}");
    l.set_memory_budget(Some(in_place.min_total()));
    let mut xy = inputs.x.clone();
    l.forward_in_place(&mut xy, inputs.mask.as_deref(), case.shape()).expect("in place within its minimum");
    let mut y = vec![f32::NAN; inputs.x.len()];
    match l.forward_into(&inputs.x, inputs.mask.as_deref(), &mut y, case.shape()) {
        Err(Error::OutOfMemory { available, .. }) => assert_eq!(available, in_place.min_total()),
        other => panic!("out of place under the in-place minimum budget: expected OutOfMemory, got {other:?}"),
    }
}

/// One forward of `l` with x (already rounded to `io`) passed as `io` elements, out of place or
/// in place; y decoded to f32.
fn forward_half(
    l: &mut TriMul,
    io: Precision,
    x: &[f32],
    mask: Option<&[f32]>,
    shape: Shape,
    in_place: bool,
) -> Vec<f32> {
    fn run<T: trimul::IoElement>(
        l: &mut TriMul,
        x: Vec<T>,
        mask: Option<&[f32]>,
        shape: Shape,
        in_place: bool,
    ) -> trimul::Result<Vec<T>> {
        if in_place {
            let mut xy = x;
            l.forward_in_place(&mut xy, mask, shape)?;
            Ok(xy)
        } else {
            l.forward(&x, mask, shape)
        }
    }
    let r = match io {
        Precision::Bf16Io => run(l, x.iter().map(|&v| half::bf16::from_f32(v)).collect(), mask, shape, in_place)
            .map(|y| y.iter().map(|v| v.to_f32()).collect()),
        Precision::F16Io => run(l, x.iter().map(|&v| half::f16::from_f32(v)).collect(), mask, shape, in_place)
            .map(|y| y.iter().map(|v| v.to_f32()).collect()),
        other => panic!("not a 16-bit mode: {other}"),
    };
    r.unwrap_or_else(|e| panic!("{io} forward (in place: {in_place}) failed: {e}"))
}

/// bf16 and f16 x and y (`forward::<half::bf16>` etc.): out of place, in place and under the
/// tightest budget, each against the f64 reference of the rounded x. y carries one more
/// rounding than an f32 result, which the relative-L2 bound allows for (2^-9 relative for bf16,
/// 2^-12 for f16, as an RMS over many elements about half that).
pub fn half_precision_io_matches_reference(device: &Device, p: &Profile) {
    let s = seed("half_precision_io_matches_reference");
    let cases = [Case::new(40, 2, 64, true, Dist::Normal), Case::new(33, 1, 128, false, Dist::Cauchy)];
    let mut failures = Vec::new();
    for (k, case) in cases.iter().enumerate() {
        let d = if k == 0 { Direction::Outgoing } else { Direction::Incoming };
        for f in FORMULATIONS {
            let w = weights(case, f, f == Formulation::Af3, mix(s, k as u64));
            let inputs = suite::generate_inputs(case, mix(s, 10 + k as u64));
            for io in [Precision::Bf16Io, Precision::F16Io] {
                let rounding = if io == Precision::Bf16Io { 2e-3 } else { 3e-4 };
                let bound = Profile { max_rel_l2: p.max_rel_l2 + rounding, ..*p };
                let x: Vec<f32> = inputs.x.iter().map(|&v| io.round(v)).collect();
                let mask = inputs.mask.as_deref();
                let mut l = layer(device, &w, d);
                let mut runs = Vec::new();
                for (label, in_place, tight) in
                    [("out of place", false, false), ("in place", true, false), ("tightest budget", false, true)]
                {
                    let needs = l.memory_needs_io(case.shape(), case.masked, in_place, io).expect("needs");
                    l.set_memory_budget(tight.then(|| needs.min_total()));
                    let y = forward_half(&mut l, io, &x, mask, case.shape(), in_place);
                    runs.push((label, l.exec_plan().expect("plan").describe(), y));
                }
                for (label, plan, got) in &runs {
                    let cmp =
                        reference::check(&w, &problem(case, f, d), &x, mask, got, p.rtol, p.atol).expect("reference");
                    let label = format!("{case} {f} {d} {io} {label} ({plan})");
                    if let Err(e) = judge(&label, &cmp, &bound) {
                        failures.push(e);
                    }
                }
            }
        }
    }
    finish("half_precision_io_matches_reference", failures);
}
