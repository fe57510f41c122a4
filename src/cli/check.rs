//! `trimul check`: the GPU MODE correctness cases on one backend against the f64 reference.
//!
//! Every case gets fresh random inputs and weights derived from one printed seed (so a failure
//! can be replayed with `--seed`), and passes when every element is within
//! `atol + rtol·|ref|` (rtol = atol = 2e-2) with no NaN the reference lacks. Large cases are
//! compared on the reference's deterministic sample of positions (see `trimul::reference::check`).
//!
//! Unwritten output cannot pass by accident: the host `y` starts as NaN and GPU backends
//! NaN-poison their outputs and intermediates before every forward.
//!
//! With `--grad` it checks the backward pass instead: for a random `dy` (seeded like the
//! inputs) every gradient, of `x` and of each weight and bias, against
//! `trimul::reference::backward` in f64, passing when each tensor's relative L2 error is at
//! most [`GRAD_RTOL_L2`] with no NaN the reference lacks. Only cases with N ≤ [`GRAD_MAX_N`]
//! run: the reference keeps about twenty `B·N²·max(C, H)` f64 tensors.
//!
//! `--json` writes one object: `schema_version` ([`CHECK_SCHEMA_VERSION`]) first, then the tool
//! (name, version, commit), the backend and device, suite, formulation, direction, seed,
//! tolerances, pass and fail counts, and one entry per case (shape, seeds, the comparison or the
//! error). As for bench JSON, adding an optional field keeps the version; renaming, removing or
//! changing the meaning of a field bumps it.

use std::process::ExitCode;
use std::time::Instant;

use serde::Serialize;
use trimul::rand::Rng;
use trimul::report::{fmt_err, json_f64, ToolInfo};
use trimul::suite::{self, Case};
use trimul::{reference, BackendKind, Device, Direction, Formulation, Options, TriMul, Weights};

use super::args::{open_device, CheckArgs, CheckSuite};
use super::exit::{CliError, CliResult, EXIT_FAILED};
use super::output::{device_summary, emit, emit_json, Progress};
use super::seed::{clock_seed, SeedStream};

/// GPU MODE's tolerances.
const RTOL: f64 = 2e-2;
const ATOL: f64 = 2e-2;

/// A gradient passes when its relative L2 error against the f64 reference is at most this
/// (issue 28's bar for f32 I/O).
pub const GRAD_RTOL_L2: f64 = 2e-3;

/// `--grad` runs the cases with N up to this.
pub const GRAD_MAX_N: usize = 256;

/// Version of the `check --json` layout. Version 1 is the first to carry the field; files
/// without it come from earlier builds, with the same fields otherwise.
pub const CHECK_SCHEMA_VERSION: u32 = 1;

#[derive(Serialize)]
struct Report {
    schema_version: u32,
    tool: ToolInfo,
    backend: BackendKind,
    device: String,
    suite: &'static str,
    formulation: Formulation,
    direction: Direction,
    seed: u64,
    /// Whether the backward pass was checked (`--grad`) rather than the forward.
    grad: bool,
    /// The forward's rule (`--grad` runs do not use it).
    rtol: f64,
    atol: f64,
    /// With `--grad`: the largest relative L2 error a gradient may have.
    #[serde(skip_serializing_if = "Option::is_none")]
    grad_rel_l2_max: Option<f64>,
    passed: usize,
    failed: usize,
    cases: Vec<CaseResult>,
}

#[derive(Serialize)]
struct CaseResult {
    name: String,
    batch: usize,
    n: usize,
    c: usize,
    h: usize,
    masked: bool,
    dist: &'static str,
    /// Seeds of this case's inputs and weights (derived from the run's seed).
    input_seed: u64,
    weights_seed: u64,
    passed: bool,
    /// Absent when the forward or the reference failed; `error` says why.
    #[serde(skip_serializing_if = "Option::is_none")]
    comparison: Option<ComparisonJson>,
    /// Wall time of the forward on host slices, uploads and downloads included (with `--gpus`,
    /// the sharded forward's).
    #[serde(skip_serializing_if = "Option::is_none")]
    forward_ms: Option<f64>,
    /// With `--grad`: each gradient's comparison, in `trimul::Gradients::tensors` order.
    #[serde(skip_serializing_if = "Option::is_none")]
    gradients: Option<Vec<GradientJson>>,
    /// With `--gpus`: the largest difference between the sharded y and the one-GPU y.
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "json_opt_f64")]
    one_gpu_max_abs: Option<f64>,
    /// With `--gpus`: elements of the sharded y outside the tolerance around the one-GPU y.
    #[serde(skip_serializing_if = "Option::is_none")]
    one_gpu_bad: Option<usize>,
    /// With `--grad`: wall time of the backward on host slices.
    #[serde(skip_serializing_if = "Option::is_none")]
    backward_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Serialize)]
struct ComparisonJson {
    #[serde(serialize_with = "json_f64")]
    max_abs: f64,
    #[serde(serialize_with = "json_f64")]
    rel_l2: f64,
    /// Elements compared.
    checked: usize,
    /// Whether `checked` covers the whole output or the reference's sample of positions.
    sampled: bool,
    /// Elements outside tolerance (NaN mismatches included).
    bad: usize,
    nan_mismatch: usize,
    /// `[index in y, got, want]` of the element furthest past its tolerance.
    #[serde(skip_serializing_if = "Option::is_none")]
    worst: Option<(usize, f32, f64)>,
}

#[derive(Serialize)]
struct GradientJson {
    name: String,
    #[serde(serialize_with = "json_f64")]
    max_abs: f64,
    #[serde(serialize_with = "json_f64")]
    rel_l2: f64,
    nan_mismatch: usize,
    passed: bool,
}

pub fn run(args: &CheckArgs) -> CliResult {
    let device = open_device(args.backend)?;
    let gpus = args.gpus.map(|g| g as usize);
    if gpus.is_some() && (args.grad || device.kind() != BackendKind::Cuda) {
        return Err(CliError::usage(format!(
            "--gpus: the sharded forward runs on the CUDA backend{} (this is {})",
            if args.grad { ", forward only: no --grad" } else { "" },
            device.kind()
        )));
    }
    let formulation = Formulation::from(args.formulation);
    let direction = Direction::from(args.direction);
    let (suite_name, mut cases) = match args.suite {
        CheckSuite::Gpumode => ("gpumode", suite::test_cases()),
        CheckSuite::Quick => ("quick", suite::quick_test_cases()),
    };
    if args.grad {
        cases.retain(|c| c.n <= GRAD_MAX_N);
    }
    let seed = args.seed.unwrap_or_else(clock_seed);
    let info = device.info();
    let summary = device_summary(device.kind(), &info);

    let progress = Progress::bar(cases.len() as u64);
    if !args.json {
        progress.out(&format!(
            "trimul check: {} ({summary}), suite {suite_name} ({} cases), {formulation} {direction}, seed {seed}",
            device.kind(),
            cases.len()
        ))?;
        if args.grad {
            progress.out(&format!(
                "backward: every gradient within {GRAD_RTOL_L2:.0e} relative L2 of the f64 reference (cases with N ≤ {GRAD_MAX_N})"
            ))?;
            progress.out(&format!(
                "{:<28} {:<20} {:>9} {:>6} {:>9}",
                "case", "worst gradient", "rel L2", "result", "bwd ms"
            ))?;
        } else {
            progress
                .out(&format!("tolerance: every element within {ATOL:.0e} + {RTOL:.0e}·|ref| of the f64 reference"))?;
            progress.out(&format!(
                "{:<28} {:>9} {:>9} {:>10} {:<7} {:>6} {:>9}",
                "case", "max abs", "rel L2", "checked", "", "result", "fwd ms"
            ))?;
        }
    }
    device.set_poison(true);
    let mut seeds = SeedStream::new(seed);
    let mut results = Vec::with_capacity(cases.len());
    for case in &cases {
        progress.set_message(case.name());
        let (input_seed, weights_seed) = (seeds.next(), seeds.next());
        let result = if args.grad {
            run_grad_case(&CaseRun { device: &device, case, formulation, direction, input_seed, weights_seed, gpus })
        } else {
            run_case(&CaseRun { device: &device, case, formulation, direction, input_seed, weights_seed, gpus })
        };
        if !args.json {
            progress.out(&row(&result))?;
        }
        results.push(result);
        progress.inc(1);
    }
    device.set_poison(false);
    progress.finish();

    let passed = results.iter().filter(|r| r.passed).count();
    let failed = results.len() - passed;
    if args.json {
        emit_json(&Report {
            schema_version: CHECK_SCHEMA_VERSION,
            tool: ToolInfo::current(),
            backend: device.kind(),
            device: info.name,
            suite: suite_name,
            formulation,
            direction,
            seed,
            grad: args.grad,
            rtol: RTOL,
            atol: ATOL,
            grad_rel_l2_max: args.grad.then_some(GRAD_RTOL_L2),
            passed,
            failed,
            cases: results,
        })?;
    } else {
        emit(&format!("{passed} passed, {failed} failed"))?;
        if failed > 0 {
            let grad = if args.grad { " --grad" } else { "" };
            eprintln!(
                "replay with: trimul check --backend {} --suite {suite_name} --formulation {} --direction {}{grad} --seed {seed}",
                device.kind(),
                formulation,
                direction
            );
        }
    }
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::from(EXIT_FAILED) })
}

/// One case of a run: the device, the case, the layer's formulation and direction, and the seeds
/// of its inputs and weights.
struct CaseRun<'a> {
    device: &'a Device,
    case: &'a Case,
    formulation: Formulation,
    direction: Direction,
    input_seed: u64,
    weights_seed: u64,
    /// `--gpus`: run the forward sharded across this many GPUs.
    gpus: Option<usize>,
}

/// One case end to end. Errors from the forward or the reference become a failed case with
/// the message, so the other cases still run and the summary counts it.
fn run_case(run: &CaseRun) -> CaseResult {
    let case = run.case;
    let mut result = empty_result(case, run.input_seed, run.weights_seed);
    let mut one_gpu = None;
    let outcome = (|| -> trimul::Result<(reference::Comparison, f64)> {
        let (problem, weights, inputs, mut layer) = setup(run)?;
        // NaN, so an element the backend never writes fails the comparison.
        let mut y = vec![f32::NAN; problem.x_len()];
        let start = Instant::now();
        layer.forward_into(&inputs.x, inputs.mask.as_deref(), &mut y, case.shape())?;
        let mut ms = start.elapsed().as_secs_f64() * 1e3;
        if let Some(gpus) = run.gpus {
            let (sharded, sharded_ms) = sharded_forward(&weights, &problem, &inputs, gpus)?;
            let cmp = reference::compare(&sharded, &y, RTOL, ATOL);
            one_gpu = Some((cmp.max_abs, cmp.bad));
            (y, ms) = (sharded, sharded_ms);
        }
        let cmp = reference::check(&weights, &problem, &inputs.x, inputs.mask.as_deref(), &y, RTOL, ATOL)?;
        Ok((cmp, ms))
    })();
    if let Some((max_abs, bad)) = one_gpu {
        (result.one_gpu_max_abs, result.one_gpu_bad) = (Some(max_abs), Some(bad));
    }
    match outcome {
        Ok((cmp, ms)) => {
            result.passed = cmp.passed() && one_gpu.is_none_or(|(_, bad)| bad == 0);
            result.forward_ms = Some(ms);
            result.comparison = Some(ComparisonJson {
                max_abs: cmp.max_abs,
                rel_l2: cmp.rel_l2,
                checked: cmp.checked,
                sampled: case.batch * case.n * case.n > reference::FULL_CHECK_ROWS,
                bad: cmp.bad,
                nan_mismatch: cmp.nan_mismatch,
                worst: cmp.worst,
            });
        }
        Err(e) => result.error = Some(e.to_string()),
    }
    result
}

/// One case's backward: every gradient for a random `dy` against the f64 reference.
fn run_grad_case(run: &CaseRun) -> CaseResult {
    let case = run.case;
    let mut result = empty_result(case, run.input_seed, run.weights_seed);
    let outcome = (|| -> trimul::Result<(Vec<GradientJson>, f64)> {
        let (problem, weights, inputs, mut layer) = setup(run)?;
        let dy = Rng::new(run.input_seed ^ DY_SEED).normal_vec(problem.x_len(), 1.0);
        let start = Instant::now();
        let got = layer.backward(&inputs.x, inputs.mask.as_deref(), &dy, case.shape())?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let want = reference::backward(&weights, &problem, &inputs.x, inputs.mask.as_deref(), &dy)?;
        let (got, want) = (got.tensors(), want.tensors());
        if got.len() != want.len() || got.iter().zip(&want).any(|(g, w)| g.0 != w.0) {
            return Err(trimul::Error::Internal("the backward returned other tensors than the reference".into()));
        }
        let grads = got
            .iter()
            .zip(&want)
            .map(|((name, g), (_, w))| {
                let cmp = reference::compare(g, w, 0.0, f64::INFINITY);
                let passed = cmp.rel_l2 <= GRAD_RTOL_L2 && cmp.nan_mismatch == 0 && g.len() == w.len();
                GradientJson {
                    name: name.clone(),
                    max_abs: cmp.max_abs,
                    rel_l2: cmp.rel_l2,
                    nan_mismatch: cmp.nan_mismatch,
                    passed,
                }
            })
            .collect();
        Ok((grads, ms))
    })();
    match outcome {
        Ok((grads, ms)) => {
            result.passed = grads.iter().all(|g| g.passed);
            result.backward_ms = Some(ms);
            result.gradients = Some(grads);
        }
        Err(e) => result.error = Some(e.to_string()),
    }
    result
}

/// The case's forward sharded across `gpus` GPUs (poisoned buffers), and its wall time (host
/// conversion and copies included, as the one-GPU `forward_ms`).
#[cfg(feature = "cuda")]
fn sharded_forward(
    weights: &Weights,
    problem: &trimul::Problem,
    inputs: &suite::Inputs,
    gpus: usize,
) -> trimul::Result<(Vec<f32>, f64)> {
    let devices: Vec<usize> = (0..gpus).collect();
    let mut group = trimul::sharded::ShardedGroup::on_local_gpus(weights, problem, &devices)?;
    group.set_poison(true);
    let start = Instant::now();
    let y = group.forward(&inputs.x, inputs.mask.as_deref())?;
    Ok((y, start.elapsed().as_secs_f64() * 1e3))
}

#[cfg(not(feature = "cuda"))]
fn sharded_forward(_: &Weights, _: &trimul::Problem, _: &suite::Inputs, _: usize) -> trimul::Result<(Vec<f32>, f64)> {
    Err(trimul::Error::NotCompiled { backend: BackendKind::Cuda, feature: "cuda" })
}

/// A case's problem, random weights (af3's with biases, so the bias paths are checked too),
/// inputs and layer.
fn setup(run: &CaseRun) -> trimul::Result<(trimul::Problem, Weights, suite::Inputs, TriMul)> {
    let problem = run.case.problem(run.formulation, run.direction)?;
    let weights = Weights::random(problem.config, run.formulation == Formulation::Af3, run.weights_seed)?;
    let inputs = suite::generate_inputs(run.case, run.input_seed);
    let layer = TriMul::new(run.device, &weights, Options::new(run.direction))?;
    Ok((problem, weights, inputs, layer))
}

/// Mixed into a case's input seed to draw its `dy`.
const DY_SEED: u64 = 0xD1_D1_D1;

fn empty_result(case: &Case, input_seed: u64, weights_seed: u64) -> CaseResult {
    CaseResult {
        name: case.name(),
        batch: case.batch,
        n: case.n,
        c: case.c,
        h: case.h,
        masked: case.masked,
        dist: case.dist.as_str(),
        input_seed,
        weights_seed,
        passed: false,
        comparison: None,
        forward_ms: None,
        gradients: None,
        one_gpu_max_abs: None,
        one_gpu_bad: None,
        backward_ms: None,
        error: None,
    }
}

fn row(r: &CaseResult) -> String {
    if let Some(grads) = &r.gradients {
        // The failing gradient furthest past the bar, or the worst one when all pass.
        let worst = grads.iter().max_by(|a, b| a.rel_l2.total_cmp(&b.rel_l2).then(b.passed.cmp(&a.passed)));
        let (name, e) = worst.map_or(("-", f64::NAN), |g| (g.name.as_str(), g.rel_l2));
        let mut line = format!(
            "{:<28} {:<20} {:>9} {:>6} {:>9.1}",
            r.name,
            name,
            fmt_err(e),
            if r.passed { "pass" } else { "FAIL" },
            r.backward_ms.unwrap_or(f64::NAN)
        );
        let failing: Vec<&str> = grads.iter().filter(|g| !g.passed).map(|g| g.name.as_str()).collect();
        if !failing.is_empty() {
            line.push_str(&format!("  (failing: {})", failing.join(", ")));
        }
        return line;
    }
    match (&r.comparison, &r.error) {
        (Some(c), _) => {
            let mut line = format!(
                "{:<28} {:>9} {:>9} {:>10} {:<7} {:>6} {:>9.1}",
                r.name,
                fmt_err(c.max_abs),
                fmt_err(c.rel_l2),
                c.checked,
                if c.sampled { "sampled" } else { "all" },
                if r.passed { "pass" } else { "FAIL" },
                r.forward_ms.unwrap_or(f64::NAN),
            );
            if let (Some(d), Some(bad)) = (r.one_gpu_max_abs, r.one_gpu_bad) {
                line.push_str(&format!("  vs 1 GPU: max |Δ| {}, {bad} outside", fmt_err(d)));
            }
            if !r.passed {
                line.push_str(&format!("  ({} bad, {} NaN mismatches", c.bad, c.nan_mismatch));
                if let Some((i, got, want)) = c.worst {
                    line.push_str(&format!("; worst y[{i}] = {got:e}, reference {want:e}"));
                }
                line.push(')');
            }
            line
        }
        (None, e) => format!("{:<28} FAIL  error: {}", r.name, e.as_deref().unwrap_or("unknown")),
    }
}

fn json_opt_f64<S: serde::Serializer>(v: &Option<f64>, s: S) -> std::result::Result<S::Ok, S::Error> {
    match v {
        Some(v) => json_f64(v, s),
        None => s.serialize_none(),
    }
}
