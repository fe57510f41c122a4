//! `trimul::report`: the bench JSON schema, anchors, the rendered report, and the JSON that
//! `bench` and `check` write.
//!
//! The golden test compares against files in `tests/data/expected/`. After an intended change
//! to the report's layout, regenerate them with `TRIMUL_BLESS=1 cargo test --test report` and
//! review the diff (and the SVGs, rendered to PNG) before committing.

use std::path::{Path, PathBuf};

use trimul::report::gpu_probe::NvidiaSmi;
use trimul::report::{
    self, Anchor, BenchRun, Ceilings, GpuSample, GpuSpan, MachineInfo, RunTelemetry, ShapeResult, ShapeTelemetry,
    TimingMethod, ToolInfo,
};
use trimul::{Config, Direction, Formulation, Problem, Shape};

#[path = "support/cli.rs"]
mod support;
use support::{cpu_quick_bench, stderr, stdout, trimul, TempDir};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn perf(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/perf").join(name)
}

fn load(names: &[&str]) -> Vec<BenchRun> {
    names.iter().map(|f| BenchRun::from_path(data(f)).unwrap()).collect()
}

/// The `gpumode` suite's synthetic runs: a gpumode f32 GPU run, a gpumode f32 CPU run with other
/// shapes, an af3 bf16 GPU run with clocks and power.
const GPUMODE_RUNS: [&str; 3] = ["synthetic-gpu.json", "synthetic-cpu.json", "synthetic-af3-bf16.json"];
/// The `long` suite's: two old-format gpumode f32 runs (no suite recorded) that share a column,
/// one af3 bf16 run.
const LONG_RUNS: [&str; 3] = ["synthetic-long-1.json", "synthetic-long-2.json", "synthetic-long-af3-bf16.json"];

fn synthetic_runs() -> Vec<BenchRun> {
    load(&GPUMODE_RUNS.iter().chain(&LONG_RUNS).copied().collect::<Vec<_>>())
}

fn synthetic_anchors() -> Vec<Anchor> {
    Anchor::load(data("anchors-synthetic.json")).unwrap()
}

fn sample(clock: f64, power: f64, reasons: &[&str]) -> GpuSample {
    GpuSample {
        sm_clock_mhz: Some(clock),
        max_sm_clock_mhz: Some(1980.0),
        power_w: Some(power),
        power_limit_w: Some(700.0),
        clock_event_reasons: Some(reasons.iter().map(|r| r.to_string()).collect()),
    }
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
            let during = GpuSpan::from_samples(&[sample(1980.0, 400.0, &[]), sample(1700.0, 690.0, &["sw_power_cap"])]);
            ShapeResult::from_samples(format!("bench-{}", i + 1), &p, "normal", &samples, &ceilings)
                .unwrap()
                .with_check(1e-3, 5e-4, true)
                .with_memory(Some(1 << 30), None)
                .with_telemetry(Some(ShapeTelemetry {
                    before: Some(sample(1980.0, 120.0, &["gpu_idle"])),
                    during: Some(during),
                    after: None,
                }))
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
        suite: Some("gpumode".into()),
        seed: Some(42),
        timing: TimingMethod {
            warmup: 10,
            repeats: 15,
            buffer_sets: 4,
            clock: "device-events".into(),
            fresh_weights: false,
        },
        ceilings,
        telemetry: Some(RunTelemetry {
            source: "nvidia-smi".into(),
            available: true,
            reason: None,
            gpu: Some("GPU-0".into()),
            driver_version: Some("580.65.06".into()),
            interval_ms: Some(100),
        }),
        shapes,
    }
}

fn assert_one_line(e: &trimul::Error) -> String {
    let s = e.to_string();
    assert!(!s.contains('\n') && !s.is_empty(), "error is not one line: {s:?}");
    s
}

/// The lines of the markdown section that starts with `heading` (up to the next heading of the
/// same or a higher level), within the section of suite `suite`.
fn section<'a>(md: &'a str, suite: &str, heading: &str) -> Vec<&'a str> {
    let start = format!("## Suite `{suite}`");
    let lines: Vec<&str> =
        md.lines().skip_while(|l| *l != start).skip(1).take_while(|l| !l.starts_with("## ")).collect();
    lines.into_iter().skip_while(|l| *l != heading).skip(1).take_while(|l| !l.starts_with("### ")).collect()
}

/// The `(run column, anchor)` cells of the rows of a suite's "Against the anchors" table.
fn anchor_pairs<'a>(md: &'a str, suite: &str) -> Vec<(&'a str, &'a str)> {
    section(md, suite, "### Against the anchors")
        .into_iter()
        .filter(|l| l.starts_with("| #"))
        .map(|l| {
            let cells: Vec<&str> = l.split(" | ").collect();
            (cells[0].trim_start_matches("| "), cells[1])
        })
        .collect()
}

/// The formulation and precision of the run a column's name starts with (`#3 …` or `#4+#5 …`),
/// read from the run itself rather than from the name.
fn class_of_column(runs: &[BenchRun], column: &str) -> (String, String) {
    let first: usize =
        column.trim_start_matches('#').split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap();
    let run = &runs[first - 1];
    (run.formulation.clone(), run.precision.clone())
}

#[test]
fn schema_round_trips() {
    let run = built_run();
    let text = run.to_json_string().unwrap();
    let back = BenchRun::from_json_str(&text).unwrap();
    assert_eq!(back, run);
    assert_eq!(back.to_json_string().unwrap(), text, "serialisation is not stable");
    for field in ["\"suite\": \"gpumode\"", "\"seed\": 42", "\"driver_version\": \"580.65.06\"", "\"sw_power_cap\""] {
        assert!(text.contains(field), "{field} not written: {text}");
    }

    let dir = TempDir::new("report-rt");
    let path = dir.path("run.json");
    run.write(&path).unwrap();
    assert_eq!(BenchRun::from_path(&path).unwrap(), run);
}

#[test]
fn files_without_the_newer_fields_still_read() {
    // Written before suite, seed and telemetry were recorded.
    for (file, suite) in [
        ("h100-cuda-gpumode.json", "gpumode"),
        ("h100-cuda-af3-bf16.json", "gpumode"),
        ("h100-cuda-long.json", "long"),
        ("h100-cuda-long-inplace-af3-bf16.json", "long"),
        ("cpu-quick.json", "quick"),
    ] {
        let run = BenchRun::from_path(perf(file)).unwrap();
        assert_eq!((run.suite.as_deref(), run.seed, run.telemetry.as_ref()), (None, None, None), "{file}");
        assert!(run.shapes.iter().all(|s| s.telemetry.is_none()));
        assert_eq!(run.suite_name(), (suite.to_string(), true), "{file}");
    }
    let mut run = built_run();
    assert_eq!(run.suite_name(), ("gpumode".to_string(), false));
    run.suite = None;
    run.shapes.truncate(1);
    assert_eq!(run.suite_name(), ("gpumode".to_string(), true), "a subset of the GPU MODE shapes");
    // An older trimul ignored what it did not know; so does this one, for a newer v1 file.
    let text =
        built_run().to_json_string().unwrap().replacen("\"seed\": 42", "\"seed\": 42, \"from_the_future\": 1", 1);
    assert!(BenchRun::from_json_str(&text).is_ok());
}

#[test]
fn committed_synthetic_runs_load_and_round_trip() {
    for run in synthetic_runs() {
        assert!(run.machine.device.contains("SYNTHETIC"), "synthetic files must say they are synthetic");
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
    let dir = TempDir::new("report-trunc");
    let path = dir.path("cut.json");
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    let e = BenchRun::from_path(&path).unwrap_err();
    let msg = assert_one_line(&e);
    assert!(msg.contains("cut.json") && msg.contains("not valid JSON"), "{msg}");

    let e = BenchRun::from_path(dir.path("absent.json")).unwrap_err();
    assert!(assert_one_line(&e).contains("absent.json"));
}

#[test]
fn bad_field_and_bad_values_are_one_line_errors() {
    let text = built_run().to_json_string().unwrap();
    let e = BenchRun::from_json_str(&text.replacen("\"median_ms\": ", "\"median_ms\": \"x\", \"m\": ", 1)).unwrap_err();
    assert_one_line(&e);
    let e = BenchRun::from_json_str(&text.replacen("\"median_ms\": ", "\"median_ms\": -1.0, \"m\": ", 1)).unwrap_err();
    assert!(assert_one_line(&e).contains("median_ms"));
    let e = BenchRun::from_json_str(&text.replacen("\"seed\": 42", "\"seed\": \"x\"", 1)).unwrap_err();
    assert_one_line(&e);
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

/// The rule the report exists for: a gpumode f32-io run is never set against an af3 bf16-io
/// anchor, even one with a time for every shape of the run (as the old report did: "gpumode f32
/// vs cuEquivariance af3 bf16: 2.12×").
#[test]
fn a_gpumode_f32_run_is_never_compared_with_an_af3_bf16_anchor() {
    let gpu = load(&["synthetic-gpu.json"]);
    let af3 = Anchor::load(data("anchors-synthetic.json"))
        .unwrap()
        .into_iter()
        .filter(|a| a.name == "synthetic anchor af3 bf16")
        .collect::<Vec<_>>();
    assert!(gpu[0].shapes.iter().filter(|s| s.key() != "n32_b1_c128").all(|s| af3[0].shapes.contains_key(&s.key())));
    let r = report::render(&gpu, &af3, None).unwrap();
    let md = &r.markdown;
    assert!(anchor_pairs(md, "gpumode").is_empty(), "{md}");
    assert!(md.contains("No anchor has the formulation, I/O precision and device of #1 synthetic GPU · gpumode f32-io"));
    assert!(md.contains(
        "**synthetic anchor af3 bf16** is af3 bf16-io: no run of this suite has that formulation and precision"
    ));
    assert!(!md.contains("synthetic anchor af3 bf16 (anchor)"), "the anchor stands beside the run's times: {md}");
    let names: Vec<&str> = r.svgs.iter().map(|(n, _)| n.as_str()).collect();
    assert!(!names.contains(&"gpumode-speedup.svg"), "nothing like-with-like to draw: {names:?}");
    assert!(r.svgs.iter().all(|(_, svg)| !svg.contains("synthetic anchor af3 bf16")), "a plot shows the anchor");

    // The same run as af3 bf16-io (formulation and precision only changed) is compared with it.
    let mut same = gpu.clone();
    same[0].formulation = "af3".into();
    same[0].precision = "bf16-io".into();
    let md = report::render(&same, &af3, None).unwrap().markdown;
    assert_eq!(anchor_pairs(&md, "gpumode").len(), 1, "{md}");
}

#[test]
fn anchors_are_paired_like_with_like_only() {
    let runs = synthetic_runs();
    let anchors = synthetic_anchors();
    let r = report::render(&runs, &anchors, None).unwrap();
    let md = &r.markdown;
    let mut pairs = anchor_pairs(md, "gpumode");
    pairs.extend(anchor_pairs(md, "long"));
    assert_eq!(pairs.len(), 5, "{pairs:?}");
    for (column, anchor) in &pairs {
        let name = anchor.split(" (").next().unwrap();
        let a = anchors.iter().find(|a| a.name == name).unwrap_or_else(|| panic!("no anchor {name:?}"));
        assert_eq!(
            (a.formulation.clone().unwrap(), a.precision.clone().unwrap()),
            class_of_column(&runs, column),
            "{column} against {anchor}"
        );
        // An anchor that names its device is only set against runs on it.
        if let Some(d) = &a.device {
            let first: usize = column[1..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap();
            assert_eq!(&runs[first - 1].machine.device, d, "{column} against {anchor}");
        }
    }
    // Each kind of pair that must be there is.
    let has = |col: &str, anchor: &str| pairs.iter().any(|(c, a)| c.starts_with(col) && a.starts_with(anchor));
    assert!(has("#1 synthetic GPU · gpumode f32-io", "synthetic anchor one (gpumode f32-io)"));
    assert!(has("#3 cuda · af3 bf16-io", "synthetic anchor af3 bf16 (af3 bf16-io)"));
    assert!(has("#2 cpu · gpumode f32-io", "synthetic anchor two"), "no device named: compared");
    assert!(!has("#2 cpu", "synthetic anchor one"), "another device: not compared");
    assert!(has("#4+#5 cuda · gpumode f32-io", "synthetic anchor two"), "the long suite's N = 2048");
    assert!(!pairs.iter().any(|(_, a)| a.contains("unlabelled")));
    assert!(md.contains("**synthetic anchor unlabelled** gives no formulation and precision, so compared with nothing"));
    // The ratio itself: anchor one over the GPU run, geomean over all four of its shapes.
    let want = (2.0f64 / 0.5 * 15.0 / 1.5 * 3.0 / 0.75 * 5.0 / 0.9).powf(0.25);
    assert!(md.contains(&format!("| all 4 shapes of the run | {want:.2}× |")), "{want}\n{md}");

    // The speedup bars carry exactly these pairs: one legend entry per comparison.
    let bars = &r.svgs.iter().find(|(n, _)| n == "gpumode-speedup.svg").unwrap().1;
    // (SVG text elements hold their text on a line of its own.)
    assert_eq!(bars.matches("\nvs ").count(), 4 + 1, "four anchor pairs and one baseline: {bars}");
    assert!(!bars.contains("vs synthetic anchor unlabelled"));
    let af3_bars = bars.find("\nvs synthetic anchor af3 bf16\n").unwrap();
    let subtitle: String = bars[af3_bars..].chars().take(400).collect();
    assert!(subtitle.contains("#3 cuda · af3 bf16-io"), "{subtitle}");
}

#[test]
fn runs_and_legends_name_formulation_and_precision() {
    let r = report::render(&synthetic_runs(), &synthetic_anchors(), None).unwrap();
    assert!(r.markdown.contains("| #3 cuda · af3 bf16-io | `gpumode` |"), "{}", r.markdown);
    assert!(r.markdown.contains("- **synthetic anchor af3 bf16** (af3 bf16-io) on SYNTHETIC"), "{}", r.markdown);
    let time = &r.svgs.iter().find(|(n, _)| n == "gpumode-time.svg").unwrap().1;
    for label in ["#1 synthetic GPU · gpumode f32-io", "#3 cuda · af3 bf16-io", "\naf3 bf16-io\n", "\ngpumode f32-io\n"]
    {
        assert!(time.contains(label), "legend lacks {label}");
    }
}

/// Runs of one backend on two GPU models name their device (a column of the H100 is never read as
/// one of the H200); a report whose runs of each backend share a device is unchanged, and anchors
/// still pair only with runs on the device they name.
#[test]
fn runs_of_one_backend_on_two_devices_name_them() {
    let runs = synthetic_runs();
    let plain = report::render(&runs, &synthetic_anchors(), None).unwrap().markdown;
    assert!(!plain.contains("cuda on "), "one device per backend: names unchanged");
    let mut other = runs[2].clone();
    other.machine.vendor = "NVIDIA".into();
    other.machine.device = "NVIDIA H200".into();
    let n = runs.len() + 1;
    let mut both = runs.clone();
    both.push(other);
    let md = report::render(&both, &synthetic_anchors(), None).unwrap().markdown;
    assert!(md.contains(&format!("| #{n} cuda on H200 · af3 bf16-io |")), "{md}");
    // (The synthetic device is `SYNTHETIC test data, …` from vendor `SYNTHETIC`.)
    assert!(md.contains("| #3 cuda on test data, not a real device · af3 bf16-io |"), "the others named too: {md}");
    assert!(!anchor_pairs(&md, "gpumode").iter().any(|(c, _)| c.contains("on H200")), "no anchor names the H200");
}

#[test]
fn each_suite_has_its_own_geomeans_and_names_their_shapes() {
    let runs = synthetic_runs();
    let r = report::render(&runs, &synthetic_anchors(), None).unwrap();
    let md = &r.markdown;
    // Every geometric mean says what it is over.
    for line in md.lines().filter(|l| l.contains("**geomean**")) {
        assert!(line.contains("**geomean** over "), "an unnamed geomean: {line}");
    }
    // The long suite's runs do not shrink the gpumode suite's shape set, nor the reverse.
    assert!(md.contains("## Suite `gpumode`\n\n3 runs (#1, #2 and #3), 5 shapes."), "{md}");
    assert!(md.contains("## Suite `long`\n\n3 runs (#4, #5 and #6), 5 shapes."), "{md}");
    // gpumode suite: GPU and CPU share three shapes, and the floor geomean names them. GPU 0.5,
    // 1.5, 0.75; CPU 60, 800, 110.
    let gpu = (0.5f64 * 1.5 * 0.75).cbrt();
    let cpu = (60.0f64 * 800.0 * 110.0).cbrt();
    let table = section(md, "gpumode", "### Median time (ms)").join("\n");
    let row = format!(
        "| **geomean** over `n256_b2_c128`, `n768_b1_c128`, `n256_b2_c384` |  |  | **{gpu:.3}** | **{cpu:.3}** |"
    );
    assert!(table.contains(&row), "{row}\n{table}");
    // The af3 run's own table is over all four of its shapes, beside its like anchor's.
    let af3 = (0.4f64 * 1.2 * 0.9 * 0.8).powf(0.25);
    let anchor = (0.8f64 * 2.4 * 1.8 * 1.2).powf(0.25);
    assert!(
        table.contains(&format!("| **geomean** over all 4 shapes above |  |  | **{af3:.3}** | **{anchor:.3}** |")),
        "{table}"
    );
    // Speedup between the like runs, over the shapes both have; CPU far below the GPU baseline.
    assert!(section(md, "gpumode", "### Speedups between runs").join("\n").contains("| **0.00474×** |"), "{md}");
    // long suite: #4 and #5 are one column; the floor geomean is over the N both columns have.
    assert!(md.contains("Runs #4 and #5 share the column #4+#5 cuda · gpumode f32-io"), "{md}");
    assert!(md.contains("builds `synth-a` and `synth-b`"));
    let floors = section(md, "long", "### Distance from the floor").join("\n");
    assert!(floors.contains("| **geomean** over N = 4096, 8192 |"), "{floors}");
    let long_time = (8.0f64 * 22.0 * 45.0 * 110.0 * 300.0).powf(0.2);
    assert!(md.contains(&format!("| **geomean** over all 5 shapes above |  |  | **{long_time:.3}** |")), "{md}");
    // The old report's failure: a merged long run left no shape common to all runs, and every
    // summary cell read "—".
    assert!(!md.lines().any(|l| l.contains("**geomean**") && l.matches("| — ").count() > 1), "{md}");
}

#[test]
fn baseline_picks_the_reference_within_its_class() {
    let runs = synthetic_runs();
    let r = report::render(&runs, &[], Some(1)).unwrap();
    let between = section(&r.markdown, "gpumode", "### Speedups between runs").join("\n");
    assert!(between.contains("**gpumode f32-io**, against #2 cpu · gpumode f32-io"), "{between}");
    assert!(between.contains("| **211×** |"), "{between}");
    // A baseline of another class leaves each class its first run.
    let r = report::render(&runs, &[], Some(2)).unwrap();
    let between = section(&r.markdown, "gpumode", "### Speedups between runs").join("\n");
    assert!(between.contains("against #1 synthetic GPU · gpumode f32-io"), "{between}");
}

#[test]
fn mismatched_shapes_are_listed_not_dropped() {
    let r = report::render(&synthetic_runs(), &synthetic_anchors(), None).unwrap();
    let md = &r.markdown;
    assert!(
        md.contains("`n512_b1_c128` is missing from #2 cpu · gpumode f32-io (measured by #1 synthetic GPU"),
        "{md}"
    );
    assert!(md.contains("`n32_b1_c128` is missing from #1 synthetic GPU · gpumode f32-io and #3"), "{md}");
    assert!(md.contains("`n768_b1_c128`: the distribution differs between runs"), "{md}");
    assert!(md.contains("`n256_b2_c384`: the mask differs between runs"), "{md}");
    assert!(md.contains("Anchor **synthetic anchor two** has no time for `n256_b2_c384`"), "{md}");
    assert!(md.contains("**synthetic anchor two** has times for shapes no run measured: `n1536_b1_c128`"), "{md}");
    // Every shape of every run gets a row, including those only one run has.
    for key in ["n256_b2_c128", "n768_b1_c128", "n256_b2_c384", "n512_b1_c128", "n32_b1_c128", "n6144_b1_c128"] {
        assert!(md.contains(&format!("| `{key}` |")), "no row for {key}");
    }
}

#[test]
fn the_cpu_floor_says_what_it_is() {
    let r = report::render(&synthetic_runs(), &[], None).unwrap();
    assert!(r.markdown.contains("On the CPU (#2) the GEMM ceiling is the rate of the `gemm` crate"), "{}", r.markdown);
    assert!(r.markdown.contains("not an independent bound"));
    assert!(r.markdown.contains(
        "For #2 cpu · gpumode f32-io, the floor is the `gemm` crate's own rate, so the ratio measures the layer \
         against its GEMM library"
    ));
    let gpu_only = report::render(&load(&["synthetic-gpu.json"]), &[], None).unwrap();
    assert!(!gpu_only.markdown.contains("gemm` crate"), "no CPU run, no CPU note");
}

#[test]
fn clocks_power_and_seeds_are_shown() {
    let r = report::render(&synthetic_runs(), &[], None).unwrap();
    let md = &r.markdown;
    let clocks = section(md, "gpumode", "### Clocks and power").join("\n");
    assert!(clocks.contains("SM 1365–1980 MHz · ≤ 699 W of 700 W · 12 readings · **sw_power_cap**"), "{clocks}");
    assert!(clocks.contains("SM 1980 → 1980 MHz · 120 → 300 W · before → after"), "{clocks}");
    assert!(clocks.contains("| not recorded |"), "older runs: {clocks}");
    let long = section(md, "long", "### Clocks and power").join("\n");
    assert!(
        long.contains("#4 and #5: written before bench recorded clocks and power; #6: nvidia-smi not found"),
        "{long}"
    );
    assert!(md.contains("| 1234 |") && md.contains("| not recorded |"), "seeds: {md}");
    assert!(md.contains("driver 000.00 (synthetic), GPU-00000000"), "{md}");
}

#[test]
fn failures_and_unchecked_results_are_visible() {
    let r = report::render(&synthetic_runs(), &[], None).unwrap();
    assert!(r.markdown.contains("**1 of 11 checked results FAIL**; 1 not checked"), "{}", r.markdown);
    assert!(r.markdown.contains("| NaN | NaN | **FAIL** |"), "{}", r.markdown);
}

#[test]
fn plots_per_suite_include_time_and_memory_against_n_and_speedup_bars() {
    let runs = synthetic_runs();
    let anchors = synthetic_anchors();
    let a = report::render(&runs, &anchors, None).unwrap();
    let b = report::render(&runs, &anchors, None).unwrap();
    assert_eq!(a, b, "output is deterministic");
    let names: Vec<&str> = a.svgs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "gpumode-time.svg",
            "gpumode-speedup.svg",
            "gpumode-floor.svg",
            "long-time-vs-n.svg",
            "long-memory-vs-n.svg",
            "long-speedup.svg",
            "long-floor-vs-n.svg"
        ]
    );
    for (name, svg) in &a.svgs {
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{name} is not an SVG document");
        assert!(a.markdown.contains(&format!("]({name})")), "report.md does not link {name}");
    }
    let svg = |n: &str| a.svgs.iter().find(|(name, _)| name == n).unwrap().1.as_str();
    // Against N: one label per N, one line per column (the merged one spans all five N), the
    // in-place points marked and explained.
    let time = svg("long-time-vs-n.svg");
    for n in [2048, 3072, 4096, 6144, 8192] {
        assert!(time.contains(&format!("\nN={n}\n")), "no N={n} on the axis");
    }
    assert!(time.contains("#4+#5 cuda · gpumode f32-io") && time.contains("#6 cuda · af3 bf16-io"));
    assert!(time.contains("N (log scale); B = 1, C = 128") && time.contains("ran in place (y over x)"));
    // One line per column: the merged column's through all five N, the other's through its two.
    let points: Vec<usize> = time
        .lines()
        .filter(|l| l.starts_with("<polyline") && l.contains("stroke-width=\"3\""))
        .map(|l| l.split("points=\"").nth(1).unwrap().split_whitespace().filter(|p| p.contains(',')).count())
        .collect();
    assert_eq!(points, [5, 2, 2, 2], "two lines, then the two legend swatches: {points:?}");
    let memory = svg("long-memory-vs-n.svg");
    assert!(memory.contains("peak device memory (GiB, log scale)"));
    assert!(memory.contains("SYNTHETIC test data, not a real device: 80.0 GiB"), "the device's memory line");
    // Bars: one rectangle per (comparison, shape) that has both times; in gpumode, anchor one
    // over #1 (4), anchor two over #1 (3) and #2 (2), af3 anchor over #3 (4), #2 over #1 (3).
    let bars = svg("gpumode-speedup.svg");
    let filled_rects = bars.matches("<rect").count();
    let one_x = svg("gpumode-time.svg");
    assert!(one_x.contains("median time per call (ms, log scale)"));
    assert!(filled_rects >= 16, "{filled_rects} rectangles");
    assert!(bars.contains("1×: as fast; above: the run is faster"));
}

#[test]
fn one_run_without_anchors_renders() {
    let r = report::render(&[built_run()], &[], None).unwrap();
    assert!(!r.markdown.contains("### Speedups between runs"));
    assert!(!r.markdown.contains("### Against the anchors"));
    assert!(r.markdown.contains("Every column has the same 3 shapes"));
    assert!(r.markdown.contains("3 of 3 checked results pass"));
    assert!(
        r.markdown.contains("SM 1700–1980 MHz · ≤ 690 W of 700 W · 2 readings · **sw_power_cap**"),
        "{}",
        r.markdown
    );
}

#[test]
fn runs_without_shapes_or_common_shapes_still_render() {
    let mut empty = built_run();
    empty.shapes.clear();
    let r = report::render(std::slice::from_ref(&empty), &[], None).unwrap();
    assert!(r.markdown.contains("0 shapes"), "{}", r.markdown);
    let mut other = built_run();
    other.shapes.truncate(1);
    let mut disjoint = built_run();
    disjoint.shapes.drain(..1);
    disjoint.label = Some("another".into());
    let r = report::render(&[other, disjoint, empty], &synthetic_anchors(), Some(2)).unwrap();
    // No shape in common: each column's geomean is over its own shapes, named in the cell.
    assert!(r.markdown.contains("**geomean** over each column's own shapes"), "{}", r.markdown);
    assert!(r.markdown.contains("(over `n256_b2_c128`)"), "{}", r.markdown);
    assert!(r.markdown.contains("`n256_b2_c128` is missing from #2 another · gpumode f32-io"), "{}", r.markdown);
}

#[test]
fn suite_names_become_safe_unique_file_names() {
    let mut a = built_run();
    a.suite = Some("../../etc/Evil Suite".into());
    let mut b = built_run();
    b.suite = Some("etc evil suite".into());
    let r = report::render(&[a, b], &[], None).unwrap();
    let names: Vec<&str> = r.svgs.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"etc-evil-suite-time.svg") && names.contains(&"etc-evil-suite-2-time.svg"), "{names:?}");
    assert!(names.iter().all(|n| !n.contains('/') && !n.starts_with('.')));
}

#[test]
fn h100_anchors_match_spec() {
    let anchors = Anchor::load(perf("anchors-h100.json")).unwrap();
    // SPEC.md's geomean row, recomputed from its per-shape numbers (which are rounded to 1 µs).
    let want = [
        ("PyTorch reference f32", 10.177, "gpumode", "f32-io"),
        ("best pure-PyTorch fp16", 4.629, "gpumode", "f32-io"),
        ("leaderboard #1 human code (Triton)", 1.588, "gpumode", "f32-io"),
        ("MI300 winner's H100 code (Triton)", 2.547, "gpumode", "f32-io"),
        ("cuEquivariance 0.13 af3 bf16", 1.629, "af3", "bf16-io"),
        ("cuEquivariance 0.13 af3 f32 (tf32)", 2.971, "af3", "f32-io"),
        ("torch.compile of the f32 reference", 7.705, "gpumode", "f32-io"),
    ];
    assert_eq!(anchors.len(), want.len());
    for (name, g, f, p) in want {
        let a = anchors.iter().find(|a| a.name == name).unwrap_or_else(|| panic!("no anchor {name:?}"));
        assert_eq!(a.shapes.len(), 7, "{name}");
        let got = (a.shapes.values().map(|v| v.ln()).sum::<f64>() / 7.0).exp();
        assert!((got - g).abs() < 0.002, "{name}: geomean {got}, SPEC.md says {g}");
        assert_eq!(a.class(), Some((f.to_string(), p.to_string())), "{name}");
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

/// The files in a directory with this extension, sorted.
fn files_with(dir: &Path, ext: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(ext))
        .collect();
    v.sort();
    v
}

#[test]
fn golden_report_from_synthetic_runs() {
    let r = report::render(&synthetic_runs(), &synthetic_anchors(), None).unwrap();
    golden("report.md", &r.markdown);
    for (name, svg) in &r.svgs {
        golden(name, svg);
    }
    // No stale plot from an earlier layout lies beside them.
    let mut want: Vec<String> = r.svgs.iter().map(|(n, _)| n.clone()).collect();
    want.sort();
    if std::env::var_os("TRIMUL_BLESS").is_none() {
        assert_eq!(files_with(&data("expected"), ".svg"), want);
    }
}

#[test]
fn write_puts_files_in_the_directory() {
    let r = report::render(&synthetic_runs(), &[], None).unwrap();
    let dir = TempDir::new("report-out");
    let out = dir.path("nested");
    let written = report::write(&r, &out).unwrap();
    assert_eq!(written.len(), 1 + r.svgs.len());
    assert_eq!(std::fs::read_to_string(out.join("report.md")).unwrap(), r.markdown);
    assert_eq!(std::fs::read_to_string(out.join("gpumode-floor.svg")).unwrap(), r.svgs[2].1);
}

/// The runs the committed report in docs/perf/report is built from, in its order: the
/// `gpumode` suite in both formulations and I/O precisions, the `long` suite (2048–4096 in one
/// run, 6144 and 8192 in place in another, per formulation), and the CPU's `quick` run, all on
/// the H100; then the H200's `gpumode` runs and its `long` gpumode f32 run (session 35).
const COMMITTED: [&str; 15] = [
    "h100-cuda-gpumode.json",
    "h100-cuda-af3.json",
    "h100-cuda-gpumode-bf16.json",
    "h100-cuda-af3-bf16.json",
    "h100-cuda-long.json",
    "h100-cuda-long-inplace.json",
    "h100-cuda-long-af3-bf16.json",
    "h100-cuda-long-inplace-af3-bf16.json",
    "cpu-quick.json",
    "h200-s35-gpumode-f32.json",
    "h200-s35-af3-f32.json",
    "h200-s35-gpumode-bf16.json",
    "h200-s35-af3-bf16.json",
    "h200-s35-long-gpumode-f32.json",
    "h200-s36-long-af3-bf16.json",
];

/// docs/perf/report was generated with `trimul report` from [`COMMITTED`] (in that order, under
/// docs/perf) `--anchors docs/perf/anchors-h100.json --out docs/perf/report`; rendering the same
/// inputs must reproduce it byte for byte, with no stale file beside it.
#[test]
fn committed_sample_report_reproduces() {
    let runs: Vec<BenchRun> = COMMITTED.iter().map(|f| BenchRun::from_path(perf(f)).unwrap()).collect();
    let anchors = Anchor::load(perf("anchors-h100.json")).unwrap();
    let report = trimul::report::render(&runs, &anchors, None).unwrap();
    let dir = perf("report");
    let expected = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        report.markdown == expected,
        "docs/perf/report/report.md is not what `trimul report` renders from the committed runs"
    );
    for (name, svg) in &report.svgs {
        let committed = std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(*svg == committed, "docs/perf/report/{name} differs from the rendering of the committed runs");
    }
    let mut want: Vec<String> = report.svgs.iter().map(|(n, _)| n.clone()).collect();
    want.sort();
    assert_eq!(files_with(&dir, ".svg"), want, "stale or missing plots in docs/perf/report");
}

/// What issue 26 asked of the committed report: like-with-like comparisons only, each suite on
/// its own with named geomeans, time and peak memory against N.
#[test]
fn committed_report_compares_like_with_like() {
    let md = std::fs::read_to_string(perf("report/report.md")).unwrap();
    let runs: Vec<BenchRun> = COMMITTED.iter().map(|f| BenchRun::from_path(perf(f)).unwrap()).collect();
    let anchors = Anchor::load(perf("anchors-h100.json")).unwrap();
    let pairs = anchor_pairs(&md, "gpumode");
    assert_eq!(pairs.len(), 7, "5 gpumode f32-io anchors, one af3 f32-io, one af3 bf16-io: {pairs:?}");
    for (column, anchor) in &pairs {
        let a = anchors.iter().find(|a| anchor.starts_with(&format!("{} (", a.name))).unwrap();
        assert_eq!(a.class().unwrap(), class_of_column(&runs, column), "{column} against {anchor}");
    }
    assert!(pairs.iter().any(|(c, a)| c.starts_with("#4 cuda on H100 80GB HBM3 · af3 bf16-io")
        && a.starts_with("cuEquivariance 0.13 af3 bf16")));
    // The H200's runs (session 35) stand beside the H100's, named for their device, never paired
    // with an anchor measured on the H100.
    assert!(md.contains("| #10 cuda on H200 · gpumode f32-io |"));
    assert!(!pairs.iter().any(|(c, _)| c.contains("on H200")), "{pairs:?}");
    assert!(!pairs.iter().any(|(c, a)| c.contains("gpumode f32-io") && a.contains("cuEquivariance")));
    for suite in ["gpumode", "long", "quick"] {
        assert!(md.contains(&format!("## Suite `{suite}`")), "{suite}");
    }
    assert!(md.lines().filter(|l| l.contains("**geomean**")).all(|l| l.contains("**geomean** over ")));
    assert!(md.contains("](long-time-vs-n.svg)") && md.contains("](long-memory-vs-n.svg)"));
    assert!(md.contains("](gpumode-speedup.svg)"));
    assert!(md.contains("not an independent bound"), "the CPU floor is explained");
}

#[test]
fn bench_json_records_suite_seed_and_why_there_are_no_clocks() {
    let dir = TempDir::new("report-bench");
    let json = dir.path("run.json");
    let o = cpu_quick_bench(&json, &["--n", "256", "--repeats", "1", "--seed", "7"]);
    assert!(o.status.success(), "stdout: {}\nstderr: {}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("clocks and power: not read (no clock or power probe for the CPU backend)"));
    let run = BenchRun::from_path(&json).unwrap();
    assert_eq!((run.suite.as_deref(), run.seed), (Some("quick"), Some(7)));
    let t = run.telemetry.expect("the probe's absence is recorded");
    assert_eq!((t.source.as_str(), t.available), ("none", false));
    assert!(t.reason.unwrap().contains("CPU backend"));
    assert!(run.shapes.iter().all(|s| s.telemetry.is_none()));
}

#[test]
fn check_json_has_a_schema_version() {
    let o = trimul(&["check", "--backend", "cpu", "--suite", "quick", "--seed", "3", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["schema_version"].as_u64(), Some(1), "{text}");
    assert!(text.trim_start().starts_with("{\n  \"schema_version\": 1,"), "the version comes first: {text}");
    assert_eq!(v["tool"]["name"].as_str(), Some("trimul"));
    assert_eq!(v["seed"].as_u64(), Some(3));
}

/// A stand-in for nvidia-smi: the GPU list, one reading per query (or a reading every 50 ms in
/// loop mode), and, when `old` is set, a driver that does not know `clocks_event_reasons`.
#[cfg(unix)]
fn fake_nvidia_smi(dir: &TempDir, old: bool) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.path(if old { "nvidia-smi-old" } else { "nvidia-smi" });
    let refuse = if old {
        "case \"$*\" in *clocks_event_reasons*) echo 'Field \"clocks_event_reasons.active\" is not a valid field to query.'; exit 2;; esac\n"
    } else {
        ""
    };
    let script = format!(
        "#!/bin/sh\n\
         case \"$*\" in *uuid,driver_version*) echo 'GPU-1111, 570.10'; echo 'GPU-2222, 570.10'; exit 0;; esac\n\
         {refuse}\
         case \"$*\" in\n\
           *--loop-ms*) while true; do echo '1365, 1980, 699.50, 700.00, 0x0000000000000004'; sleep 0.05; done;;\n\
           *) echo '1980, 1980, 80.25, 700.00, 0x0000000000000001';;\n\
         esac\n"
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[cfg(unix)]
#[test]
fn nvidia_smi_probe_reads_around_the_timed_calls() {
    let dir = TempDir::new("report-smi");
    for old in [false, true] {
        let smi = fake_nvidia_smi(&dir, old);
        let (probe, t) = NvidiaSmi::open_with(&smi, Some("GPU-2222"));
        assert!(t.available, "{t:?}");
        assert_eq!((t.gpu.as_deref(), t.driver_version.as_deref()), (Some("GPU-2222"), Some("570.10")));
        let probe = probe.unwrap();
        let (value, tel) = NvidiaSmi::around(Some(&probe), || {
            std::thread::sleep(std::time::Duration::from_millis(400));
            7
        });
        assert_eq!(value, 7);
        let tel = tel.unwrap();
        let before = tel.before.unwrap();
        assert_eq!((before.sm_clock_mhz, before.power_w), (Some(1980.0), Some(80.25)));
        assert_eq!(before.clock_event_reasons, Some(vec!["gpu_idle".to_string()]));
        let during = tel.during.unwrap();
        assert!(during.samples >= 1, "{during:?}");
        assert_eq!((during.sm_clock_mhz_min, during.power_w_max), (Some(1365.0), Some(699.5)));
        assert_eq!(during.clock_event_reasons, ["sw_power_cap"]);
        assert!(tel.after.is_some());
    }
    // Several GPUs and none named, or a GPU it does not list: a reason, not a failure.
    let smi = fake_nvidia_smi(&dir, false);
    let (probe, t) = NvidiaSmi::open_with(&smi, None);
    assert!(probe.is_none() && t.reason.unwrap().contains("2 GPUs"));
    let (probe, t) = NvidiaSmi::open_with(&smi, Some("GPU-9999"));
    assert!(probe.is_none() && t.reason.unwrap().contains("GPU-9999"));
    assert_eq!(NvidiaSmi::around(None, || 1), (1, None));
}

/// A HIP run (an AMD GPU's `trimul bench --json`, no telemetry probe there) beside a CUDA run:
/// read back from its file, rendered in one report with its own device, versions and floor
/// ratios, compared only with runs of its own class, and plotted (issue 31's "report back").
#[test]
fn a_hip_run_renders_beside_a_cuda_run() {
    let cuda = built_run();
    let mut hip = built_run();
    hip.backend = "hip".into();
    hip.label = Some("MI300X rocBLAS output".into());
    hip.machine = MachineInfo::from_device_info(
        &trimul::DeviceInfo {
            vendor: "AMD".into(),
            name: "AMD Instinct MI300X".into(),
            arch: "gfx942".into(),
            compute_units: 304,
            memory_bytes: 206_158_430_208,
            versions: vec![
                ("HIP runtime".into(), "6.3.42134".into()),
                ("rocBLAS".into(), "4.3.0".into()),
                ("MFMA output kernel, C=128 H=128".into(), "used: passed 4 cases; 0.210 ms against 0.260 ms".into()),
            ],
        },
        Some("amd-host".into()),
    );
    hip.ceilings = Ceilings { gemm_tflops: 650.0, gemm_desc: "rocBLAS f16·f16→f32 8192³".into(), copy_gbs: 4200.0 };
    hip.telemetry = Some(RunTelemetry {
        source: "none".into(),
        available: false,
        reason: Some("no telemetry probe for AMD GPUs".into()),
        gpu: None,
        driver_version: None,
        interval_ms: None,
    });
    for s in &mut hip.shapes {
        s.telemetry = None;
    }
    let dir = TempDir::new("hip-report");
    let path = dir.path("mi300x.json");
    std::fs::write(&path, serde_json::to_string_pretty(&hip).unwrap()).unwrap();
    let hip = BenchRun::from_path(&path).unwrap();
    assert_eq!(hip.backend, "hip");
    let r = report::render(&[cuda, hip], &synthetic_anchors(), None).unwrap();
    for want in ["AMD Instinct MI300X", "gfx942", "rocBLAS 4.3.0", "MI300X rocBLAS output", "NVIDIA H100 80GB HBM3"] {
        assert!(r.markdown.contains(want), "{want} missing:\n{}", r.markdown);
    }
    assert!(r.markdown.contains("| hip "), "the HIP run's row:\n{}", r.markdown);
    assert!(!r.svgs.is_empty(), "no plots");
}
