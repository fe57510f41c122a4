//! Where a CUDA forward's time goes: for each GPU MODE benchmark shape, one forward with an event
//! recorded after every stage (`CudaBackend::record_stages`), printed as milliseconds per stage.
//! The numbers behind the stage columns of `docs/perf/NOTES.md`.
//!
//! `cargo run --release --features cuda --example cuda_stage_times [gpumode|af3]`

#[cfg(feature = "cuda")]
fn main() -> trimul::Result<()> {
    use trimul::backend::cuda::CudaBackend;
    use trimul::{suite, Backend, Direction, Formulation, Layer, Options, Weights};

    let formulation: Formulation = std::env::args().nth(1).as_deref().unwrap_or("gpumode").parse()?;
    let b = CudaBackend::new(0)?;
    println!("{} ({}), {formulation}", b.info().name, b.info().arch);
    for case in suite::bench_cases() {
        let problem = case.problem(formulation, Direction::Outgoing)?;
        let weights = Weights::random(problem.config, false, 1)?;
        let inputs = suite::generate_inputs(&case, 2);
        let mut layer = Layer::new(&b, &weights, Options::default())?;
        let mut x = b.alloc(inputs.x.len())?;
        b.upload(&inputs.x, &mut x)?;
        let mask = match &inputs.mask {
            Some(m) => {
                let mut d = b.alloc(m.len())?;
                b.upload(m, &mut d)?;
                Some(d)
            }
            None => None,
        };
        let mut y = b.alloc(inputs.x.len())?;
        for _ in 0..3 {
            layer.forward_buffers(&x, mask.as_ref(), &mut y, case.shape())?;
        }
        b.record_stages();
        layer.forward_buffers(&x, mask.as_ref(), &mut y, case.shape())?;
        let stages = b.stage_times()?;
        let total: f64 = stages.iter().map(|(_, ms)| ms).sum();
        let parts: Vec<String> = stages.iter().map(|(name, ms)| format!("{name} {ms:.3}")).collect();
        println!("{:<28} {total:7.3} ms = {}", case.name(), parts.join(" + "));
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("this example needs `--features cuda`");
}
