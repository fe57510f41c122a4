//! The `trimul` binary end to end: every command on the CPU backend, exit codes, and the
//! one-line error contract.

use std::path::Path;
use std::process::Command;

use trimul::report::BenchRun;
use trimul::{io, Config, Device, Direction, Formulation, NamingScheme, Options, PairInput, Shape, TriMul, Weights};

#[path = "support/cli.rs"]
mod support;
use support::{assert_usage_error, cpu_quick_bench, s, stderr, stdout, trimul, TempDir};

#[test]
fn info_lists_cpu_as_available() {
    let o = trimul(&["info"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("compiled backends: cpu"), "{out}");
    assert!(out.lines().any(|l| l.starts_with("cpu") && l.contains("available:")), "{out}");
    // Every backend is listed with a status, usable or not.
    for b in ["hip", "cuda"] {
        assert!(out.lines().any(|l| l.starts_with(b)), "{b} missing from: {out}");
    }

    let o = trimul(&["info", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("info --json is JSON");
    let backends = v["backends"].as_array().unwrap();
    assert_eq!(backends.len(), 3);
    let cpu = backends.iter().find(|b| b["backend"] == "cpu").unwrap();
    assert_eq!(cpu["available"], true);
    assert!(cpu["device"]["compute_units"].as_u64().unwrap() >= 1);
    for b in backends.iter().filter(|b| b["available"] == false) {
        assert!(!b["error"].as_str().unwrap().is_empty(), "an unusable backend says why: {b}");
    }
    if !cfg!(feature = "cuda") {
        let cuda = backends.iter().find(|b| b["backend"] == "cuda").unwrap();
        assert!(cuda["error"].as_str().unwrap().contains("--features cuda"), "{cuda}");
    }
}

/// `check --json` of the quick suite on the CPU, af3 incoming, with `extra` arguments: its output,
/// after asserting that the command succeeded and printed JSON.
fn af3_incoming_check_json(seed: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["check", "--backend", "cpu", "--suite", "quick", "--seed", seed];
    args.extend(["--formulation", "af3", "--direction", "incoming"]);
    args.extend(extra);
    args.push("--json");
    let o = trimul(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("check {args:?} is not JSON: {e}"))
}

#[test]
fn check_quick_passes_on_cpu() {
    let o = trimul(&["check", "--backend", "cpu", "--suite", "quick", "--seed", "11"]);
    let out = stdout(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {}", stderr(&o));
    let n = trimul::suite::quick_test_cases().len();
    assert!(out.contains(&format!("{n} passed, 0 failed")), "{out}");
    assert!(out.contains("seed 11"), "the seed is printed: {out}");
    assert_eq!(out.lines().filter(|l| l.contains(" pass ")).count(), n, "{out}");

    // The same run as JSON, af3 with biases and incoming.
    let v = af3_incoming_check_json("11", &[]);
    assert_eq!((v["passed"].as_u64(), v["failed"].as_u64()), (Some(n as u64), Some(0)));
    assert_eq!((v["formulation"].as_str(), v["direction"].as_str()), (Some("af3"), Some("incoming")));
    for case in v["cases"].as_array().unwrap() {
        let rel = case["comparison"]["rel_l2"].as_f64().unwrap();
        // f32 against f64: far below the pass tolerance, and not a suspicious exact zero.
        assert!(rel > 0.0 && rel < 1e-4, "{case}");
    }
}

#[test]
fn bench_grad_times_the_backward_on_cpu() {
    let dir = TempDir::new("bench-grad");
    let json = dir.path("grad.json");
    let o = cpu_quick_bench(&json, &["--n", "512", "--repeats", "1", "--grad"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("× the forward; forward + backward"), "{}", stdout(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let shapes = v["shapes"].as_array().unwrap();
    assert_eq!(shapes.len(), 1);
    let (fwd, bwd) = (shapes[0]["median_ms"].as_f64().unwrap(), shapes[0]["backward_median_ms"].as_f64().unwrap());
    // The backward recomputes the forward and does twice its GEMM work on top.
    assert!(bwd > fwd, "backward {bwd} ms, forward {fwd} ms");
    // Refused where it cannot run, before anything is timed.
    let o = cpu_quick_bench(&json, &["--grad", "--in-place"]);
    assert_usage_error(&o, "--grad cannot be combined");
    // Holding the stream is for CUDA's device events; the CPU has neither.
    let o = cpu_quick_bench(&json, &["--device-time"]);
    assert_usage_error(&o, "--device-time");
}

#[test]
fn check_grad_compares_every_gradient_on_cpu() {
    let v = af3_incoming_check_json("12", &["--grad"]);
    let n = trimul::suite::quick_test_cases().len() as u64;
    assert_eq!((v["passed"].as_u64(), v["failed"].as_u64(), v["grad"].as_bool()), (Some(n), Some(0), Some(true)));
    assert_eq!(v["grad_rel_l2_max"].as_f64(), Some(2e-3));
    for case in v["cases"].as_array().unwrap() {
        let grads = case["gradients"].as_array().expect("every case has its gradients");
        let names: Vec<&str> = grads.iter().map(|g| g["name"].as_str().unwrap()).collect();
        // x, two LayerNorms and six linear layers, each with its bias in af3: 2 + 2 + 12 + 1.
        assert_eq!(names.len(), 17, "{names:?}");
        assert!(names.contains(&"x") && names.contains(&"out_proj.bias"), "{names:?}");
        for g in grads {
            let rel = g["rel_l2"].as_f64().unwrap();
            assert!(rel > 0.0 && rel < 1e-4, "{g}");
        }
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_is_a_usage_error() {
    let o = trimul(&["check", "--backend", "cuda", "--suite", "quick"]);
    assert_usage_error(&o, "--features cuda");
    assert!(stdout(&o).is_empty(), "nothing ran: {}", stdout(&o));
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(trimul(&["bench", "--repeats", "0"]).status.code(), Some(2));
    let o = trimul(&["bench", "--backend", "cpu", "--json", "/nonexistent-dir-for-trimul/run.json"]);
    assert_usage_error(&o, "does not exist");
    assert!(stdout(&o).is_empty(), "refused before measuring: {}", stdout(&o));
    assert_eq!(trimul(&["check", "--suite", "nope"]).status.code(), Some(2));
    assert_eq!(trimul(&["frobnicate"]).status.code(), Some(2));
    let o = Command::new(env!("CARGO_BIN_EXE_trimul")).args(["info"]).env("TRIMUL_BACKEND", "tpu").output().unwrap();
    assert!(o.status.success(), "info reports a bad TRIMUL_BACKEND rather than failing");
    assert!(stdout(&o).contains("unknown backend"), "{}", stdout(&o));
    let o = Command::new(env!("CARGO_BIN_EXE_trimul"))
        .args(["check", "--suite", "quick"])
        .env("TRIMUL_BACKEND", "tpu")
        .output()
        .unwrap();
    assert_usage_error(&o, "TRIMUL_BACKEND");
}

/// `--gpus` (the sharded forward) is refused up front where it cannot run: fewer than two GPUs,
/// another backend, the backward, or bench options it does not take yet.
#[test]
fn gpus_flag_is_refused_where_it_cannot_run() {
    assert_eq!(trimul(&["check", "--gpus", "1"]).status.code(), Some(2));
    let o = trimul(&["check", "--backend", "cpu", "--suite", "quick", "--gpus", "2"]);
    assert_usage_error(&o, "--gpus");
    assert!(stdout(&o).is_empty(), "nothing ran: {}", stdout(&o));
    let o = trimul(&["bench", "--gpus", "2", "--json", "run.json"]);
    assert_usage_error(&o, "--gpus");
    assert!(stdout(&o).is_empty(), "nothing ran: {}", stdout(&o));
    let o = trimul(&["bench", "--gpus", "2", "--grad"]);
    assert_usage_error(&o, if cfg!(feature = "cuda") { "--grad" } else { "--features cuda" });
}

/// Counts and paths that could only fail after the work, or exhaust memory, are refused first;
/// a bench that measures nothing is a failure, not a success.
#[test]
fn bad_counts_and_output_paths_fail_before_the_work() {
    for flag in ["--repeats", "--warmup"] {
        let o = trimul(&["bench", "--backend", "cpu", flag, "4294967295"]);
        assert_eq!(o.status.code(), Some(2), "{flag}: {}", stderr(&o));
    }
    let dir = TempDir::new("paths");
    let d = dir.0.to_str().unwrap();
    let o = trimul(&["bench", "--backend", "cpu", "--json", d]);
    assert_usage_error(&o, "is a directory");
    assert!(stdout(&o).is_empty(), "refused before measuring: {}", stdout(&o));
    let o = trimul(&["run", "--weights", "w.st", "--input", "x.st", "--output", "/nonexistent-dir-for-trimul/y.st"]);
    assert_usage_error(&o, "does not exist");
    let o = trimul(&["bench", "--backend", "cpu", "--n", "256", "--max-memory", "1"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("no shape was measured"), "{}", stderr(&o));
}

/// Writes the tensors of several layer files into one safetensors file, each layer's names under
/// its prefix, as in a checkpoint that holds many layers.
fn merged_checkpoint(layers: &[(&Path, &str)], dst: &Path) {
    let files: Vec<Vec<u8>> = layers.iter().map(|(src, _)| std::fs::read(src).unwrap()).collect();
    let mut tensors = Vec::new();
    for (bytes, (_, prefix)) in files.iter().zip(layers) {
        let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
        tensors.extend(st.tensors().into_iter().map(|(n, v)| (format!("{prefix}{n}"), v)));
    }
    std::fs::write(dst, safetensors::serialize(tensors, None).unwrap()).unwrap();
}

#[test]
fn run_round_trip_matches_the_library() {
    let dir = TempDir::new("run");
    let (batch, n, c, h) = (2, 12, 16, 8);
    let config = Config::new(Formulation::Af3, c, h).unwrap();
    let weights = Weights::random(config, true, 3).unwrap();
    weights.to_safetensors(dir.path("layer3.safetensors"), NamingScheme::Packed).unwrap();
    let decoy = Weights::random(config, true, 4).unwrap();
    decoy.to_safetensors(dir.path("layer4.safetensors"), NamingScheme::Packed).unwrap();
    merged_checkpoint(
        &[
            (&dir.path("layer4.safetensors"), "trunk.layers.4.tri_mul_in."),
            (&dir.path("layer3.safetensors"), "trunk.layers.3.tri_mul_in."),
        ],
        &dir.path("w.safetensors"),
    );
    let mut rng = trimul::rand::Rng::new(9);
    let x = rng.normal_vec(batch * n * n * c, 1.0);
    let mask = rng.mask_vec(batch * n * n);
    let input = PairInput::new(x.clone(), Some(mask.clone()), batch, n, c).unwrap();
    io::write_input(dir.path("x.safetensors"), &input).unwrap();
    // `trimul run` on x.safetensors with the weights and the output named (files in `dir`), and
    // `args` added.
    let run = |weights: &str, output: &str, args: &[&str]| {
        let (w, x, y) = (dir.path(weights), dir.path("x.safetensors"), dir.path(output));
        let mut all = vec!["run", "--weights", s(&w), "--input", s(&x), "--output", s(&y)];
        all.extend_from_slice(args);
        trimul(&all)
    };

    let o = run(
        "w.safetensors",
        "y.safetensors",
        &["--backend", "cpu", "--direction", "incoming", "--prefix", "trunk.layers.3.tri_mul_in"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).is_empty(), "run reports on stderr only");
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("af3 incoming") && err.contains("B=2 N=12 C=16 H=8") && err.contains("masked"), "{err}");

    let (y, dims) = io::read_output(dir.path("y.safetensors")).unwrap();
    assert_eq!(dims, [batch, n, n, c]);
    let mut layer = TriMul::new(&Device::cpu(), &weights, Options::new(Direction::Incoming)).unwrap();
    let want = layer.forward(&x, Some(&mask), Shape::new(batch, n)).unwrap();
    assert_eq!(y.len(), want.len());
    let worst = y.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst <= 1e-5, "CLI and library differ by {worst}");
    assert!(y.iter().all(|v| v.is_finite()));

    // The prefix is needed: without it the file holds two layers.
    let o = run("w.safetensors", "y2.safetensors", &["--backend", "cpu"]);
    assert_usage_error(&o, "trunk.layers.3.tri_mul_in");
    assert!(!dir.path("y2.safetensors").exists());

    // Weights for another C.
    let other = Weights::random(Config::new(Formulation::GpuMode, 24, 8).unwrap(), false, 4).unwrap();
    other.to_safetensors(dir.path("w24.safetensors"), NamingScheme::GpuMode).unwrap();
    let o = run("w24.safetensors", "y3.safetensors", &[]);
    assert_usage_error(&o, "C = 16");
}

#[test]
fn bench_json_parses_and_reports() {
    let dir = TempDir::new("bench");
    let json = dir.path("cpu.json");
    let o = cpu_quick_bench(&json, &["--repeats", "2", "--label", "ci"]);
    let out = stdout(&o);
    assert!(o.status.success(), "stdout: {out}\nstderr: {}", stderr(&o));
    assert!(out.contains("geomean"), "{out}");
    assert!(out.contains("CPU speed bar: n256_b2_c128 at"), "{out}");

    let run = BenchRun::from_path(&json).expect("bench JSON parses as BenchRun");
    let quick = trimul::suite::quick_bench_cases();
    assert_eq!(run.shapes.len(), quick.len());
    assert_eq!((run.backend.as_str(), run.formulation.as_str(), run.label.as_deref()), ("cpu", "gpumode", Some("ci")));
    assert_eq!((run.timing.repeats, run.timing.warmup, run.timing.clock.as_str()), (2, 0, "host"));
    assert!(run.timing.buffer_sets >= 2, "64 MiB inputs rotate over several sets: {:?}", run.timing);
    assert!(run.ceilings.gemm_tflops > 0.0 && run.ceilings.copy_gbs > 0.0, "{:?}", run.ceilings);
    for (shape, case) in run.shapes.iter().zip(&quick) {
        assert_eq!((shape.n, shape.batch, shape.c, shape.masked), (case.n, case.batch, case.c, case.masked));
        assert_eq!(shape.repeats, 2);
        assert_eq!(shape.passed, Some(true), "{shape:?}");
        assert!(shape.median_ms > 0.0 && shape.min_ms <= shape.median_ms, "{shape:?}");
        assert!(shape.tflops > 0.0 && shape.floor_ms > 0.0, "{shape:?}");
    }

    // The file feeds `trimul report`.
    let out_dir = dir.path("report");
    let o = trimul(&["report", s(&json), "--out", s(&out_dir)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let md = std::fs::read_to_string(out_dir.join("report.md")).unwrap();
    assert!(md.contains("n256_b2_c128"), "{md}");
}

/// `--suite long --n` times the long suite's form (B = 1, C = H = 128, unmasked, normal) at the
/// sizes named, in their order, outside the suite's own sizes too; N = 0 is a usage error.
#[test]
fn bench_long_suite_takes_any_size_named() {
    let dir = TempDir::new("bench-long");
    let json = dir.path("long.json");
    let args = ["bench", "--backend", "cpu", "--suite", "long", "--n", "24,16,24", "--repeats", "1", "--warmup", "0"];
    let o = trimul(&[&args[..], &["--json", s(&json)]].concat());
    assert!(o.status.success(), "stdout: {}\nstderr: {}", stdout(&o), stderr(&o));
    let run = BenchRun::from_path(&json).expect("bench JSON parses as BenchRun");
    let got: Vec<_> = run.shapes.iter().map(|r| (r.n, r.batch, r.c, r.masked, r.passed)).collect();
    assert_eq!(got, [(24, 1, 128, false, Some(true)), (16, 1, 128, false, Some(true))]);
    let o = trimul(&["bench", "--backend", "cpu", "--suite", "long", "--n", "0"]);
    assert_usage_error(&o, "at least 1");
}

#[test]
fn report_rejects_bad_input_in_one_line() {
    let dir = TempDir::new("report");
    let good = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/synthetic-cpu.json");
    let text = std::fs::read_to_string(&good).unwrap();
    let out = dir.path("out");

    let truncated = dir.path("truncated.json");
    std::fs::write(&truncated, &text[..text.len() / 2]).unwrap();
    assert_usage_error(&trimul(&["report", s(&truncated), "--out", s(&out)]), "truncated.json");

    let future = dir.path("future.json");
    std::fs::write(&future, text.replacen("\"schema_version\": 1", "\"schema_version\": 99", 1)).unwrap();
    assert_usage_error(&trimul(&["report", s(&future), "--out", s(&out)]), "schema_version 99");

    let missing = dir.path("missing.json");
    assert_usage_error(&trimul(&["report", s(&missing), "--out", s(&out)]), "missing.json");

    assert_usage_error(&trimul(&["report", s(&good), "--out", s(&out), "--baseline", "2"]), "baseline");
    assert!(!out.join("report.md").exists(), "nothing written on error");

    // No runs at all is caught by the argument parser, with the same exit code.
    assert_eq!(trimul(&["report", "--out", s(&out)]).status.code(), Some(2));

    let o = trimul(&["report", s(&good), "--out", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join("report.md").exists());
}
