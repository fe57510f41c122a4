//! `trimul bench --gpus N`: the sharded forward across N GPUs of this host against the one-GPU
//! forward of the same problem, in the same run (issue 29).
//!
//! Per N: af3 or gpumode as `--formulation` says, B = 1, C = H = 128, masked, the I/O precision
//! of `--precision`. The one-GPU time is `trimul bench`'s (the layer on GPU 0, its fastest
//! plan, device events around each call); the sharded time is, per call, the longest of the
//! ranks' device times, the ranks started together. Medians of `--repeats` after `--warmup`.
//! Before timing, the sharded y is compared with the one-GPU y (a difference beyond `trimul
//! check`'s tolerance fails the run). In place, the timed calls write y over x and the next call
//! reads it: the times are right, the values drift.

use std::process::ExitCode;

use rayon::prelude::*;
use trimul::backend::cuda::CudaBackend;
use trimul::reference;
use trimul::sharded::ShardedGroup;
use trimul::suite::{generate_inputs, Case, Dist};
use trimul::{Backend, Config, Layer, Options, Precision, Problem, Shape, Weights};

use super::args::BenchArgs;
use super::exit::{CliError, CliResult, EXIT_FAILED};
use super::output::emit;
use super::seed::clock_seed;

pub fn run(args: &BenchArgs, gpus: usize) -> CliResult {
    if args.json.is_some() || args.grad || args.fresh_weights || args.max_memory.is_some() || args.suite.is_some() {
        return Err(CliError::usage(
            "--gpus takes --n, --formulation, --direction, --precision, --in-place, --repeats, --warmup and --seed; \
             not --json, --grad, --fresh-weights, --max-memory or --suite (yet)",
        ));
    }
    let ns = if args.n.is_empty() { vec![1024, 2048, 4096] } else { args.n.clone() };
    let seed = args.seed.unwrap_or_else(clock_seed);
    let (warmup, repeats) = (args.warmup.unwrap_or(3) as usize, args.repeats.unwrap_or(15) as usize);
    let config = Config::new(args.formulation.into(), 128, 128)?;
    let af3 = config.formulation == trimul::Formulation::Af3;
    let weights = Weights::random(config, af3, seed)?;
    let devices: Vec<usize> = (0..gpus).collect();
    let one = CudaBackend::new(0)?;
    emit(&format!(
        "trimul bench --gpus {gpus}: {} {} {}, B = 1, C = H = 128, masked{}, seed {seed}; NCCL {}; median of {repeats} after {warmup}",
        config.formulation,
        trimul::Direction::from(args.direction),
        args.precision,
        if args.in_place { ", in place" } else { "" },
        trimul::collective::nccl_version()?,
    ))?;
    emit(&format!(
        "{:>6} {:>12} {:>12} {:>7} {:>14}",
        "N",
        "1 GPU ms",
        format!("{gpus} GPUs ms"),
        "ratio",
        "max |Δ| vs 1"
    ))?;
    let mut disagreements = 0;
    for n in ns {
        let problem = Problem::new(config, Shape::new(1, n), args.direction.into(), true)?
            .with_io(args.precision)
            .in_place(args.in_place);
        let inputs = generate_inputs(&Case::new(n, 1, 128, true, Dist::Normal), seed ^ n as u64);
        let mut x = inputs.x;
        x.par_iter_mut().for_each(|v| *v = args.precision.round(*v));
        let mask = inputs.mask.unwrap_or_default();

        let (one_ms, one_y) = one_gpu(&one, &weights, &problem, &x, &mask, warmup, repeats)?;
        let one_stages = one.stage_times()?;
        let mut group = ShardedGroup::on_local_gpus(&weights, &problem, &devices)?;
        let y = group.forward(&x, Some(&mask))?;
        // `trimul check`'s rule, around the one-GPU result.
        let cmp = reference::compare(&y, &one_y, TOL, TOL);
        let (diff, outside) = (cmp.max_abs, cmp.bad);
        disagreements += usize::from(outside > 0);
        group.upload(&x, Some(&mask))?;
        let sharded_ms = median(group.time(warmup, repeats)?);
        let stages = group.stage_times()?;
        drop(group);
        let flag =
            if outside > 0 { format!("  ({outside} elements outside 2e-2 + 2e-2·|one GPU|)") } else { String::new() };
        emit(&format!("{n:>6} {one_ms:>12.3} {sharded_ms:>12.3} {:>7.3} {diff:>14.3e}{flag}", sharded_ms / one_ms))?;
        let parts: Vec<String> = one_stages.iter().map(|(name, ms)| format!("{name} {ms:.3}")).collect();
        emit(&format!("{:>6} 1 GPU: {}", "", parts.join(", ")))?;
        for (rank, st) in stages.iter().enumerate() {
            let parts: Vec<String> = st.iter().map(|(name, ms)| format!("{name} {ms:.3}")).collect();
            emit(&format!("{:>6} rank {rank}: {}", "", parts.join(", ")))?;
        }
    }
    if disagreements > 0 {
        return Err(CliError {
            code: EXIT_FAILED,
            message: format!("the sharded forward disagreed with the one-GPU forward at {disagreements} N"),
        });
    }
    Ok(ExitCode::SUCCESS)
}

const TOL: f64 = 2e-2;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The one-GPU forward on device buffers of the problem's I/O precision: its median time and y.
fn one_gpu(
    backend: &CudaBackend,
    weights: &Weights,
    problem: &Problem,
    x: &[f32],
    mask: &[f32],
    warmup: usize,
    repeats: usize,
) -> trimul::Result<(f64, Vec<f32>)> {
    let (shape, io) = (problem.shape, problem.io);
    let mut layer = Layer::new(backend, weights, Options::new(problem.direction))?;
    let mut m = backend.alloc(mask.len())?;
    backend.upload(mask, &mut m)?;
    // `warmup + repeats` calls of `call` (one timed forward each), the last with a stage timeline.
    let mut samples = Vec::with_capacity(repeats);
    let mut time = |call: &mut dyn FnMut() -> trimul::Result<f64>| -> trimul::Result<()> {
        for k in 0..warmup + repeats {
            if k + 1 == warmup + repeats {
                backend.record_stages();
            }
            let ms = call()?;
            if k >= warmup {
                samples.push(ms);
            }
        }
        Ok(())
    };
    let y = if io == Precision::F32Io {
        let mut xb = backend.alloc(x.len())?;
        backend.upload(x, &mut xb)?;
        let mut yb = backend.alloc(x.len())?;
        time(&mut || {
            if problem.in_place {
                backend.upload(x, &mut xb)?;
                backend.elapsed_ms(&mut || layer.forward_buffers_in_place(&mut xb, Some(&m), shape))
            } else {
                backend.elapsed_ms(&mut || layer.forward_buffers(&xb, Some(&m), &mut yb, shape))
            }
        })?;
        let mut y = vec![0f32; x.len()];
        backend.download(if problem.in_place { &xb } else { &yb }, &mut y)?;
        y
    } else {
        let bits: Vec<u16> = x.iter().map(|&v| io.encode_half(v)).collect();
        let mut xb = backend.alloc_buffer::<u16>(bits.len())?;
        backend.upload_bits(&bits, &mut xb)?;
        let mut yb = backend.alloc_buffer::<u16>(bits.len())?;
        time(&mut || {
            if problem.in_place {
                backend.upload_bits(&bits, &mut xb)?;
                backend.elapsed_ms(&mut || layer.forward_buffers_half_in_place(&mut xb, Some(&m), shape, io))
            } else {
                backend.elapsed_ms(&mut || layer.forward_buffers_half(&xb, Some(&m), &mut yb, shape, io))
            }
        })?;
        let mut ybits = vec![0u16; bits.len()];
        backend.download_bits(if problem.in_place { &xb } else { &yb }, &mut ybits)?;
        ybits.iter().map(|&v| io.decode_half(v)).collect()
    };
    Ok((median(samples), y))
}
