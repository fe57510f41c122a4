//! `trimul tune`: sweeps the CUDA backend's per-shape choices and writes a tuning table; with
//! `--backend hip`, validates the HIP backend's MFMA kernels on this GPU again.
//!
//! Per shape: one input set on the device (plus copies up to 256 MiB, rotated as in `bench`),
//! then for the built-in rules and every combination of {contraction candidate 0..k} × {fused
//! output kernel on, off} (× {wgmma input kernel on, off} with `--sweep-input-kernel`): a
//! forward checked against the f64
//! reference (a combination that fails is never chosen), then `warmup` untimed and `repeats`
//! timed calls (device events, median). The fastest correct combination becomes a table entry
//! when it beats the rules by more than `--min-gain`. See `trimul::backend::cuda::tuning`.

use super::args::TuneArgs;
use super::exit::{CliError, CliResult};
#[cfg(any(feature = "cuda", feature = "rocm"))]
use super::output::emit;
use super::seed::clock_seed;

pub fn run(args: &TuneArgs) -> CliResult {
    match args.backend.map(trimul::BackendKind::from) {
        None | Some(trimul::BackendKind::Cuda) => run_cuda(args),
        Some(trimul::BackendKind::Hip) => run_hip(args),
        Some(other) => Err(CliError::usage(format!("--backend {other}: tune runs on cuda or hip"))),
    }
}

/// The suite's cases, narrowed to `--n`.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn cases(args: &TuneArgs) -> CliResult<Vec<trimul::suite::Case>> {
    use super::args::BenchSuite;
    use trimul::suite;
    let cases = match args.suite {
        BenchSuite::Gpumode => suite::bench_cases(),
        BenchSuite::Quick => suite::quick_bench_cases(),
        // Any N of the long suite's form: `--n` names the sizes, else the suite's own.
        BenchSuite::Long => return super::bench::long_cases(&args.n),
    };
    let cases: Vec<_> = cases.into_iter().filter(|c| args.n.is_empty() || args.n.contains(&c.n)).collect();
    if cases.is_empty() {
        return Err(CliError::usage(format!("--n {:?}: no shape of the suite has these N", args.n)));
    }
    Ok(cases)
}

#[cfg(not(feature = "rocm"))]
fn run_hip(_args: &TuneArgs) -> CliResult {
    Err(CliError::from(trimul::Error::NotCompiled { backend: trimul::BackendKind::Hip, feature: "rocm" }))
}

/// `tune --backend hip`: each MFMA fast path validated again for each C and H of the cases
/// (`trimul::validation`), each verdict printed and kept (memory and the verdict file).
#[cfg(feature = "rocm")]
fn run_hip(args: &TuneArgs) -> CliResult {
    use trimul::backend::hip::{HipBackend, HipFastPath};
    use trimul::Backend;

    use super::output::device_summary;

    if args.out.is_some() {
        return Err(CliError::usage("--out: tune --backend hip keeps its verdicts in the verdict file"));
    }
    let backend = HipBackend::new(0)?;
    let mut classes: Vec<(usize, usize)> = cases(args)?.iter().map(|c| (c.c, c.h)).collect();
    classes.sort_unstable();
    classes.dedup();
    emit(&format!(
        "trimul tune: hip ({}), the MFMA fast paths for {} C/H classes",
        device_summary(trimul::BackendKind::Hip, &backend.info()),
        classes.len()
    ))?;
    let store = trimul::validation::VerdictStore::from_env();
    match store.path() {
        Some(p) => emit(&format!("verdicts kept in {}", p.display()))?,
        None => emit(&format!("verdicts kept in memory only ({}=off)", trimul::validation::CACHE_DIR_ENV))?,
    }
    let mut failed = 0;
    for (c, h) in classes {
        for path in HipFastPath::ALL {
            let v = match backend.validate(path, c, h) {
                Ok(v) => v,
                Err(e) => {
                    // A path that cannot run for this shape (no MFMA, past its limits) is not a failure.
                    emit(&format!("{path} C={c} H={h}: not validated: {e}"))?;
                    continue;
                }
            };
            for case in &v.cases {
                let status = if case.passed { "pass" } else { "FAIL" };
                emit(&format!(
                    "  {status} {:<48} {} of {} elements wrong, rel. L2 {:.2e}",
                    case.case, case.bad, case.checked, case.rel_l2
                ))?;
            }
            if let (Some(f), Some(b)) = (v.fast_ms, v.baseline_ms) {
                emit(&format!("  timed at {}: {f:.3} ms with it, {b:.3} ms without", v.timed_shape))?;
            }
            emit(&v.describe())?;
            failed += usize::from(!v.passed);
        }
    }
    if failed > 0 {
        let message = format!("{failed} validation(s) failed: the portable path stays in use for them");
        return Err(CliError { code: super::exit::EXIT_FAILED, message });
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_args: &TuneArgs) -> CliResult {
    let _ = clock_seed;
    Err(CliError::from(trimul::Error::NotCompiled { backend: trimul::BackendKind::Cuda, feature: "cuda" }))
}

#[cfg(feature = "cuda")]
fn run_cuda(args: &TuneArgs) -> CliResult {
    use trimul::backend::cuda::{CudaBackend, Tuning, TuningEntry, TuningTable};
    use trimul::suite::{self, Case};
    use trimul::{reference, Backend, Layer, Options, Weights};

    use super::args::check_output_path;
    use super::output::device_summary;
    use super::seed::SeedStream;

    // A sweep takes minutes: learn about an --out that cannot be written before it, not after.
    if let Some(path) = &args.out {
        check_output_path("--out", path)?;
    }
    let backend = CudaBackend::new(0)?;
    let info = backend.info();
    let cases: Vec<Case> = cases(args)?;
    let (formulation, direction) = (args.formulation.into(), args.direction.into());
    let seed = args.seed.unwrap_or_else(clock_seed);
    // The table is merged into: read it now, so a file that is not a table fails before the sweep.
    let mut table = match &args.out {
        Some(path) if path.exists() => TuningTable::from_file(path)?,
        _ => TuningTable::default(),
    };
    emit(&format!(
        "trimul tune: cuda ({}), {} shapes, {formulation} {direction}, contraction candidates 0..{}, seed {seed}",
        device_summary(trimul::BackendKind::Cuda, &info),
        cases.len(),
        args.candidates.saturating_sub(1),
    ))?;
    emit(&format!("timing: {} warm-up + {} timed calls, median; device events", args.warmup, args.repeats))?;

    // The mma.sync input build lost to the wgmma one on every shape measured on the H100, so it
    // is swept only on request.
    let input_builds: &[Option<bool>] = if args.sweep_input_kernel { &[Some(true), Some(false)] } else { &[None] };
    let mut candidates = vec![None];
    for rank in 0..args.candidates.max(1) {
        for fused_output in [Some(true), Some(false)] {
            for &warpgroup_mma in input_builds {
                candidates.push(Some(Tuning { contraction_rank: rank, fused_output, warpgroup_mma }));
            }
        }
    }
    // x and y in f32 on the device (and x on the host): refuse a size this GPU cannot hold before
    // the host allocates it.
    let io_bytes = |c: &Case| [c.batch, c.n, c.n, c.c, 4 * 2].iter().fold(1u64, |acc, &v| acc.saturating_mul(v as u64));
    if let Some(mem) = backend.memory_info()? {
        if let Some(case) = cases.iter().find(|c| io_bytes(c) > mem.total) {
            return Err(CliError::usage(format!(
                "--n {}: x and y alone take {} of this GPU's {}",
                case.n,
                trimul::units::fmt_bytes(io_bytes(case)),
                trimul::units::fmt_bytes(mem.total)
            )));
        }
    }
    let mut seeds = SeedStream::new(seed);
    for case in &cases {
        let problem = case.problem(formulation, direction)?;
        let shape = problem.shape;
        let weights = Weights::random(problem.config, false, seeds.next())?;
        let inputs = suite::generate_inputs(case, seeds.next());
        let upload = |data: &[f32]| -> trimul::Result<_> {
            let mut buf = backend.alloc(data.len())?;
            backend.upload(data, &mut buf)?;
            Ok(buf)
        };
        let x_bytes = inputs.x.len() as u64 * 4;
        let sets = (256u64 << 20).div_ceil(x_bytes).clamp(1, 8) as usize;
        let xs = (0..sets).map(|_| upload(&inputs.x)).collect::<trimul::Result<Vec<_>>>()?;
        let masks =
            (0..sets).map(|_| inputs.mask.as_deref().map(upload).transpose()).collect::<trimul::Result<Vec<_>>>()?;
        let mut ys = (0..sets).map(|_| backend.alloc(inputs.x.len())).collect::<trimul::Result<Vec<_>>>()?;
        let mut layer = Layer::new(&backend, &weights, Options::new(direction))?;
        let mut y = vec![0f32; inputs.x.len()];
        // One reference for every candidate (sampled at the long sizes: seconds each).
        let expected = reference::Expected::new(&weights, &problem, &inputs.x, inputs.mask.as_deref())?;

        let mut results: Vec<(Option<Tuning>, f64)> = Vec::new();
        // A choice that runs what the rules run is timed once, as the rules: timed twice, noise
        // could make an entry of it.
        for cand in candidates.iter().filter(|c| !c.is_some_and(|t| t.is_the_rules_for(&problem))) {
            // `None` is the built-in rules, forced (`Tuning::default()`) rather than left to the
            // table: a table entry for the shape is what the sweep measures against them.
            backend.set_tuning(Some(cand.unwrap_or_default()));
            let label = cand.map_or("built-in rules".to_string(), |t| t.to_string());
            layer.forward_buffers(&xs[0], masks[0].as_ref(), &mut ys[0], shape)?;
            backend.download(&ys[0], &mut y)?;
            let cmp = expected.compare(&y, 2e-2, 2e-2)?;
            if !cmp.passed() {
                emit(&format!("{:<28} {label}: FAILS the reference check ({cmp}); never chosen", case.name()))?;
                continue;
            }
            let mut samples = Vec::with_capacity(args.repeats as usize);
            for i in 0..(args.warmup + args.repeats) as usize {
                let k = i % sets;
                let ms =
                    backend.elapsed_ms(&mut || layer.forward_buffers(&xs[k], masks[k].as_ref(), &mut ys[k], shape))?;
                if i >= args.warmup as usize {
                    samples.push(ms);
                }
            }
            samples.sort_by(f64::total_cmp);
            let median = samples[samples.len() / 2];
            results.push((*cand, median));
        }
        backend.set_tuning(None);
        let Some(&(_, default_ms)) = results.iter().find(|(c, _)| c.is_none()) else {
            return Err(CliError::from(trimul::Error::InvalidArgument(format!(
                "{}: the built-in rules failed the reference check",
                case.name()
            ))));
        };
        let (best, best_ms) = results
            .iter()
            .filter_map(|(c, ms)| c.map(|c| (c, *ms)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((Tuning::default(), default_ms));
        let keep = best_ms < default_ms * (1.0 - args.min_gain);
        emit(&format!(
            "{:<28} rules {default_ms:.3} ms; best {best_ms:.3} ms ({best}){}",
            case.name(),
            if keep { "; kept" } else { "; not kept (within --min-gain of the rules)" }
        ))?;
        table.record(
            TuningEntry {
                arch: info.arch.clone(),
                device: info.name.clone(),
                formulation,
                direction,
                batch: shape.batch,
                n: shape.n,
                c: problem.config.c,
                h: problem.config.h,
                choice: best,
                ms: best_ms,
                default_ms,
            },
            keep,
        );
    }
    // Every model whose entries the table holds (a merged table holds several), else this one.
    let this = format!("{} ({})", info.name, info.arch);
    let mut devices = table.devices();
    if !devices.contains(&this) {
        devices.push(this.clone());
    }
    table.measured_on =
        format!("entries for {}; last swept on {this} by trimul {}", devices.join(", "), env!("CARGO_PKG_VERSION"));
    match &args.out {
        Some(path) => {
            // Atomically: a failed write leaves the previous table whole.
            trimul::io::write_file(path, (table.to_json() + "\n").as_bytes())
                .map_err(|e| CliError::usage(format!("--out {e}")))?;
            eprintln!("wrote {} ({} entries)", path.display(), table.entries.len());
        }
        None => emit(&table.to_json())?,
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(all(test, any(feature = "cuda", feature = "rocm")))]
mod tests {
    use super::super::args::{Cli, Command};
    use super::*;
    use clap::Parser;

    fn tune_args(argv: &[&str]) -> TuneArgs {
        match Cli::try_parse_from(argv).expect("arguments parse").command {
            Command::Tune(a) => a,
            other => panic!("not tune: {other:?}"),
        }
    }

    /// `--suite long` tunes the suite's sizes, or exactly the sizes `--n` names (sizes outside
    /// the bench suite included); a zero size is a usage error.
    #[test]
    fn long_suite_takes_the_sizes_named() {
        let ns = |argv: &[&str]| cases(&tune_args(argv)).map(|c| c.iter().map(|c| c.n).collect::<Vec<_>>());
        assert_eq!(ns(&["trimul", "tune", "--suite", "long"]).unwrap(), trimul::suite::LONG_SUITE_N);
        assert_eq!(ns(&["trimul", "tune", "--suite", "long", "--n", "1536,2560,1536"]).unwrap(), [1536, 2560]);
        let all = cases(&tune_args(&["trimul", "tune", "--suite", "long", "--n", "2048"])).unwrap();
        assert!(all.iter().all(|c| c.batch == 1 && c.c == 128 && c.h == 128 && !c.masked));
        assert!(ns(&["trimul", "tune", "--suite", "long", "--n", "0"]).is_err());
        // The other suites still filter by --n.
        assert!(ns(&["trimul", "tune", "--n", "1536"]).is_err());
    }
}
