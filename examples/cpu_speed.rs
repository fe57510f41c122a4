//! Times the CPU backend against the plain f32 GEMM rate of the same `gemm` crate:
//! `cargo run --release --example cpu_speed -- [N B C H] [repeats]`.
use std::time::Instant;
use trimul::backend::cpu::{gemm_ceiling_gflops, CpuBackend};
use trimul::{Backend, Config, Direction, Formulation, ForwardIo, Problem, Shape, Weights};

/// User+system CPU seconds of this process (Linux), to see through other load on shared machines.
fn cpu_secs() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let f: Vec<&str> = s.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

fn main() -> trimul::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let arg = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
    let (n, b, c, h, reps) = (arg(0, 256), arg(1, 2), arg(2, 128), arg(3, 128), arg(4, 7).max(1));
    let form = match std::env::var("FORM").as_deref() {
        Ok("af3") => Formulation::Af3,
        _ => Formulation::GpuMode,
    };
    let cfg = Config::new(form, c, h)?;
    let w = Weights::random(cfg, false, 1)?;
    let p = Problem::new(cfg, Shape::new(b, n), Direction::Outgoing, false)?;
    let be = CpuBackend::new();
    let prep = be.prepare(&w)?;
    let mut ws = be.workspace(&prep, &p, None)?;
    let x = trimul::rand::Rng::new(2).normal_vec(p.x_len(), 1.0);
    let mut y = vec![0.0f32; x.len()];
    be.forward(&prep, &mut ws, &p, ForwardIo::host(&x, None, &mut y))?;
    let c0 = cpu_secs();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            be.forward(&prep, &mut ws, &p, ForwardIo::host(&x, None, &mut y)).map(|_| t.elapsed().as_secs_f64())
        })
        .collect::<trimul::Result<_>>()?;
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    let got = p.flops() / med / 1e9;
    let cpu = cpu_secs() - c0;
    let c1 = cpu_secs();
    let ceil = gemm_ceiling_gflops(2048, reps);
    let cpu_ceil = cpu_secs() - c1;
    // On a shared machine, wall time also measures the neighbours; CPU seconds see through that.
    if cpu > 0.0 && cpu_ceil > 0.0 {
        let (mine, gemm) =
            (p.flops() * reps as f64 / cpu / 1e9, 2.0 * 2048f64.powi(3) * (reps + 1) as f64 / cpu_ceil / 1e9);
        println!(
            "per CPU-second: backend {mine:.1} GFLOP, 2048³ GEMM {gemm:.1} GFLOP, ratio {:.0}%",
            100.0 * mine / gemm
        );
    }
    println!(
        "{form} N={n} B={b} C={c} H={h}: median {:.1} ms (min {:.1}), {got:.1} GFLOP/s; 2048³ GEMM {ceil:.1} GFLOP/s; ratio {:.0}%",
        med * 1e3,
        times[0] * 1e3,
        100.0 * got / ceil
    );
    // Paired: one forward, then one ceiling GEMM, repeated; the median of the per-pair ratios
    // is steadier than the ratio of two medians taken seconds apart when neighbours come and go.
    let mut ratios: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            be.forward(&prep, &mut ws, &p, ForwardIo::host(&x, None, &mut y)).map(|_| {
                let got = p.flops() / t.elapsed().as_secs_f64() / 1e9;
                got / gemm_ceiling_gflops(2048, 1)
            })
        })
        .collect::<trimul::Result<_>>()?;
    ratios.sort_by(f64::total_cmp);
    println!(
        "paired ratio: median {:.0}% (range {:.0}%..{:.0}%)",
        100.0 * ratios[reps / 2],
        100.0 * ratios[0],
        100.0 * ratios[reps - 1]
    );
    Ok(())
}
