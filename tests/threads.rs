//! Layers and threads (issue 25). The API's rules: a layer (`TriMul`, `Layer<B>`) is `Send`, and
//! a forward takes `&mut self` (it reuses the layer's workspace), so one layer serves one thread
//! at a time: share it behind a `Mutex`, or give each thread its own layer; backends (`Device`)
//! are `Clone + Send + Sync`, and layers of one device may run on several threads at once.
//!
//! Both ways are checked here with four threads: four layers of one device each on its own
//! thread, and one layer shared by four threads behind a `Mutex`, each thread running its own
//! shapes (so the shared layer re-plans its workspace between callers), several rounds. Every
//! result must equal, bit for bit, the result of the same forward run alone on one thread before.
//!
//! Runs on the CPU backend always, and on CUDA when the build has the `cuda` feature and a device
//! opens (skipped with a visible message otherwise; `TRIMUL_REQUIRE_DEVICE=1` makes a missing
//! GPU a failure). On the GPU machine: `cargo test --release --features cuda --test threads`.

use std::io::Write;
use std::sync::{Arc, Mutex};

use trimul::suite::{self, Case, Dist};
use trimul::{Config, Device, Direction, Formulation, Options, TriMul, Weights};

const THREADS: usize = 4;
const ROUNDS: usize = 3;

/// The devices to test on: the CPU, and CUDA where it opens.
fn devices() -> Vec<Device> {
    let mut v = vec![Device::cpu()];
    if cfg!(feature = "cuda") {
        match Device::cuda(0) {
            Ok(d) => v.push(d),
            Err(e) if std::env::var_os("TRIMUL_REQUIRE_DEVICE").is_some() => {
                panic!("CUDA device required (TRIMUL_REQUIRE_DEVICE is set) but unavailable: {e}")
            }
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "SKIPPED (CUDA part of the thread tests): no CUDA device: {e}");
            }
        }
    } else {
        let _ = writeln!(std::io::stderr(), "SKIPPED (CUDA part of the thread tests): built without --features cuda");
    }
    v
}

/// One thread's work: a shape, a direction and inputs, distinct per thread.
struct Job {
    case: Case,
    direction: Direction,
    x: Vec<f32>,
    mask: Option<Vec<f32>>,
}

fn weights() -> Weights {
    // af3 with biases, C = 64, H = 32: every stage and the bias paths; fused kernels on CUDA.
    Weights::random(Config::new(Formulation::Af3, 64, 32).unwrap(), true, 25).unwrap()
}

fn jobs() -> Vec<Job> {
    let shapes = [(24, 1, true), (17, 2, false), (32, 1, false), (20, 1, true)];
    shapes
        .iter()
        .enumerate()
        .map(|(i, &(n, batch, masked))| {
            let case =
                Case { h: 32, ..Case::new(n, batch, 64, masked, if i % 2 == 0 { Dist::Normal } else { Dist::Cauchy }) };
            let inputs = suite::generate_inputs(&case, 100 + i as u64);
            let direction = if i % 2 == 0 { Direction::Outgoing } else { Direction::Incoming };
            Job { case, direction, x: inputs.x, mask: inputs.mask }
        })
        .collect()
}

fn run(layer: &mut TriMul, job: &Job) -> Vec<f32> {
    let mut y = vec![f32::NAN; job.x.len()];
    layer.forward_into(&job.x, job.mask.as_deref(), &mut y, job.case.shape()).unwrap();
    y
}

/// Each job alone, on one thread, with a layer of its own.
fn single_threaded(device: &Device, w: &Weights, jobs: &[Job]) -> Vec<Vec<f32>> {
    jobs.iter()
        .map(|job| {
            let mut layer = TriMul::new(device, w, Options::new(job.direction)).unwrap();
            let y = run(&mut layer, job);
            assert!(y.iter().all(|v| v.is_finite()), "{}: the single-threaded result is not finite", job.case.name());
            y
        })
        .collect()
}

fn assert_bits_equal(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits()) {
        panic!("{what}: y[{i}] = {:e}, single-threaded {:e}", got[i], want[i]);
    }
}

#[test]
fn four_threads_each_with_its_own_layer_on_one_device() {
    let w = weights();
    let jobs = jobs();
    for device in devices() {
        let want = single_threaded(&device, &w, &jobs);
        std::thread::scope(|s| {
            for (t, (job, want)) in jobs.iter().zip(&want).enumerate() {
                let device = device.clone();
                let w = &w;
                s.spawn(move || {
                    let mut layer = TriMul::new(&device, w, Options::new(job.direction)).unwrap();
                    for round in 0..ROUNDS {
                        let y = run(&mut layer, job);
                        assert_bits_equal(&y, want, &format!("{} thread {t} round {round}", device.kind()));
                    }
                });
            }
        });
        eprintln!("{}: {THREADS} threads × {ROUNDS} rounds, own layers, equal to single-threaded", device.kind());
    }
}

#[test]
fn one_layer_shared_by_four_threads_behind_a_mutex() {
    let w = weights();
    // One direction for the shared layer: it is a layer option.
    let jobs: Vec<Job> = jobs().into_iter().map(|j| Job { direction: Direction::Outgoing, ..j }).collect();
    for device in devices() {
        let want = single_threaded(&device, &w, &jobs);
        let shared = Arc::new(Mutex::new(TriMul::new(&device, &w, Options::default()).unwrap()));
        std::thread::scope(|s| {
            for (t, (job, want)) in jobs.iter().zip(&want).enumerate() {
                let shared = Arc::clone(&shared);
                let kind = device.kind();
                s.spawn(move || {
                    for round in 0..ROUNDS {
                        let y = {
                            let mut layer = shared.lock().unwrap();
                            run(&mut layer, job)
                        };
                        assert_bits_equal(&y, want, &format!("{kind} shared layer, thread {t} round {round}"));
                    }
                });
            }
        });
        eprintln!("{}: {THREADS} threads × {ROUNDS} rounds, one shared layer, equal to single-threaded", device.kind());
    }
}

/// The types the sharing above relies on, checked at compile time.
#[test]
fn layers_are_send_and_devices_are_shareable() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<TriMul>();
    send_sync::<Mutex<TriMul>>();
    send_sync::<Device>();
}
