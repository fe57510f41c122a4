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
//!
//! Past N = 8192 (one H100 cannot hold N = 16384) there is no one-GPU run: x is generated
//! straight into bf16 or f16 and the sharded y is checked against the f64 reference at `trimul
//! check`'s sampled positions instead.

use std::process::ExitCode;

use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use trimul::backend::cuda::CudaBackend;
use trimul::device_io::HostWords;
use trimul::plan::shard::ShardOptions;
use trimul::reference;
use trimul::sharded::ShardedGroup;
use trimul::suite::{generate_inputs, generate_inputs_half, Case, Dist};
use trimul::{Backend, Config, Layer, Options, Precision, Problem, Shape, Weights};

use super::args::BenchArgs;
use super::exit::{CliError, CliResult, EXIT_FAILED};
use super::output::emit;
use super::seed::clock_seed;

pub fn run(args: &BenchArgs, gpus: usize) -> CliResult {
    if args.json.is_some() || args.grad || args.fresh_weights || args.device_time || args.suite.is_some() {
        return Err(CliError::usage(
            "--gpus takes --n, --formulation, --direction, --precision, --in-place, --max-memory (per GPU), --repeats, \
             --warmup and --seed; not --json, --grad, --fresh-weights, --device-time or --suite (yet)",
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
        "trimul bench --gpus {gpus}: {} {} {}, B = 1, C = H = 128, masked{}{}, seed {seed}; NCCL {}; median of {repeats} after {warmup}",
        config.formulation,
        trimul::Direction::from(args.direction),
        args.precision,
        if args.in_place { ", in place" } else { "" },
        args.max_memory.map_or(String::new(), |m| format!(", at most {} per GPU", trimul::units::fmt_bytes(m))),
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
        if n > ONE_GPU_MAX_N {
            disagreements += usize::from(!large(args, gpus, &weights, n, seed, warmup, repeats)?);
            continue;
        }
        let problem = Problem::new(config, Shape::new(1, n), args.direction.into(), true)?
            .with_io(args.precision)
            .in_place(args.in_place);
        let inputs = generate_inputs(&Case::new(n, 1, 128, true, Dist::Normal), seed ^ n as u64);
        let mut x = inputs.x;
        x.par_iter_mut().for_each(|v| *v = args.precision.round(*v));
        let mask = inputs.mask.unwrap_or_default();

        let (one_ms, one_y) = one_gpu(&one, &weights, &problem, &x, &mask, warmup, repeats)?;
        let one_stages = one.stage_times()?;
        let mut group = group_for(&weights, &problem, &devices, args.max_memory)?;
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
            message: format!(
                "the sharded forward failed its check (the one-GPU y, or the f64 reference) at {disagreements} N"
            ),
        });
    }
    Ok(ExitCode::SUCCESS)
}

const TOL: f64 = 2e-2;

/// The group of every GPU in `devices`, each rank within `max_memory` bytes (`--max-memory`:
/// per GPU) when given.
fn group_for(
    weights: &Weights,
    problem: &Problem,
    devices: &[usize],
    max_memory: Option<u64>,
) -> trimul::Result<ShardedGroup> {
    match max_memory {
        None => ShardedGroup::on_local_gpus(weights, problem, devices),
        Some(limit) => {
            let options = ShardOptions { memory_limit: Some(limit), ..ShardOptions::default() };
            ShardedGroup::with_options(weights, problem, devices, options)
        }
    }
}

/// Past this N the sharded forward is not compared with one GPU (at N = 16384 one H100 cannot
/// hold x and t) and the inputs are generated in the I/O precision: see [`large`].
const ONE_GPU_MAX_N: usize = 8192;

/// One N past [`ONE_GPU_MAX_N`]: x generated straight into 16-bit values (`bf16-io` or
/// `f16-io`: 64 GiB of host memory at N = 16384, 128 in f32), one sharded forward checked
/// against the f64 reference at the sampled positions of `trimul check` (y's rows downloaded
/// from their ranks), then timed. Returns whether the check passed.
#[allow(clippy::too_many_arguments)]
fn large(
    args: &BenchArgs,
    gpus: usize,
    weights: &Weights,
    n: usize,
    seed: u64,
    warmup: usize,
    repeats: usize,
) -> CliResult<bool> {
    let problem = Problem::new(weights.config(), Shape::new(1, n), args.direction.into(), true)?
        .with_io(args.precision)
        .in_place(args.in_place);
    let case = Case::new(n, 1, 128, true, Dist::Normal);
    match args.precision {
        Precision::Bf16Io => {
            let (x, mask) = generate_inputs_half::<half::bf16>(&case, seed ^ n as u64);
            large_with(&problem, gpus, args.max_memory, weights, x.reinterpret_cast(), &x, mask.as_deref(), seed, warmup, repeats)
        }
        Precision::F16Io => {
            let (x, mask) = generate_inputs_half::<half::f16>(&case, seed ^ n as u64);
            large_with(&problem, gpus, args.max_memory, weights, x.reinterpret_cast(), &x, mask.as_deref(), seed, warmup, repeats)
        }
        _ => Err(CliError::usage(format!(
            "--gpus at N = {n} > {ONE_GPU_MAX_N} takes --precision bf16-io or f16-io (f32 x would need {} GiB of host memory)",
            (problem.x_len() * 4) >> 30
        ))),
    }
}

#[allow(clippy::too_many_arguments)]
fn large_with<X: Copy + Into<f64> + Sync>(
    problem: &Problem,
    gpus: usize,
    max_memory: Option<u64>,
    weights: &Weights,
    bits: &[u16],
    x: &[X],
    mask: Option<&[f32]>,
    seed: u64,
    warmup: usize,
    repeats: usize,
) -> CliResult<bool> {
    let n = problem.shape.n;
    let devices: Vec<usize> = (0..gpus).collect();
    let mut group = group_for(weights, problem, &devices, max_memory)?;
    group.upload_words(HostWords::Half(bits), mask)?;
    group.forward_uploaded()?;
    let positions = reference::sample_positions(problem.shape, seed);
    let mut rows: Vec<usize> = positions.iter().map(|p| p.i).collect();
    rows.dedup();
    let c = problem.config.c;
    let mut got = Vec::with_capacity(positions.len() * c);
    for i in rows {
        let y = group.y_row(0, i)?;
        for p in positions.iter().filter(|p| p.i == i) {
            got.extend_from_slice(&y[p.j * c..(p.j + 1) * c]);
        }
    }
    let want = reference::forward_at(weights, problem, x, mask, &positions)?;
    let cmp = reference::compare(&got, &want, TOL, TOL);
    let plans: Vec<String> = group.layers().iter().map(|l| l.plan().describe()).collect();
    // In place the timed calls read the previous call's y: the same work, drifting values.
    let ms = median(group.time(warmup, repeats)?);
    let stages = group.stage_times()?;
    emit(&format!(
        "{n:>6} {:>12} {ms:>12.3} {:>7}   sampled f64 check ({} positions): {}; max |Δ| {:.3e}, rel L2 {:.3e}",
        "-",
        "-",
        positions.len(),
        if cmp.passed() { "passed" } else { "FAILED" },
        cmp.max_abs,
        cmp.rel_l2
    ))?;
    emit(&format!("{:>6} plan: {}", "", plans.join(" | ")))?;
    for (rank, st) in stages.iter().enumerate() {
        let parts: Vec<String> = st.iter().map(|(name, ms)| format!("{name} {ms:.3}")).collect();
        emit(&format!("{:>6} rank {rank}: {}", "", parts.join(", ")))?;
    }
    Ok(cmp.passed())
}

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
