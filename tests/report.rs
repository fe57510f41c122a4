//! `trimul::report`: the bench JSON schema, anchors, and the rendered report.
//!
//! The golden test compares against files in `tests/data/expected/`. After an intended change
//! to the report's layout, regenerate them with `TRIMUL_BLESS=1 cargo test --test report` and
//! review the diff (and the SVGs, rendered to PNG) before committing.

use std::path::{Path, PathBuf};

use trimul::report::{self, Anchor, BenchRun, Ceilings, MachineInfo, ShapeResult, TimingMethod, ToolInfo};
use trimul::{Config, Direction, Formulation, Problem, Shape};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn synthetic_runs() -> Vec<BenchRun> {
    ["synthetic-gpu.json", "synthetic-cpu.json"].iter().map(|f| BenchRun::from_path(data(f)).unwrap()).collect()
}

fn synthetic_anchors() -> Vec<Anchor> {
    Anchor::load(data("anchors-synthetic.json")).unwrap()
}

/// A small valid run built through the public constructors, as `trimul bench` would.
fn built_run() -> BenchRun {
    let ceilings = Ceilings { gemm_tflops: 749.0, gemm_desc: "bf16 8192³".into(), copy_gbs: 2960.0 };
    let shapes = [(256, 2, 128, false), (768, 1, 128, false), (256, 2, 384, true)]
        .iter()
        .enumerate()
        .map(|(i, &(n, b, c, masked))| {
            let cfg = Config::new(Formulation::GpuMode, c, 128).unwrap();
            let p = Problem::new(cfg, Shape::new(b, n), Direction::Outgoing, masked).unwrap();
            let samples: Vec<f64> = (0..15).map(|j| 0.5 + 0.01 * ((i * 7 + j * 3) % 11) as f64).collect();
            ShapeResult::from_samples(format!("bench-{}", i + 1), &p, "normal", &samples, &ceilings)
                .unwrap()
                .with_check(1e-3, 5e-4, true)
                .with_memory(Some(1 << 30), None)
        })
        .collect();
    BenchRun {
        schema_version: report::SCHEMA_VERSION,
        tool: ToolInfo::current(),
        created_utc: report::format_utc(1_795_000_000),
        label: None,
        machine: MachineInfo::from_device_info(
            &trimul::DeviceInfo {
                vendor: "NVIDIA".into(),
                name: "NVIDIA H100 80GB HBM3".into(),
                arch: "sm_90".into(),
                compute_units: 132,
                memory_bytes: 85_000_000_000,
                versions: vec![("CUDA driver".into(), "13.0".into()), ("cuBLASLt".into(), "13.0.1".into())],
            },
            Some("test-host".into()),
        ),
        backend: "cuda".into(),
        precision: "f32-io".into(),
        formulation: "gpumode".into(),
        timing: TimingMethod {
            warmup: 10,
            repeats: 15,
            buffer_sets: 4,
            clock: "device-events".into(),
            fresh_weights: false,
        },
        ceilings,
        shapes,
    }
}

fn assert_one_line(e: &trimul::Error) -> String {
    let s = e.to_string();
    assert!(!s.contains('\n') && !s.is_empty(), "error is not one line: {s:?}");
    s
}

#[test]
fn schema_round_trips() {
    let run = built_run();
    let text = run.to_json_string().unwrap();
    let back = BenchRun::from_json_str(&text).unwrap();
    assert_eq!(back, run);
    assert_eq!(back.to_json_string().unwrap(), text, "serialisation is not stable");

    let dir = std::env::temp_dir().join(format!("trimul-report-rt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("run.json");
    run.write(&path).unwrap();
    assert_eq!(BenchRun::from_path(&path).unwrap(), run);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn committed_synthetic_runs_load_and_round_trip() {
    for f in ["synthetic-gpu.json", "synthetic-cpu.json"] {
        let run = BenchRun::from_path(data(f)).unwrap();
        assert!(run.machine.device.contains("SYNTHETIC"), "{f} must say it is synthetic");
        let again = BenchRun::from_json_str(&run.to_json_string().unwrap()).unwrap();
        // NaN != NaN, so compare through the JSON text instead of PartialEq.
        assert_eq!(again.to_json_string().unwrap(), run.to_json_string().unwrap());
    }
    let gpu = BenchRun::from_path(data("synthetic-gpu.json")).unwrap();
    let nan_shape = gpu.shapes.iter().find(|s| s.key() == "n256_b2_c384").unwrap();
    assert!(nan_shape.rel_l2_err.unwrap().is_nan());
    assert_eq!(nan_shape.passed, Some(false));
}

#[test]
fn unknown_schema_version_is_named() {
    let text = built_run().to_json_string().unwrap().replacen("\"schema_version\": 1", "\"schema_version\": 2", 1);
    // A newer file may also have fields this build lacks; the version must still be what is reported.
    let text = text.replacen("\"shapes\"", "\"shapes_v2\"", 1);
    let e = BenchRun::from_json_str(&text).unwrap_err();
    let msg = assert_one_line(&e);
    assert!(msg.contains("schema_version 2 is not supported (this trimul reads version 1)"), "{msg}");

    let e = BenchRun::from_json_str(r#"{"tool": {}}"#).unwrap_err();
    assert!(assert_one_line(&e).contains("no schema_version"));
    let e = BenchRun::from_json_str(r#"[1, 2]"#).unwrap_err();
    assert!(assert_one_line(&e).contains("top level is an array"));
}

#[test]
fn truncated_json_names_the_file() {
    let text = built_run().to_json_string().unwrap();
    let dir = std::env::temp_dir().join(format!("trimul-report-trunc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cut.json");
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    let e = BenchRun::from_path(&path).unwrap_err();
    let msg = assert_one_line(&e);
    assert!(msg.contains("cut.json") && msg.contains("not valid JSON"), "{msg}");

    let e = BenchRun::from_path(dir.join("absent.json")).unwrap_err();
    assert!(assert_one_line(&e).contains("absent.json"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_field_and_bad_values_are_one_line_errors() {
    let text = built_run().to_json_string().unwrap();
    let e = BenchRun::from_json_str(&text.replacen("\"median_ms\": ", "\"median_ms\": \"x\", \"m\": ", 1)).unwrap_err();
    assert_one_line(&e);
    let e = BenchRun::from_json_str(&text.replacen("\"median_ms\": ", "\"median_ms\": -1.0, \"m\": ", 1)).unwrap_err();
    assert!(assert_one_line(&e).contains("median_ms"));
    // The same shape twice would make the report's rows ambiguous.
    let mut run = built_run();
    run.shapes.push(run.shapes[0].clone());
    let e = BenchRun::from_json_str(&run.to_json_string().unwrap()).unwrap_err();
    assert!(assert_one_line(&e).contains("appears twice"));
}

#[test]
fn empty_run_list_and_bad_baseline_are_rejected() {
    let e = report::render(&[], &[], None).unwrap_err();
    assert!(assert_one_line(&e).contains("no bench runs"));
    let e = report::render(&[built_run()], &[], Some(1)).unwrap_err();
    assert!(assert_one_line(&e).contains("baseline run #2 does not exist"));
    let a = synthetic_anchors();
    let twice = [a[0].clone(), a[0].clone()];
    let e = report::render(&[built_run()], &twice, None).unwrap_err();
    assert!(assert_one_line(&e).contains("two anchors"));
}

#[test]
fn mismatched_shapes_are_listed_not_dropped() {
    let r = report::render(&synthetic_runs(), &synthetic_anchors(), None).unwrap();
    let md = &r.markdown;
    assert!(md.contains("`n512_b1_c128` is missing from #2 cpu (measured by #1 synthetic GPU)"), "{md}");
    assert!(md.contains("`n32_b1_c128` is missing from #1 synthetic GPU"), "{md}");
    assert!(md.contains("`n768_b1_c128`: the distribution differs between runs"), "{md}");
    assert!(md.contains("`n256_b2_c384`: the mask differs between runs"), "{md}");
    assert!(md.contains("Anchor **synthetic anchor two** has no time for `n256_b2_c384`"), "{md}");
    assert!(md.contains("shapes no run measured: `n2048_b1_c128`"), "{md}");
    // Geomeans say they use only the common shapes.
    assert!(md.contains("**geomean** (3 shapes)"), "{md}");
    // Every shape of every run gets a row, including those only one run has.
    for key in ["n256_b2_c128", "n768_b1_c128", "n256_b2_c384", "n512_b1_c128", "n32_b1_c128"] {
        assert!(md.contains(&format!("| `{key}` |")), "no row for {key}");
    }
}

#[test]
fn geomeans_and_speedups_are_over_common_shapes() {
    let runs = synthetic_runs();
    let r = report::render(&runs, &[], None).unwrap();
    // Common shapes: n256_b2_c128, n768_b1_c128, n256_b2_c384. GPU 0.5, 1.5, 0.75; CPU 60, 800, 110.
    let gpu = (0.5f64 * 1.5 * 0.75).cbrt();
    let cpu = (60.0f64 * 800.0 * 110.0).cbrt();
    assert!(r.markdown.contains(&format!("**{gpu:.3}**")), "{}", r.markdown);
    assert!(r.markdown.contains(&format!("**{cpu:.3}**")), "{}", r.markdown);
    // Speedup of the CPU run over the GPU baseline is far below 1, and keeps three digits.
    assert!((gpu / cpu - 0.004741).abs() < 1e-6);
    assert!(r.markdown.contains("| **0.00474×** |"), "{}", r.markdown);
    // With the CPU run as baseline the GPU run shows the inverse.
    let r = report::render(&runs, &[], Some(1)).unwrap();
    assert!(r.markdown.contains("## Speedup over #2 cpu"));
    assert!(r.markdown.contains("| **211×** |"), "{}", r.markdown);
}

#[test]
fn failures_and_unchecked_results_are_visible() {
    let r = report::render(&synthetic_runs(), &[], None).unwrap();
    assert!(r.markdown.contains("**1 of 7 checked results FAIL**; 1 not checked"), "{}", r.markdown);
    assert!(r.markdown.contains("| NaN | NaN | **FAIL** |"), "{}", r.markdown);
}

#[test]
fn output_is_deterministic() {
    let runs = synthetic_runs();
    let anchors = synthetic_anchors();
    let a = report::render(&runs, &anchors, None).unwrap();
    let b = report::render(&runs, &anchors, None).unwrap();
    assert_eq!(a, b);
    let names: Vec<&str> = a.svgs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["time_per_shape.svg", "floor_ratio.svg"]);
    for (name, svg) in &a.svgs {
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{name} is not an SVG document");
        assert!(a.markdown.contains(&format!("]({name})")), "report.md does not link {name}");
    }
}

#[test]
fn one_run_without_anchors_renders() {
    let r = report::render(&[built_run()], &[], None).unwrap();
    assert!(!r.markdown.contains("## Speedup"));
    assert!(r.markdown.contains("Every run measured the same 3 shapes"));
    assert!(r.markdown.contains("3 of 3 checked results pass"));
}

#[test]
fn runs_without_shapes_or_common_shapes_still_render() {
    let mut empty = built_run();
    empty.shapes.clear();
    let r = report::render(&[empty.clone()], &[], None).unwrap();
    assert!(r.markdown.contains("No shape is common to all runs"), "{}", r.markdown);
    let mut other = built_run();
    other.shapes.truncate(1);
    let mut disjoint = built_run();
    disjoint.shapes.drain(..1);
    let r = report::render(&[other, disjoint, empty], &synthetic_anchors(), Some(2)).unwrap();
    assert!(r.markdown.contains("**geomean** (0 shapes)"), "{}", r.markdown);
    assert!(
        r.markdown.contains("`n256_b2_c128` is missing from #2 cuda, #3 cuda (measured by #1 cuda)"),
        "{}",
        r.markdown
    );
    assert_eq!(r.svgs.len(), 2);
}

#[test]
fn h100_anchors_match_spec() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/perf/anchors-h100.json");
    let anchors = Anchor::load(path).unwrap();
    // SPEC.md's geomean row, recomputed from its per-shape numbers (which are rounded to 1 µs).
    let want = [
        ("PyTorch reference f32", 10.177),
        ("best pure-PyTorch fp16", 4.629),
        ("leaderboard #1 human code (Triton)", 1.588),
        ("MI300 winner's H100 code (Triton)", 2.547),
        ("cuEquivariance 0.13 af3 bf16", 1.629),
        ("cuEquivariance 0.13 af3 f32 (tf32)", 2.971),
        ("torch.compile of the f32 reference", 7.705),
    ];
    assert_eq!(anchors.len(), want.len());
    for (name, g) in want {
        let a = anchors.iter().find(|a| a.name == name).unwrap_or_else(|| panic!("no anchor {name:?}"));
        assert_eq!(a.shapes.len(), 7, "{name}");
        let got = (a.shapes.values().map(|v| v.ln()).sum::<f64>() / 7.0).exp();
        assert!((got - g).abs() < 0.002, "{name}: geomean {got}, SPEC.md says {g}");
    }
    assert_eq!(anchors[0].shapes["n1024_b1_c384"], 36.955);
}

/// Compares `actual` with the committed file, or rewrites the file under `TRIMUL_BLESS=1`.
fn golden(name: &str, actual: &str) {
    let path = data("expected").join(name);
    if std::env::var_os("TRIMUL_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (regenerate with TRIMUL_BLESS=1)", path.display()));
    if expected != actual {
        let line = expected.lines().zip(actual.lines()).position(|(a, b)| a != b).unwrap_or(0);
        panic!(
            "{name} differs from {} at line {}:\n  expected: {:?}\n  actual:   {:?}\n(regenerate with TRIMUL_BLESS=1 if intended)",
            path.display(),
            line + 1,
            expected.lines().nth(line),
            actual.lines().nth(line)
        );
    }
}

#[test]
fn golden_report_from_synthetic_runs() {
    let r = report::render(&synthetic_runs(), &synthetic_anchors(), None).unwrap();
    golden("report.md", &r.markdown);
    for (name, svg) in &r.svgs {
        golden(name, svg);
    }
}

#[test]
fn write_puts_files_in_the_directory() {
    let r = report::render(&synthetic_runs(), &[], None).unwrap();
    let dir = std::env::temp_dir().join(format!("trimul-report-out-{}", std::process::id())).join("nested");
    let written = report::write(&r, &dir).unwrap();
    assert_eq!(written.len(), 3);
    assert_eq!(std::fs::read_to_string(dir.join("report.md")).unwrap(), r.markdown);
    assert_eq!(std::fs::read_to_string(dir.join("floor_ratio.svg")).unwrap(), r.svgs[1].1);
    std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
}

/// The sample report in docs/perf/report was generated from the committed runs with
/// `trimul report docs/perf/h100-cuda-gpumode.json docs/perf/h100-cuda-af3.json
/// docs/perf/h100-cuda-gpumode-bf16.json docs/perf/h100-cuda-af3-bf16.json docs/perf/cpu-quick.json
/// --anchors docs/perf/anchors-h100.json --out docs/perf/report`;
/// rendering the same inputs must reproduce it byte for byte.
#[test]
fn committed_sample_report_reproduces() {
    let perf = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/perf");
    let runs: Vec<BenchRun> = [
        "h100-cuda-gpumode.json",
        "h100-cuda-af3.json",
        "h100-cuda-gpumode-bf16.json",
        "h100-cuda-af3-bf16.json",
        "cpu-quick.json",
    ]
    .iter()
    .map(|f| BenchRun::from_path(perf.join(f)).unwrap())
    .collect();
    let anchors = Anchor::load(perf.join("anchors-h100.json")).unwrap();
    let report = trimul::report::render(&runs, &anchors, None).unwrap();
    let dir = perf.join("report");
    let expected = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        report.markdown == expected,
        "docs/perf/report/report.md is not what `trimul report` renders from the committed runs"
    );
    for (name, svg) in &report.svgs {
        let committed = std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(*svg == committed, "docs/perf/report/{name} differs from the rendering of the committed runs");
    }
}
