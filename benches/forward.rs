//! Criterion benches of one forward on backend buffers, for every backend this build has and
//! can open: `cargo bench --bench forward [--features cuda] [-- FILTER]`.
//!
//! Names are `{backend}/{formulation}/n{N}_b{B}_c{C}`; throughput is in elements of `x`
//! (`B·N·N·C`), not FLOPs, so criterion's "elem/s" means what it says. Every iteration ends
//! with the backend's synchronize, so a GPU's asynchronous launch is never what gets timed.
//! Run the built bench executable directly with `--bench` (as `cargo bench` does); without it,
//! criterion only runs each bench once as a smoke test.
//! `trimul bench` is the tool for the GPU MODE methodology (buffer rotation, floors, JSON); these
//! benches are for quick before/after comparisons with criterion's statistics.
#![forbid(unsafe_code)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use trimul::backend::cpu::CpuBackend;
use trimul::suite::{self, Case, Dist};
use trimul::{Backend, Formulation, Layer, Options, Weights};

const FORMULATIONS: [Formulation; 2] = [Formulation::GpuMode, Formulation::Af3];

/// Small enough that criterion's samples finish in seconds on a 2-core CPU (N=128 is ~4 GFLOP).
fn cpu_cases() -> Vec<Case> {
    vec![Case::new(64, 1, 128, false, Dist::Normal), Case::new(128, 1, 128, false, Dist::Normal)]
}

/// Registers one bench per case for `backend`, under `{backend}/{formulation}`.
fn bench_backend<B: Backend>(c: &mut Criterion, backend: &B, cases: &[Case], sample_size: usize, time: Duration) {
    for formulation in FORMULATIONS {
        let mut group = c.benchmark_group(format!("{}/{formulation}", backend.kind()));
        group.sample_size(sample_size).measurement_time(time).warm_up_time(time / 3);
        for case in cases {
            let id = format!("n{}_b{}_c{}", case.n, case.batch, case.c);
            match Setup::new(backend, case, formulation) {
                Ok(mut s) => {
                    group.throughput(Throughput::Elements((case.batch * case.n * case.n * case.c) as u64));
                    let mut failure = None;
                    group.bench_function(&id, |b| {
                        b.iter(|| {
                            let r = s.layer.forward_buffers(&s.x, s.mask.as_ref(), &mut s.y, case.shape());
                            if let Err(e) = r.and_then(|_| backend.synchronize()) {
                                failure.get_or_insert(e);
                            }
                            black_box(&s.y);
                        })
                    });
                    if let Some(e) = failure {
                        eprintln!("{}/{formulation}/{id}: forward failed, timings are void: {e}", backend.kind());
                    }
                }
                Err(e) => eprintln!("{}/{formulation}/{id}: skipped: {e}", backend.kind()),
            }
        }
        group.finish();
    }
}

/// Weights prepared once, inputs uploaded once, one forward run to allocate the workspace and
/// surface any error before timing.
struct Setup<B: Backend> {
    layer: Layer<B>,
    x: B::Buffer,
    mask: Option<B::Buffer>,
    y: B::Buffer,
}

impl<B: Backend> Setup<B> {
    fn new(backend: &B, case: &Case, formulation: Formulation) -> trimul::Result<Self> {
        let problem = case.problem(formulation, Default::default())?;
        let weights = Weights::random(problem.config, false, 1)?;
        let mut layer = Layer::new(backend, &weights, Options::default())?;
        let inputs = suite::generate_inputs(case, 2);
        let upload = |data: &[f32]| -> trimul::Result<B::Buffer> {
            let mut buf = backend.alloc(data.len())?;
            backend.upload(data, &mut buf)?;
            Ok(buf)
        };
        let x = upload(&inputs.x)?;
        let mask = inputs.mask.as_deref().map(upload).transpose()?;
        let mut y = backend.alloc(problem.x_len())?;
        layer.forward_buffers(&x, mask.as_ref(), &mut y, case.shape())?;
        backend.synchronize()?;
        Ok(Setup { layer, x, mask, y })
    }
}

fn cpu(c: &mut Criterion) {
    bench_backend(c, &CpuBackend::new(), &cpu_cases(), 10, Duration::from_secs(3));
}

/// The GPU MODE benchmark shapes, with criterion's statistics.
fn gpu(c: &mut Criterion) {
    #[cfg(feature = "cuda")]
    bench_gpu(c, "cuda", trimul::Device::cuda(0).map(|d| if let trimul::Device::Cuda(b) = d { Some(b) } else { None }));
    #[cfg(not(feature = "cuda"))]
    eprintln!("cuda: skipped: not compiled in (build with --features cuda)");

    #[cfg(feature = "rocm")]
    bench_gpu(c, "hip", trimul::Device::hip(0).map(|d| if let trimul::Device::Hip(b) = d { Some(b) } else { None }));
    #[cfg(not(feature = "rocm"))]
    eprintln!("hip: skipped: not compiled in (build with --features rocm)");

    let _ = c;
}

/// GPU device 0 of the `name` backend on the GPU MODE shapes, or why it is skipped (`None`: it
/// opened as another backend).
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn bench_gpu<B: Backend>(c: &mut Criterion, name: &str, device: trimul::Result<Option<B>>) {
    match device {
        Ok(Some(b)) => bench_backend(c, &b, &suite::bench_cases(), 20, Duration::from_secs(3)),
        Ok(None) => eprintln!("{name}: skipped: device 0 did not open as a {} backend", name.to_uppercase()),
        Err(e) => eprintln!("{name}: skipped: {e}"),
    }
}

criterion_group!(benches, cpu, gpu);
criterion_main!(benches);
