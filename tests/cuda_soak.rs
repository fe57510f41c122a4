//! GPU soak (issue 25): 1,000 forwards in one process with changing shapes, I/O precisions,
//! directions, formulations, masks, in-place mode and memory budgets (none, the narrowest plan,
//! half-way), layers made and dropped along the way. Afterwards the device memory must equal what
//! it was before (the driver's free memory and the backend's own allocation count), no forward may
//! fail, and a sample of results is checked against the f64 reference.
//!
//! The schedule runs twice from one seed: the first pass warms up what a process creates once
//! and keeps (kernel modules, cuBLASLt's kernels for each GEMM shape), the second is the soak
//! measured. Ignored by default (it takes minutes, and it needs a GPU: without one it skips with
//! a visible message). On the GPU machine:
//!
//! ```sh
//! cargo test --release --features cuda --test cuda_soak -- --ignored --nocapture
//! ```
//! `TRIMUL_SOAK_FORWARDS=N` changes the count; `TRIMUL_TEST_SEED` replays a schedule.
#![cfg(feature = "cuda")]

#[path = "support/cuda_device.rs"]
mod cuda_device;

#[path = "support/seed.rs"]
mod test_seed;
use cuda_device::{cuda, MAX_REL_L2, TOL};
use trimul::backend::cuda::CudaBackend;
use trimul::rand::Rng;
use trimul::suite::{self, Case, Dist};
use trimul::{
    reference, Backend, Config, Device, Direction, Formulation, IoElement, Options, Precision, Shape, TriMul, Weights,
};

/// Layer configurations the schedule draws from: both formulations, C and H of the GPU MODE
/// shapes and smaller ones, all within what the fused 16-bit kernels take (C a multiple of 8 up
/// to 512, H a multiple of 16 up to 128).
const CONFIGS: [(Formulation, usize, usize, bool); 5] = [
    (Formulation::GpuMode, 128, 128, false),
    (Formulation::Af3, 128, 128, false),
    (Formulation::Af3, 64, 32, true),
    (Formulation::GpuMode, 384, 128, false),
    (Formulation::Af3, 256, 64, true),
];
const NS: [usize; 9] = [16, 24, 33, 48, 64, 96, 128, 192, 256];
const PRECISIONS: [Precision; 3] = [Precision::F32Io, Precision::Bf16Io, Precision::F16Io];

/// One forward of the schedule.
#[derive(Debug, Clone, Copy)]
struct Step {
    config: usize,
    direction: Direction,
    batch: usize,
    n: usize,
    masked: bool,
    precision: Precision,
    in_place: bool,
    /// 0: no budget; 1: the narrowest plan's total; 2: half-way to the one-pass total.
    budget: u8,
    /// Checked against the reference.
    sampled: bool,
}

fn schedule(seed: u64, count: usize) -> Vec<Step> {
    let mut rng = Rng::new(seed);
    let mut pick = |k: usize| (rng.next_u64() % k as u64) as usize;
    (0..count)
        .map(|i| Step {
            config: pick(CONFIGS.len()),
            direction: if pick(2) == 0 { Direction::Outgoing } else { Direction::Incoming },
            batch: 1 + usize::from(pick(4) == 0),
            n: NS[pick(NS.len())],
            masked: pick(2) == 0,
            precision: PRECISIONS[pick(3)],
            in_place: pick(5) == 0,
            budget: pick(3) as u8,
            sampled: i % 40 == 0,
        })
        .collect()
}

/// `x` rounded through `T` and back (what the layer actually reads), the forward's y as f32.
fn forward_as<T: IoElement>(
    layer: &mut TriMul,
    x: &[f32],
    mask: Option<&[f32]>,
    shape: Shape,
    in_place: bool,
    to: fn(f32) -> T,
    from: fn(T) -> f32,
) -> trimul::Result<(Vec<f32>, Vec<f32>)> {
    let xt: Vec<T> = x.iter().map(|&v| to(v)).collect();
    let seen: Vec<f32> = xt.iter().map(|&v| from(v)).collect();
    let y = if in_place {
        let mut xy = xt;
        layer.forward_in_place(&mut xy, mask, shape)?;
        xy
    } else {
        layer.forward(&xt, mask, shape)?
    };
    Ok((seen, y.into_iter().map(from).collect()))
}

/// Runs the schedule; layers are kept per (config, direction) and all dropped every 100 steps.
fn run_schedule(device: &Device, steps: &[Step], weights: &[Weights], label: &str) {
    let mut layers: std::collections::HashMap<(usize, bool), TriMul> = Default::default();
    for (i, step) in steps.iter().enumerate() {
        if i % 100 == 0 {
            layers.clear();
        }
        let (formulation, c, h, _) = CONFIGS[step.config];
        let key = (step.config, step.direction == Direction::Incoming);
        let layer = layers
            .entry(key)
            .or_insert_with(|| TriMul::new(device, &weights[step.config], Options::new(step.direction)).unwrap());
        let shape = Shape::new(step.batch, step.n);
        let needs = layer.memory_needs_io(shape, step.masked, step.in_place, step.precision).unwrap();
        let budget = match step.budget {
            0 => None,
            1 => Some(needs.min_total()),
            _ => Some(needs.min_total() + (needs.one_pass_total().saturating_sub(needs.min_total())) / 2),
        };
        layer.set_memory_budget(budget);
        let case = Case { h, ..Case::new(step.n, step.batch, c, step.masked, Dist::Normal) };
        let inputs = suite::generate_inputs(&case, 1000 + i as u64);
        let mask = inputs.mask.as_deref();
        let result = match step.precision {
            Precision::F32Io => forward_as(layer, &inputs.x, mask, shape, step.in_place, |v| v, |v| v),
            Precision::Bf16Io => {
                forward_as(layer, &inputs.x, mask, shape, step.in_place, half::bf16::from_f32, half::bf16::to_f32)
            }
            Precision::F16Io => {
                forward_as(layer, &inputs.x, mask, shape, step.in_place, half::f16::from_f32, half::f16::to_f32)
            }
            other => panic!("the soak has no I/O type for {other:?}"),
        };
        let (x_seen, y) = result.unwrap_or_else(|e| panic!("{label} step {i} {step:?}: {e}"));
        assert!(y.iter().all(|v| v.is_finite()), "{label} step {i} {step:?}: non-finite y");
        if step.sampled {
            let config = Config::new(formulation, c, h).unwrap();
            let problem = trimul::Problem::new(config, shape, step.direction, step.masked).unwrap();
            let cmp = reference::check(&weights[step.config], &problem, &x_seen, mask, &y, TOL, TOL).unwrap();
            assert!(cmp.passed() && cmp.rel_l2 <= MAX_REL_L2, "{label} step {i} {step:?}: {cmp}");
        }
    }
}

fn tracked_bytes(b: &CudaBackend) -> u64 {
    // The high-water mark restarted at what is allocated now reads back as the current total.
    b.reset_peak_memory();
    b.peak_memory().unwrap_or(0)
}

#[test]
#[ignore = "GPU soak: minutes on an H100; run with --ignored (skips visibly without a GPU)"]
fn soak_1000_forwards_leave_device_memory_as_it_was() {
    let Some(b) = cuda() else { return };
    b.set_poison(false);
    let count = std::env::var("TRIMUL_SOAK_FORWARDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let seed = test_seed::test_seed("soak_1000_forwards_leave_device_memory_as_it_was");
    let steps = schedule(seed, count);
    let weights: Vec<Weights> = CONFIGS
        .iter()
        .enumerate()
        .map(|(k, &(f, c, h, biases))| Weights::random(Config::new(f, c, h).unwrap(), biases, seed ^ k as u64).unwrap())
        .collect();
    let device = Device::Cuda(b.clone());
    let start = std::time::Instant::now();
    run_schedule(&device, &steps, &weights, "warm-up");
    b.synchronize().unwrap();
    let (free_before, tracked_before) = (b.memory_info().unwrap().unwrap().free, tracked_bytes(&b));
    eprintln!(
        "warm-up: {count} forwards in {:.1} s; device free {free_before} bytes, trimul holds {tracked_before}",
        start.elapsed().as_secs_f64()
    );

    let start = std::time::Instant::now();
    run_schedule(&device, &steps, &weights, "soak");
    b.synchronize().unwrap();
    let (free_after, tracked_after) = (b.memory_info().unwrap().unwrap().free, tracked_bytes(&b));
    eprintln!(
        "soak: {count} forwards in {:.1} s ({} sampled against the reference); device free {free_after} bytes, \
         trimul holds {tracked_after}",
        start.elapsed().as_secs_f64(),
        steps.iter().filter(|s| s.sampled).count()
    );
    assert_eq!(tracked_after, tracked_before, "trimul's own allocations differ after the soak");
    assert_eq!(free_after, free_before, "the device's free memory differs after the soak");
}

/// The schedule covers what the soak promises (checked without a GPU).
#[test]
fn the_schedule_covers_every_kind_of_change() {
    let steps = schedule(7, 1000);
    for p in PRECISIONS {
        assert!(steps.iter().any(|s| s.precision == p), "{p:?}");
    }
    for k in 0..3u8 {
        assert!(steps.iter().any(|s| s.budget == k));
    }
    assert!(steps.iter().any(|s| s.in_place) && steps.iter().any(|s| s.masked));
    assert!(steps.iter().any(|s| s.direction == Direction::Incoming));
    assert!(steps.iter().filter(|s| s.sampled).count() >= 20);
    assert!((0..CONFIGS.len()).all(|c| steps.iter().any(|s| s.config == c)));
}
