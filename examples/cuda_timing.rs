//! Scratch timing driver used before `trimul bench` existed (not part of the product).
#[cfg(feature = "cuda")]
fn main() {
    use trimul::backend::cuda::CudaBackend;
    use trimul::{suite, Backend, Direction, Formulation, Layer, Options};
    let b = CudaBackend::new(0).expect("cuda");
    println!("{:?}", b.info());
    println!("{:?}", b.measure_ceilings().unwrap());
    let mut logs = vec![];
    let fused_modes: Vec<bool> = if std::env::var("BOTH").is_ok() { vec![true, false] } else { vec![true] };
    let only_gpumode = std::env::var("GPUMODE_ONLY").is_ok();
    for fused in fused_modes {
        b.set_fused_input(fused);
        println!("fused input kernel: {fused}");
        for f in [Formulation::GpuMode, Formulation::Af3] {
            if only_gpumode && f == Formulation::Af3 {
                continue;
            }
            for case in suite::bench_cases() {
                let p = case.problem(f, Direction::Outgoing).unwrap();
                let w = trimul::Weights::random(p.config, false, 1).unwrap();
                let inp = suite::generate_inputs(&case, 2);
                let mut layer = Layer::new(&b, &w, Options::default()).unwrap();
                let mut xd = b.alloc(inp.x.len()).unwrap();
                b.upload(&inp.x, &mut xd).unwrap();
                let md = inp.mask.as_ref().map(|m| {
                    let mut d = b.alloc(m.len()).unwrap();
                    b.upload(m, &mut d).unwrap();
                    d
                });
                let mut yd = b.alloc(inp.x.len()).unwrap();
                b.reset_peak_memory();
                for _ in 0..3 {
                    layer.forward_buffers(&xd, md.as_ref(), &mut yd, case.shape()).unwrap();
                }
                let mut t: Vec<f64> = (0..15)
                    .map(|_| {
                        b.elapsed_ms(&mut || layer.forward_buffers(&xd, md.as_ref(), &mut yd, case.shape())).unwrap()
                    })
                    .collect();
                t.sort_by(f64::total_cmp);
                let med = t[7];
                let line = format!(
                    "{f} {}: median {med:.3} ms  min {:.3}  {:.1} TFLOP/s  peak {:.1} MB",
                    case.name(),
                    t[0],
                    p.flops() / med / 1e9,
                    b.peak_memory().unwrap() as f64 / 1e6
                );
                println!("{line}");
                b.record_stages();
                layer.forward_buffers(&xd, md.as_ref(), &mut yd, case.shape()).unwrap();
                let st = b.stage_times().unwrap();
                println!(
                    "    stages: {}",
                    st.iter().map(|(n, ms)| format!("{n} {ms:.3}")).collect::<Vec<_>>().join(" | ")
                );
                if fused {
                    logs.push((f, med));
                }
            }
        }
    }
    for f in [Formulation::GpuMode, Formulation::Af3] {
        if only_gpumode && f == Formulation::Af3 {
            continue;
        }
        let v: Vec<f64> = logs.iter().filter(|l| l.0 == f).map(|l| l.1.ln()).collect();
        println!("{f} geomean {:.3} ms", (v.iter().sum::<f64>() / v.len() as f64).exp());
    }
}
#[cfg(not(feature = "cuda"))]
fn main() {}
