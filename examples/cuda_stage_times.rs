//! Where a CUDA forward's time goes: for each GPU MODE benchmark shape, one forward with an event
//! recorded after every stage (`CudaBackend::record_stages`), printed as milliseconds per stage.
//! The numbers behind the stage columns of `docs/perf/NOTES.md`.
//!
//! `cargo run --release --features cuda --example cuda_stage_times [gpumode|af3] [f32-io|bf16-io|f16-io|grad|grad-bf16|grad-f16] [NxB[xC],...] [samples] [ranks]`
//!
//! `grad` in place of the precision times the backward's steps instead (f32 x, dy and dx;
//! `grad-bf16` and `grad-f16`: 16-bit ones, through `Layer::backward_buffers_half`).
//!
//! The optional third argument replaces the benchmark shapes with others (C defaults to 128),
//! e.g. `248x2,256x2,264x2` to see how a stage's time follows the number of positions. The
//! fourth is how many recorded forwards to print per shape (default 1): one forward of a long
//! shape varies by a few percent with the GPU's clock, so `4096x1 5` shows the spread. The fifth,
//! a comma-separated list of cuBLASLt candidate ranks for the contraction (`Tuning::contraction_rank`),
//! records each sample once per rank, the ranks interleaved so that the GPU's temperature drifts
//! alike for all of them (each switch plans a new workspace, outside the timed forward).

#[cfg(feature = "cuda")]
fn main() -> trimul::Result<()> {
    use trimul::backend::cuda::{CudaBackend, Tuning};
    use trimul::{suite, Backend, Direction, Formulation, Layer, Options, Precision, Weights};

    let formulation: Formulation = std::env::args().nth(1).as_deref().unwrap_or("gpumode").parse()?;
    // `grad[-bf16|-f16]` in place of the precision: the backward's steps instead of the forward's.
    let arg = std::env::args().nth(2).unwrap_or_else(|| "f32-io".into());
    let grad = arg.starts_with("grad");
    let io: Precision = match arg.as_str() {
        "grad" => Precision::F32Io,
        "grad-bf16" => Precision::Bf16Io,
        "grad-f16" => Precision::F16Io,
        other => other.parse()?,
    };
    let b = CudaBackend::new(0)?;
    println!("{} ({}), {formulation}, {io}", b.info().name, b.info().arch);
    let cases = match std::env::args().nth(3) {
        None => suite::bench_cases(),
        Some(list) => list
            .split(',')
            .map(|spec| {
                let v: Vec<usize> = spec.split('x').map(|d| d.trim().parse().unwrap_or(0)).collect();
                match v[..] {
                    [n, b] if n > 0 && b > 0 => Ok(suite::Case::new(n, b, 128, false, suite::Dist::Normal)),
                    [n, b, c] if n > 0 && b > 0 && c > 0 => Ok(suite::Case::new(n, b, c, false, suite::Dist::Normal)),
                    _ => Err(trimul::Error::InvalidArgument(format!("{spec:?}: expected NxB or NxBxC"))),
                }
            })
            .collect::<trimul::Result<Vec<_>>>()?,
    };
    let samples: usize = match std::env::args().nth(4) {
        None => 1,
        Some(s) => s.parse().map_err(|_| trimul::Error::InvalidArgument(format!("{s:?}: expected a count")))?,
    };
    let ranks: Option<Vec<u8>> = match std::env::args().nth(5) {
        None => None,
        Some(list) => Some(
            list.split(',')
                .map(|r| {
                    r.trim().parse().map_err(|_| trimul::Error::InvalidArgument(format!("{r:?}: expected a rank")))
                })
                .collect::<trimul::Result<Vec<u8>>>()?,
        ),
    };
    for case in cases {
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
        // 16-bit I/O: the same inputs rounded to the I/O type, in 16-bit device buffers.
        let mut half = None;
        if io != Precision::F32Io {
            let bits: Vec<u16> = inputs.x.iter().map(|&v| io.encode_half(v)).collect();
            let mut x16 = b.alloc_buffer::<u16>(bits.len())?;
            b.upload_bits(&bits, &mut x16)?;
            half = Some((x16, b.alloc_buffer::<u16>(bits.len())?));
        }
        let mut dy_dx = None;
        let mut dy_dx16 = None;
        if grad {
            let dy = trimul::rand::Rng::new(3).normal_vec(inputs.x.len(), 1.0);
            if io == Precision::F32Io {
                let mut d = b.alloc(inputs.x.len())?;
                b.upload(&dy, &mut d)?;
                dy_dx = Some((d, b.alloc(inputs.x.len())?));
            } else {
                let bits: Vec<u16> = dy.iter().map(|&v| io.encode_half(v)).collect();
                let mut d = b.alloc_buffer::<u16>(bits.len())?;
                b.upload_bits(&bits, &mut d)?;
                dy_dx16 = Some((d, b.alloc_buffer::<u16>(bits.len())?));
            }
        }
        let mut forward = |layer: &mut Layer<CudaBackend>| match (half.as_mut(), dy_dx.as_mut(), dy_dx16.as_mut()) {
            (_, Some((dy, dx)), _) => layer.backward_buffers(&x, mask.as_ref(), dy, dx, case.shape()).map(drop),
            (Some((x16, _)), None, Some((dy16, dx16))) => {
                layer.backward_buffers_half((x16, mask.as_ref(), dy16), dx16, case.shape(), io).map(drop)
            }
            (None, None, _) => layer.forward_buffers(&x, mask.as_ref(), &mut y, case.shape()),
            (Some((x16, y16)), None, _) => layer.forward_buffers_half(x16, mask.as_ref(), y16, case.shape(), io),
        };
        for _ in 0..3 {
            forward(&mut layer)?;
        }
        for _ in 0..samples {
            for rank in ranks.as_deref().map_or(vec![None], |r| r.iter().map(|&r| Some(r)).collect()) {
                let mut label = case.name();
                if let Some(rank) = rank {
                    b.set_tuning(Some(Tuning { contraction_rank: rank, ..Tuning::default() }));
                    forward(&mut layer)?; // plans the workspace for this rank, untimed
                    label = format!("{label} rank {rank}");
                }
                b.record_stages();
                forward(&mut layer)?;
                let stages = b.stage_times()?;
                let total: f64 = stages.iter().map(|(_, ms)| ms).sum();
                let parts: Vec<String> = stages.iter().map(|(name, ms)| format!("{name} {ms:.3}")).collect();
                println!("{label:<28} {total:7.3} ms = {}", parts.join(" + "));
            }
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("this example needs `--features cuda`");
}
