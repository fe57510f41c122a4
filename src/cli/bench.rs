//! `trimul bench`: times the GPU MODE benchmark shapes on one backend.
//!
//! Method, per shape:
//! 1. Random weights (GPU MODE distributions; af3 without biases, as AF3, Boltz and the
//!    cuEquivariance anchors run it) prepared once into a [`Layer`], and one input set on the
//!    device. One forward on it is checked against the f64 reference, and the peak device memory
//!    of that single forward (weights, x, mask, y, workspace) is recorded.
//! 2. More buffer sets (x, mask, y) are added until the `x` tensors together reach 256 MiB (at
//!    most 8, fewer when memory is short), and calls rotate over them, so that a small shape is
//!    not timed with its input sitting in the last-level cache. The sets hold copies of the same
//!    data: timing does not depend on the values, and generating gigabytes of fresh random
//!    numbers would cost more than the benchmark.
//! 3. `warmup` untimed calls, then `repeats` calls each timed on its own with
//!    [`Backend::elapsed_ms`] (device events on GPUs, the host clock on the CPU); median, p10,
//!    p90 and min are reported. With `--fresh-weights` each timed call also re-prepares the
//!    weights (fuse, cast, upload), as the GPU MODE leaderboard's timings include.
//!
//! Floors come from ceilings measured in the same process ([`Device::measure_ceilings`]):
//! `floor = max(FLOPs / GEMM rate, io bytes / copy bandwidth)`.
//!
//! On CUDA, SM clocks, board power, the power limit and the driver's reasons for holding the
//! clocks down are read with nvidia-smi before, during and after each shape's calls
//! ([`trimul::report::gpu_probe`]): at N = 4096 an H100 runs into its power cap, and a time
//! means little without knowing that. A missing nvidia-smi is recorded, never an error.

use std::process::ExitCode;

use trimul::backend::cpu::{gemm_ceiling_gflops, CpuBackend};
use trimul::backend::device_weights::DeviceWeightSet;
use trimul::report::gpu_probe::NvidiaSmi;
use trimul::report::{
    fmt_bytes, fmt_err, BenchRun, Ceilings, MachineInfo, RunTelemetry, ShapeResult, ShapeTelemetry, TimingMethod,
    ToolInfo, SCHEMA_VERSION,
};
use trimul::suite::{self, Case};
use trimul::{
    reference, Backend, BackendKind, Device, Direction, Error, Formulation, Layer, Options, Precision, Weights,
};

use super::args::{check_output_path, open_device, BenchArgs, BenchSuite};
use super::exit::{CliError, CliResult, EXIT_FAILED};
use super::output::{device_summary, emit, Progress};
use super::seed::{clock_seed, SeedStream};

/// GPU MODE's tolerances, for the one checked forward per shape.
const RTOL: f64 = 2e-2;
const ATOL: f64 = 2e-2;

/// Rotate buffer sets until the `x` tensors together reach this many bytes: far beyond any
/// last-level cache of today's GPUs (H100 50 MiB, MI300X 256 MiB Infinity Cache) and CPUs.
const ROTATION_BYTES: u64 = 256 << 20;
const MAX_BUFFER_SETS: u64 = 8;

/// The shape of the CPU speed bar: the backend must reach this fraction of the `gemm` crate's
/// plain f32 2048³ rate on it.
const SPEED_BAR_KEY: (usize, usize, usize) = (256, 2, 128);
const SPEED_BAR_GEMM_N: usize = 2048;
const SPEED_BAR: f64 = 0.40;

/// What every shape of one run shares.
struct Plan {
    formulation: Formulation,
    direction: Direction,
    warmup: u32,
    repeats: u32,
    fresh_weights: bool,
    /// `--max-memory`.
    budget: Option<u64>,
    in_place: bool,
    /// Element type of x and y on the device.
    precision: Precision,
    /// Clock and power readings around each shape's timing, where the backend has a probe.
    probe: Option<NvidiaSmi>,
    /// `--grad`: time the backward too.
    grad: bool,
    /// `--device-time`: each timed call enqueued with the stream held.
    device_time: bool,
}

impl Plan {
    /// The run's clock: its name in the JSON (`TimingMethod::clock`) and in the banner.
    fn clock(&self, gpu: bool) -> (&'static str, &'static str) {
        match (gpu, self.device_time) {
            (true, true) => {
                (trimul::report::schema::CLOCK_HELD, "device events, each call enqueued with the stream held")
            }
            (true, false) => ("device-events", "device events"),
            (false, _) => ("host", "host clock"),
        }
    }
}

enum Outcome {
    Done(Box<Measured>),
    /// The shape does not fit in memory; the message says what was needed.
    Skipped(String),
}

struct Measured {
    result: ShapeResult,
    sets: u64,
}

/// `long`: B = 1, C = H = 128, the sizes where users of AF3-style models run out of memory; with
/// `ns` (`--n`), that form at exactly those sizes, in their order, once each (1024, 1536 and 2560,
/// where users fold, are not in the suite; Python's `trimul.bench` times this form).
pub(super) fn long_cases(ns: &[usize]) -> CliResult<Vec<Case>> {
    if let Some(n) = ns.iter().find(|&&n| n == 0) {
        return Err(CliError::usage(format!("--n {n}: a sequence length is at least 1")));
    }
    if ns.is_empty() {
        return Ok(trimul::suite::LONG_SUITE_N.into_iter().map(trimul::suite::long_case).collect());
    }
    let mut once: Vec<usize> = Vec::new();
    for &n in ns {
        if !once.contains(&n) {
            once.push(n);
        }
    }
    Ok(once.into_iter().map(trimul::suite::long_case).collect())
}

pub fn run(args: &BenchArgs) -> CliResult {
    let started = trimul::report::now_utc();
    // A run can take minutes; learn about a JSON path that cannot be written before it, not after.
    if let Some(path) = &args.json {
        check_output_path("--json", path)?;
    }
    if let Some(gpus) = args.gpus {
        return run_gpus(args, gpus as usize);
    }
    let device = open_device(args.backend)?;
    let kind = device.kind();
    let gpu = kind != BackendKind::Cpu;
    let suite = args.suite.unwrap_or(if gpu { BenchSuite::Gpumode } else { BenchSuite::Quick });
    let (suite_name, cases): (&str, Vec<Case>) = match suite {
        BenchSuite::Gpumode => ("gpumode", suite::bench_cases()),
        BenchSuite::Quick => ("quick", suite::quick_bench_cases()),
        BenchSuite::Long => ("long", long_cases(&args.n)?),
    };
    let cases: Vec<Case> = cases.into_iter().filter(|c| args.n.is_empty() || args.n.contains(&c.n)).collect();
    if cases.is_empty() {
        return Err(CliError::usage(format!("--n {:?}: no shape of suite {suite_name} has these N", args.n)));
    }
    if args.fresh_weights && (args.in_place || args.max_memory.is_some()) {
        return Err(CliError::usage("--fresh-weights cannot be combined with --in-place or --max-memory"));
    }
    // Fewer calls on the CPU, where one call of a quick shape already takes tens of ms to seconds.
    let plan = Plan {
        formulation: args.formulation.into(),
        direction: args.direction.into(),
        warmup: args.warmup.unwrap_or(if gpu { 3 } else { 1 }),
        repeats: args.repeats.unwrap_or(if gpu { 15 } else { 5 }),
        fresh_weights: args.fresh_weights,
        budget: args.max_memory,
        in_place: args.in_place,
        precision: args.precision,
        probe: None,
        grad: args.grad,
        device_time: args.device_time,
    };
    if plan.grad && (plan.fresh_weights || plan.in_place || plan.budget.is_some()) {
        return Err(CliError::usage("--grad cannot be combined with --fresh-weights, --in-place or --max-memory"));
    }
    if plan.device_time && kind != BackendKind::Cuda {
        return Err(CliError::usage(format!("--device-time holds a CUDA stream; the {kind} backend has none")));
    }
    if plan.device_time && plan.grad {
        return Err(CliError::usage("--device-time times forwards; it cannot be combined with --grad"));
    }
    if plan.precision != Precision::F32Io {
        if kind != BackendKind::Cuda {
            return Err(CliError::usage(format!(
                "--precision {}: 16-bit device buffers are timed on CUDA only ({kind} converts on the host)",
                plan.precision
            )));
        }
        if plan.fresh_weights {
            return Err(CliError::usage("--precision bf16-io/f16-io cannot be combined with --fresh-weights"));
        }
    }
    let seed = args.seed.unwrap_or_else(clock_seed);
    let info = device.info();
    let (probe, telemetry) = open_probe(&device);
    let plan = Plan { probe, ..plan };

    let calls_per_case = u64::from(1 + plan.warmup + plan.repeats) * if plan.grad { 2 } else { 1 };
    let progress = Progress::bar(cases.len() as u64 * calls_per_case);
    progress.out(&format!(
        "trimul bench: {kind} ({}), suite {suite_name} ({} shapes), {} {}, {}, seed {seed}",
        device_summary(kind, &info),
        cases.len(),
        plan.formulation,
        plan.direction,
        plan.precision.as_str(),
    ))?;
    progress.out(&format!(
        "timing: {} warm-up + {} timed calls per shape, median; {}; weights {}",
        plan.warmup,
        plan.repeats,
        plan.clock(gpu).1,
        if plan.fresh_weights { "re-prepared inside every timed call" } else { "prepared once" },
    ))?;
    progress.out(&match (&telemetry.available, &telemetry.reason) {
        (true, _) => format!(
            "clocks and power: nvidia-smi every {} ms during the calls (driver {}, {})",
            trimul::report::gpu_probe::INTERVAL_MS,
            telemetry.driver_version.as_deref().unwrap_or("unknown"),
            telemetry.gpu.as_deref().unwrap_or("the only GPU")
        ),
        (false, reason) => format!("clocks and power: not read ({})", reason.as_deref().unwrap_or("no probe")),
    })?;
    if plan.budget.is_some() || plan.in_place {
        progress.out(&format!(
            "memory: budget {}{}",
            plan.budget.map_or("= free device memory".into(), fmt_bytes),
            if plan.in_place { "; y written over x (in place)" } else { "" }
        ))?;
    }
    progress.set_message("measuring ceilings");
    let measured = device.measure_ceilings()?;
    let ceilings =
        Ceilings { gemm_tflops: measured.gemm_tflops, gemm_desc: measured.gemm_desc, copy_gbs: measured.copy_gbs };
    progress.out(&format!(
        "ceilings: GEMM {:.3} TFLOP/s ({}), copy {:.1} GB/s (read + write)",
        ceilings.gemm_tflops, ceilings.gemm_desc, ceilings.copy_gbs
    ))?;
    progress.out(&header())?;

    let mut seeds = SeedStream::new(seed);
    let mut shapes: Vec<ShapeResult> = Vec::new();
    let mut max_sets = 1u64;
    let mut skipped = 0usize;
    let mut speed_bar: Option<(f64, f64)> = None;
    let steps_per_case = u64::from(1 + plan.warmup + plan.repeats);
    for case in &cases {
        progress.set_message(case.name());
        let (input_seed, weights_seed) = (seeds.next(), seeds.next());
        let before = progress.position();
        // Out-of-memory anywhere in a shape skips it; other errors abort the run.
        let job = Job { case, plan: &plan, input_seed, weights_seed, ceilings: &ceilings, progress: &progress };
        let outcome = skip_if_out_of_memory(match &device {
            Device::Cpu(b) => measure(b, &job),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) if plan.precision != Precision::F32Io => half::measure(b, &job),
            #[cfg(feature = "cuda")]
            Device::Cuda(b) => measure(b, &job),
            #[cfg(feature = "rocm")]
            Device::Hip(b) => measure(b, &job),
            other => Err(Error::InvalidArgument(format!("bench does not know the {} backend", other.kind()))),
        })?;
        // Skipped shapes advance the bar by the calls they did not make.
        progress.inc((before + steps_per_case).saturating_sub(progress.position()));
        match outcome {
            Outcome::Done(m) => {
                progress.out(&row(&m))?;
                if let Some(line) = plan_line(&m.result) {
                    progress.out(&line)?;
                }
                if let Some(ms) = m.result.backward_median_ms {
                    let peak = m
                        .result
                        .backward_peak_device_bytes
                        .map_or(String::new(), |b| format!("; the backward's own peak memory {}", fmt_bytes(b)));
                    progress.out(&format!(
                        "{:<28} backward {ms:.3} ms median, {:.2}× the forward; forward + backward {:.3} ms{peak}",
                        "",
                        ms / m.result.median_ms,
                        ms + m.result.median_ms
                    ))?;
                }
                max_sets = max_sets.max(m.sets);
                if !gpu && (m.result.n, m.result.batch, m.result.c) == SPEED_BAR_KEY {
                    // Right after the shape, so both rates see the same load on a shared machine.
                    progress.set_message(format!("CPU speed bar: gemm crate {SPEED_BAR_GEMM_N}³"));
                    let gemm = gemm_ceiling_gflops(SPEED_BAR_GEMM_N, 3);
                    speed_bar = Some((m.result.tflops * 1e3, gemm));
                }
                shapes.push(m.result);
            }
            Outcome::Skipped(why) => {
                skipped += 1;
                progress.out(&format!("{:<28} skipped: {why}", case.name()))?;
            }
        }
    }
    progress.finish();

    summarise(&shapes, skipped, cases.len())?;
    if shapes.is_empty() {
        return Err(CliError {
            code: EXIT_FAILED,
            message: format!("no shape was measured: all {skipped} were skipped (see the reasons above)"),
        });
    }
    if let Some((got, gemm)) = speed_bar {
        let ratio = got / gemm;
        emit(&format!(
            "CPU speed bar: n{}_b{}_c{} at {got:.1} GFLOP/s vs gemm crate f32 {SPEED_BAR_GEMM_N}³ at {gemm:.1} GFLOP/s \
             (same process): {:.1}% ({} the {:.0}% bar)",
            SPEED_BAR_KEY.0,
            SPEED_BAR_KEY.1,
            SPEED_BAR_KEY.2,
            100.0 * ratio,
            if ratio >= SPEED_BAR { "meets" } else { "misses" },
            100.0 * SPEED_BAR
        ))?;
    }

    let failed = shapes.iter().filter(|s| s.passed == Some(false)).count();
    if let Some(path) = &args.json {
        let run = BenchRun {
            schema_version: SCHEMA_VERSION,
            tool: ToolInfo::current(),
            created_utc: started,
            label: args.label.clone(),
            // A GPU run records the host CPU too: it feeds the launches and the fresh-weights path.
            machine: MachineInfo::from_device_info(&info, gpu.then(|| CpuBackend::new().info().name)),
            backend: kind.as_str().to_string(),
            precision: plan.precision.as_str().to_string(),
            formulation: plan.formulation.as_str().to_string(),
            suite: Some(suite_name.to_string()),
            seed: Some(seed),
            timing: TimingMethod {
                warmup: plan.warmup,
                repeats: plan.repeats,
                buffer_sets: u32::try_from(max_sets).unwrap_or(u32::MAX),
                clock: plan.clock(gpu).0.to_string(),
                fresh_weights: plan.fresh_weights,
            },
            ceilings,
            telemetry: Some(telemetry),
            shapes,
        };
        run.write(path)?;
        eprintln!("wrote {}", path.display());
    }
    if failed > 0 {
        return Err(CliError {
            code: EXIT_FAILED,
            message: format!("{failed} shape(s) failed the correctness check; their timings measure wrong results"),
        });
    }
    Ok(ExitCode::SUCCESS)
}
#[cfg(feature = "cuda")]
fn run_gpus(args: &BenchArgs, gpus: usize) -> CliResult {
    super::bench_gpus::run(args, gpus)
}

#[cfg(not(feature = "cuda"))]
fn run_gpus(_: &BenchArgs, _: usize) -> CliResult {
    Err(CliError::usage("--gpus needs the CUDA backend: rebuild with `--features cuda`"))
}

/// An out-of-memory error becomes [`Outcome::Skipped`] naming the bytes.
fn skip_if_out_of_memory(result: trimul::Result<Outcome>) -> trimul::Result<Outcome> {
    match result {
        Err(Error::OutOfMemory { what, needed, available, .. }) => Ok(Outcome::Skipped(format!(
            "out of memory: {what} needs {}, {} available",
            fmt_bytes(needed),
            fmt_bytes(available)
        ))),
        other => other,
    }
}

/// The clock and power probe of this device: nvidia-smi for the GPU the CUDA backend opened;
/// none elsewhere. Never an error: the record says why there are no readings.
fn open_probe(device: &Device) -> (Option<NvidiaSmi>, RunTelemetry) {
    match device.kind() {
        BackendKind::Cuda => NvidiaSmi::open(cuda_uuid().as_deref()),
        BackendKind::Hip => {
            (None, RunTelemetry::unavailable("none", "no clock or power probe for the HIP backend yet"))
        }
        BackendKind::Cpu => (None, RunTelemetry::unavailable("none", "no clock or power probe for the CPU backend")),
        _ => (None, RunTelemetry::unavailable("none", "no clock or power probe for this backend")),
    }
}

/// The UUID of CUDA device 0, the one `Device::select` opens, as nvidia-smi prints it
/// (`GPU-8-4-4-4-12` hex digits), so the probe reads that GPU on a machine with several.
#[cfg(feature = "cuda")]
fn cuda_uuid() -> Option<String> {
    use cudarc::driver::result::device;
    let uuid = device::get_uuid(device::get(0).ok()?).ok()?;
    let b: Vec<u8> = uuid.bytes.iter().map(|&c| c as u8).collect();
    let hex = |r: std::ops::Range<usize>| b[r].iter().map(|v| format!("{v:02x}")).collect::<String>();
    Some(format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_uuid() -> Option<String> {
    None
}

/// What [`time_calls`] measured: the timed samples, and the clocks and power around them.
struct Timed {
    samples: Vec<f64>,
    telemetry: Option<ShapeTelemetry>,
}

/// `warmup` untimed then `repeats` timed calls of `call(k)`, k rotating over the `sets` buffer
/// sets, each timed alone with [`Backend::elapsed_ms`]; with the plan's probe, clocks and power
/// read before, during and after.
fn time_calls<B: Backend>(
    backend: &B,
    plan: &Plan,
    sets: u64,
    progress: &Progress,
    mut call: impl FnMut(usize) -> trimul::Result<()>,
) -> trimul::Result<Timed> {
    let (samples, telemetry) = NvidiaSmi::around(plan.probe.as_ref(), || -> trimul::Result<Vec<f64>> {
        let mut samples = Vec::with_capacity(plan.repeats as usize);
        for i in 0..(plan.warmup + plan.repeats) as usize {
            let k = i % sets as usize;
            let ms = if plan.device_time {
                backend.held_elapsed_ms(&mut || call(k))?
            } else {
                backend.elapsed_ms(&mut || call(k))?
            };
            if i >= plan.warmup as usize {
                samples.push(ms);
            }
            progress.inc(1);
        }
        backend.synchronize()?;
        Ok(samples)
    });
    Ok(Timed { samples: samples?, telemetry })
}

/// What measuring one shape takes besides the backend: the shape, the run's plan, the shape's
/// seeds, the device's ceilings and the progress display.
#[derive(Clone, Copy)]
struct Job<'a> {
    case: &'a Case,
    plan: &'a Plan,
    input_seed: u64,
    weights_seed: u64,
    ceilings: &'a Ceilings,
    progress: &'a Progress,
}

/// One shape on one backend with f32 x and y.
fn measure<B: Backend>(backend: &B, job: &Job) -> trimul::Result<Outcome> {
    let Job { case, plan, input_seed, weights_seed, ceilings, progress } = *job;
    let problem = case.problem(plan.formulation, plan.direction)?;
    let shape = problem.shape;
    let weights = Weights::random(problem.config, false, weights_seed)?;
    // From here on, the peak counts this shape's weights, buffers and workspace only.
    backend.reset_peak_memory();
    let options = Options::new(plan.direction);
    let mut layer = Layer::new(backend, &weights, options)?;
    layer.set_memory_budget(plan.budget);
    let needs = layer.memory_needs(shape, problem.masked, plan.in_place)?;
    let ws_bytes = needs.one_pass_workspace;

    let (x_len, mask_len) = (problem.x_len(), if problem.masked { problem.mask_len() } else { 0 });
    let set_bytes = needs.io;
    // Host copies: the generated x and mask, and y downloaded for the check.
    let host_bytes = 4 * (2 * x_len + mask_len) as u64;
    let host_free = CpuBackend::new().memory_info()?.map(|m| m.free);
    let device_free = backend.memory_info()?.map(|m| m.free);
    let cpu = backend.kind() == BackendKind::Cpu;
    // On the CPU backend "device" buffers are host memory too. The layer itself refuses plans
    // that do not fit its budget (an OutOfMemory, reported as a skip); this only avoids
    // generating gigabytes of input for a shape that cannot run at all.
    let (host_need, device_need) = if cpu {
        (host_bytes + set_bytes + needs.min_workspace, 0)
    } else {
        (host_bytes, set_bytes + needs.min_workspace)
    };
    if let Some(free) = host_free.filter(|&f| host_need > f) {
        return Ok(Outcome::Skipped(format!(
            "needs {} of host memory (inputs, output{}), {} available",
            fmt_bytes(host_need),
            if cpu { ", workspace" } else { "" },
            fmt_bytes(free)
        )));
    }
    if let Some(free) = device_free.filter(|&f| !cpu && device_need > f) {
        return Ok(Outcome::Skipped(format!(
            "needs {} of device memory (x, y, narrowest workspace), {} free",
            fmt_bytes(device_need),
            fmt_bytes(free)
        )));
    }
    if let Some(budget) = plan.budget.filter(|&b| needs.min_total() > b) {
        return Ok(Outcome::Skipped(format!(
            "needs at least {} (weights, x, y and the narrowest workspace), the budget is {}",
            fmt_bytes(needs.min_total()),
            fmt_bytes(budget)
        )));
    }

    progress.set_message(format!("{}: generating inputs", case.name()));
    let inputs = suite::generate_inputs(case, input_seed);
    let upload = |data: &[f32]| -> trimul::Result<B::Buffer> {
        let mut buf = backend.alloc(data.len())?;
        backend.upload(data, &mut buf)?;
        Ok(buf)
    };
    let mut xs = vec![upload(&inputs.x)?];
    let mut masks = vec![inputs.mask.as_deref().map(upload).transpose()?];
    // In place, y is x: no separate output buffers.
    let mut ys = if plan.in_place { Vec::new() } else { vec![backend.alloc(x_len)?] };

    progress.set_message(format!("{}: checked forward", case.name()));
    if plan.in_place {
        layer.forward_buffers_in_place(&mut xs[0], masks[0].as_ref(), shape)?;
    } else {
        layer.forward_buffers(&xs[0], masks[0].as_ref(), &mut ys[0], shape)?;
    }
    backend.synchronize()?;
    let peak = backend.peak_memory();
    let exec_plan = layer.exec_plan();
    let mut y = vec![0.0f32; x_len];
    backend.download(if plan.in_place { &xs[0] } else { &ys[0] }, &mut y)?;
    progress.set_message(format!("{}: reference check", case.name()));
    let cmp = reference::check(&weights, &problem, &inputs.x, inputs.mask.as_deref(), &y, RTOL, ATOL)?;
    // Kept for comparing the device-prepared path's output with (--fresh-weights on a GPU).
    let checked_y = if plan.fresh_weights { y } else { Vec::new() };
    // --grad: a dy and a dx on the backend (the backward reads x and the mask from set 0).
    let mut grad_buffers = if plan.grad {
        let dy = trimul::rand::Rng::new(input_seed ^ 0xD1).normal_vec(x_len, 1.0);
        Some((upload(&dy)?, backend.alloc(x_len)?))
    } else {
        None
    };
    progress.inc(1);

    let used_ws = exec_plan.map_or(ws_bytes, |p| p.workspace_bytes);
    // Extra sets would break the budget's accounting: with one, the peak is the forward's.
    let sets = if plan.budget.is_some() || plan.in_place {
        1
    } else {
        buffer_sets(x_len as u64 * 4, set_bytes, if cpu { host_free } else { device_free }, used_ws)
    };
    for _ in 1..sets {
        xs.push(upload(&inputs.x)?);
        masks.push(inputs.mask.as_deref().map(upload).transpose()?);
        ys.push(backend.alloc(x_len)?);
    }
    drop(inputs);

    progress.set_message(format!("{}: timing", case.name()));
    let calls = (plan.warmup + plan.repeats) as usize;
    let mut samples = Vec::with_capacity(plan.repeats as usize);
    let mut telemetry = None;
    let mut backward = (None, None);
    if plan.fresh_weights {
        // The leaderboard's way: weight preparation inside every timed call.
        match DeviceWeightSet::upload(backend, &weights)? {
            Some(set) => {
                // GPU backends: the weights are on the device already, as the harness hands them
                // over (uploaded once, untimed); each call prepares them there with one kernel,
                // then runs the forward. The workspace is made once (a framework's caching
                // allocator would serve it without a device allocation).
                drop(layer);
                let mut workspace = backend.workspace(set.prepare()?.get(), &problem, None)?;
                if B::exec_plan(&workspace).hidden_passes > 1
                    || B::exec_plan(&workspace).output_rows < problem.shape.rows()
                {
                    // A chunked workspace holds copies of the weights it was planned with, so new
                    // weights in every call would need a new workspace in every call.
                    return Ok(Outcome::Skipped(
                        "--fresh-weights times one-pass plans; this shape needs a chunked one on this device".into(),
                    ));
                }
                let timed = time_calls(backend, plan, sets, progress, |k| {
                    let prepared = set.prepare()?;
                    backend.forward(
                        prepared.get(),
                        &mut workspace,
                        &problem,
                        B::buffer_io(Some(&xs[k]), masks[k].as_ref(), &mut ys[k]),
                    )
                })?;
                (samples, telemetry) = (timed.samples, timed.telemetry);
                // The device-prepared path is checked too: the last call's y (set 0 holds the
                // checked inputs) must equal the host-prepared forward's, bit for bit.
                let prepared = set.prepare()?;
                backend.forward(
                    prepared.get(),
                    &mut workspace,
                    &problem,
                    B::buffer_io(Some(&xs[0]), masks[0].as_ref(), &mut ys[0]),
                )?;
                let mut fresh = vec![0.0f32; x_len];
                backend.download(&ys[0], &mut fresh)?;
                if fresh.iter().map(|v| v.to_bits()).ne(checked_y.iter().map(|v| v.to_bits())) {
                    return Err(Error::Internal(format!(
                        "{}: weights prepared on the device gave another y than the host-prepared layer",
                        case.name()
                    )));
                }
            }
            None => {
                // The CPU: preparation from host weights in every call. The workspace is made once
                // (a framework's caching allocator would serve it without an allocation).
                drop(layer);
                let mut workspace = {
                    let prepared = backend.prepare(&weights)?;
                    backend.workspace(&prepared, &problem, None)?
                };
                for i in 0..calls {
                    let k = i % sets as usize;
                    // Prepared weights are freed only after the call's work has finished.
                    let mut held = Vec::with_capacity(1);
                    let ms = backend.elapsed_ms(&mut || {
                        let prepared = backend.prepare(&weights)?;
                        let r = backend.forward(
                            &prepared,
                            &mut workspace,
                            &problem,
                            B::buffer_io(Some(&xs[k]), masks[k].as_ref(), &mut ys[k]),
                        );
                        held.push(prepared);
                        r
                    })?;
                    drop(held);
                    if i >= plan.warmup as usize {
                        samples.push(ms);
                    }
                    progress.inc(1);
                }
            }
        }
    } else {
        // In place, each call reads the previous call's y as its x: timing does not depend on
        // the values (LayerNorm keeps them in range), and only the first call was checked.
        let timed = time_calls(backend, plan, sets, progress, |k| {
            if plan.in_place {
                layer.forward_buffers_in_place(&mut xs[k], masks[k].as_ref(), shape)
            } else {
                layer.forward_buffers(&xs[k], masks[k].as_ref(), &mut ys[k], shape)
            }
        })?;
        (samples, telemetry) = (timed.samples, timed.telemetry);
        backend.synchronize()?;
        if let Some((dy, dx)) = grad_buffers.as_mut() {
            backward = time_backward(backend, job, &mut || {
                layer.backward_buffers(&xs[0], masks[0].as_ref(), dy, dx, shape).map(drop)
            })?;
        }
    }
    backend.synchronize()?;
    let result = ShapeResult::from_samples(case.name(), &problem, case.dist.as_str(), &samples, ceilings)?
        .with_backward(backward.0, backward.1)
        .with_check(cmp.max_abs, cmp.rel_l2, cmp.passed())
        .with_memory(peak, Some(used_ws))
        .with_plan(plan.budget, exec_plan, plan.in_place)
        .with_telemetry(telemetry);
    Ok(Outcome::Done(Box::new(Measured { result, sets })))
}

/// `--grad`: the median time of `backward` over the plan's repeats after its warm-ups (device
/// events), and the device memory it held beyond what was held before; the backend's kept
/// backward buffers are then freed, so that the next shape's forward peak does not count them.
fn time_backward<B: Backend>(
    backend: &B,
    job: &Job,
    backward: &mut dyn FnMut() -> trimul::Result<()>,
) -> trimul::Result<(Option<f64>, Option<u64>)> {
    let (plan, progress) = (job.plan, job.progress);
    progress.set_message(format!("{}: timing the backward", job.case.name()));
    let mut times = Vec::with_capacity(plan.repeats as usize);
    backend.reset_peak_memory();
    let held = backend.peak_memory();
    for i in 0..plan.warmup + plan.repeats {
        let ms = backend.elapsed_ms(backward)?;
        if i >= plan.warmup {
            times.push(ms);
        }
        progress.inc(1);
    }
    let median = trimul::report::SampleStats::from_samples(&times)?.median;
    let peak = backend.peak_memory().zip(held).map(|(peak, held)| peak.saturating_sub(held));
    backend.free_backward_buffers();
    Ok((Some(median), peak))
}

/// Buffer sets to rotate over: enough that the `x` tensors reach [`ROTATION_BYTES`], at most
/// [`MAX_BUFFER_SETS`], and no more than half of the memory left after the workspace holds.
fn buffer_sets(x_bytes: u64, set_bytes: u64, free: Option<u64>, ws_bytes: u64) -> u64 {
    let wanted = ROTATION_BYTES.div_ceil(x_bytes.max(1)).clamp(1, MAX_BUFFER_SETS);
    match free {
        Some(free) => wanted.min((free.saturating_sub(ws_bytes) / 2 / set_bytes.max(1)).max(1)),
        None => wanted,
    }
}

fn header() -> String {
    format!(
        "{:<28} {:>9} {:>9} {:>9} {:>8} {:>7} {:>8} {:>7} {:>8} {:>8} {:>5} {:>9} {:>4}",
        "shape",
        "median ms",
        "p10",
        "p90",
        "TFLOP/s",
        "GB/s",
        "floor ms",
        "×floor",
        "max abs",
        "rel L2",
        "check",
        "peak mem",
        "sets"
    )
}

fn row(m: &Measured) -> String {
    let r = &m.result;
    let check = match r.passed {
        Some(true) => "pass",
        Some(false) => "FAIL",
        None => "-",
    };
    format!(
        "{:<28} {:>9.3} {:>9.3} {:>9.3} {:>8.3} {:>7.1} {:>8.3} {:>7} {:>8} {:>8} {:>5} {:>9} {:>4}",
        r.name,
        r.median_ms,
        r.p10_ms,
        r.p90_ms,
        r.tflops,
        r.gbs,
        r.floor_ms,
        fmt_ratio(r.floor_ratio),
        r.max_abs_err.map_or("-".into(), fmt_err),
        r.rel_l2_err.map_or("-".into(), fmt_err),
        check,
        r.peak_device_bytes.map_or("-".into(), fmt_bytes),
        m.sets
    )
}

/// For runs under a budget, in place or chunked: the plan, and the peak against the budget.
fn plan_line(r: &ShapeResult) -> Option<String> {
    let p = r.exec_plan?;
    if r.memory_budget_bytes.is_none() && !r.in_place && !p.is_chunked() {
        return None;
    }
    let peak = r.peak_device_bytes.map_or("-".into(), fmt_bytes);
    let budget = match (r.memory_budget_bytes, r.peak_device_bytes) {
        (Some(b), Some(peak)) => {
            format!(", budget {} ({})", fmt_bytes(b), if peak <= b { "peak within it" } else { "PEAK EXCEEDS IT" })
        }
        (Some(b), None) => format!(", budget {}", fmt_bytes(b)),
        (None, _) => String::new(),
    };
    Some(format!(
        "{:<28} plan: {}{}; peak {peak}{budget}",
        "",
        p.describe(),
        if r.in_place { ", in place" } else { "" }
    ))
}

/// `2.35×`, `23.5×`, `235×`.
fn fmt_ratio(v: f64) -> String {
    if !v.is_finite() || v <= 0.0 {
        return "n/a".into();
    }
    let decimals = (2.0 - v.log10().floor()).clamp(0.0, 6.0) as usize;
    format!("{v:.decimals$}×")
}

/// The geometric means, over the shapes measured.
fn summarise(shapes: &[ShapeResult], skipped: usize, total: usize) -> CliResult<()> {
    if shapes.is_empty() {
        return emit(&format!("no shape measured ({skipped} of {total} skipped)"));
    }
    let geomean =
        |f: &dyn Fn(&ShapeResult) -> f64| (shapes.iter().map(|s| f(s).ln()).sum::<f64>() / shapes.len() as f64).exp();
    let note =
        if skipped > 0 { format!(" ({} of {total} shapes; {skipped} skipped)", shapes.len()) } else { String::new() };
    emit(&format!(
        "{:<28} {:>9.3}{:46} {:>7}{note}",
        "geomean",
        geomean(&|s| s.median_ms),
        "",
        fmt_ratio(geomean(&|s| s.floor_ratio))
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_reaches_the_target_within_memory() {
        let mib = 1u64 << 20;
        // 64 MiB of x: four sets reach 256 MiB.
        assert_eq!(buffer_sets(64 * mib, 130 * mib, None, 0), 4);
        // A tiny x is capped at 8 sets.
        assert_eq!(buffer_sets(mib, 2 * mib, None, 0), 8);
        // A large x needs one set.
        assert_eq!(buffer_sets(1600 * mib, 3200 * mib, Some(80_000 * mib), 0), 1);
        // Short memory: 1 GiB free after a 200 MiB workspace holds ~3 sets of 130 MiB in half of it.
        assert_eq!(buffer_sets(64 * mib, 130 * mib, Some(1224 * mib), 200 * mib), 3);
        // Never fewer than one.
        assert_eq!(buffer_sets(64 * mib, 130 * mib, Some(10 * mib), 200 * mib), 1);
    }

    #[test]
    fn long_suite_shapes() {
        let suite = long_cases(&[]).unwrap();
        assert_eq!(suite.iter().map(|c| c.n).collect::<Vec<_>>(), [2048, 3072, 4096, 6144, 8192]);
        let named = long_cases(&[1536, 512, 1536]).unwrap();
        assert_eq!(named.iter().map(|c| c.n).collect::<Vec<_>>(), [1536, 512], "--n's sizes, once each");
        assert!(suite.iter().chain(&named).all(|c| c.batch == 1 && c.c == 128 && c.h == 128 && !c.masked));
        assert!(long_cases(&[1024, 0]).is_err());
    }

    #[test]
    fn ratios_keep_three_digits() {
        assert_eq!(fmt_ratio(2.346), "2.35×");
        assert_eq!(fmt_ratio(234.4), "234×");
        assert_eq!(fmt_ratio(f64::INFINITY), "n/a");
    }
}

/// `--precision bf16-io|f16-io` on CUDA: the same method as [`measure`] on 16-bit device buffers
/// (`Layer::forward_buffers_half`), checked against the reference of the rounded x.
#[cfg(feature = "cuda")]
mod half {
    use rayon::prelude::*;
    use trimul::backend::cuda::CudaBackend;

    use super::*;

    pub(super) fn measure(backend: &CudaBackend, job: &Job) -> trimul::Result<Outcome> {
        let Job { case, plan, input_seed, weights_seed, ceilings, progress } = *job;
        let io = plan.precision;
        let problem = case.problem(plan.formulation, plan.direction)?.with_io(io);
        let shape = problem.shape;
        let weights = Weights::random(problem.config, false, weights_seed)?;
        backend.reset_peak_memory();
        let mut layer = Layer::new(backend, &weights, Options::new(plan.direction))?;
        layer.set_memory_budget(plan.budget);
        let needs = layer.memory_needs_io(shape, problem.masked, plan.in_place, io)?;

        progress.set_message(format!("{}: generating inputs", case.name()));
        let inputs = suite::generate_inputs(case, input_seed);
        // The caller's x is the rounded one; the reference sees exactly that. Rounded in place and
        // on every core: at N = 8192 each f32 copy of x is 32 GiB, and the host keeps one (y is
        // checked in its 16-bit form below: `compare_half` decodes only what it compares).
        let mut x = inputs.x;
        let bits: Vec<u16> = x
            .par_iter_mut()
            .map(|v| {
                let word = io.encode_half(*v);
                *v = io.decode_half(word);
                word
            })
            .collect();
        let upload_bits = |data: &[u16]| -> trimul::Result<_> {
            let mut buf = backend.alloc_buffer::<u16>(data.len())?;
            backend.upload_bits(data, &mut buf)?;
            Ok(buf)
        };
        let upload_mask = |data: &[f32]| -> trimul::Result<_> {
            let mut buf = backend.alloc(data.len())?;
            backend.upload(data, &mut buf)?;
            Ok(buf)
        };
        let mut xs = vec![upload_bits(&bits)?];
        let mut masks = vec![inputs.mask.as_deref().map(upload_mask).transpose()?];
        // In place, y is x: no separate output buffers.
        let mut ys = if plan.in_place { Vec::new() } else { vec![backend.alloc_buffer::<u16>(bits.len())?] };
        // --grad: a 16-bit dy and dx (the backward reads x and the mask from set 0).
        let mut grad_buffers = if plan.grad {
            let dy = trimul::rand::Rng::new(input_seed ^ 0xD1).normal_vec(bits.len(), 1.0);
            let dy: Vec<u16> = dy.par_iter().map(|&v| io.encode_half(v)).collect();
            Some((upload_bits(&dy)?, backend.alloc_buffer::<u16>(bits.len())?))
        } else {
            None
        };

        progress.set_message(format!("{}: checked forward", case.name()));
        if plan.in_place {
            layer.forward_buffers_half_in_place(&mut xs[0], masks[0].as_ref(), shape, io)?;
        } else {
            layer.forward_buffers_half(&xs[0], masks[0].as_ref(), &mut ys[0], shape, io)?;
        }
        backend.synchronize()?;
        let peak = backend.peak_memory();
        let exec_plan = layer.exec_plan();
        let mut ybits = vec![0u16; bits.len()];
        backend.download_bits(if plan.in_place { &xs[0] } else { &ys[0] }, &mut ybits)?;

        let used_ws = exec_plan.map_or(needs.one_pass_workspace, |p| p.workspace_bytes);
        let device_free = backend.memory_info()?.map(|m| m.free);
        // Extra sets would break the budget's accounting: with one, the peak is the forward's.
        let sets = if plan.budget.is_some() || plan.in_place {
            1
        } else {
            buffer_sets(bits.len() as u64 * 2, needs.io, device_free, used_ws)
        };
        for _ in 1..sets {
            xs.push(upload_bits(&bits)?);
            masks.push(inputs.mask.as_deref().map(upload_mask).transpose()?);
            ys.push(backend.alloc_buffer::<u16>(bits.len())?);
        }
        // Uploaded: x's 16-bit words leave the host before the reference needs its memory.
        drop(bits);

        progress.set_message(format!("{}: reference check", case.name()));
        let cmp = reference::Expected::new(&weights, &problem, &x, inputs.mask.as_deref())?
            .compare_half(&ybits, io, RTOL, ATOL)?;
        drop((x, ybits));
        progress.inc(1);

        progress.set_message(format!("{}: timing", case.name()));
        // In place, each call reads the previous call's y as its x (see `measure`).
        let timed = time_calls(backend, plan, sets, progress, |k| {
            if plan.in_place {
                layer.forward_buffers_half_in_place(&mut xs[k], masks[k].as_ref(), shape, io)
            } else {
                layer.forward_buffers_half(&xs[k], masks[k].as_ref(), &mut ys[k], shape, io)
            }
        })?;
        let mut backward = (None, None);
        if let Some((dy, dx)) = grad_buffers.as_mut() {
            backend.synchronize()?;
            backward = time_backward(backend, job, &mut || {
                layer.backward_buffers_half((&xs[0], masks[0].as_ref(), dy), dx, shape, io).map(drop)
            })?;
        }
        let result = ShapeResult::from_samples(case.name(), &problem, case.dist.as_str(), &timed.samples, ceilings)?
            .with_backward(backward.0, backward.1)
            .with_check(cmp.max_abs, cmp.rel_l2, cmp.passed())
            .with_memory(peak, Some(used_ws))
            .with_plan(plan.budget, exec_plan, plan.in_place)
            .with_telemetry(timed.telemetry);
        Ok(Outcome::Done(Box::new(Measured { result, sets })))
    }
}
