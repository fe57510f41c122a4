//! The HIP backend's host side, tested on a machine with no AMD GPU and no ROCm: everything that can be proven
//! without the hardware.
//!
//! - the embedded code objects (one linked ELF per stage for gfx942 and gfx90a), their metadata,
//!   and `v_mfma` in the MFMA kernel's disassembly;
//! - that the embedded sources (what hipRTC gets) are self-contained and compile for other archs;
//! - that the device-side `TmParams`, `TmInputParams` and `TmOutputParams` layouts equal the Rust
//!   mirrors, field by field;
//! - the MFMA output kernel's real source, run on the CPU through tests/hip_emu, against f64;
//! - rocBLAS argument construction: a host model of `rocblas_gemm_ex` semantics driven only by
//!   the arguments we pass computes exactly the products of SPEC.md and of `GemmSpec::run_host`
//!   (the layout the CUDA path executes), for all three GEMMs, both directions, and the bias;
//! - arch normalisation and code-object selection against the real embedded table;
//! - missing libraries and absent devices are errors naming what was tried, never panics.
//!
//! Tests that need clang-19 / llvm-objdump-19 / a host C++20 compiler print `SKIPPED: …` when
//! the tool is missing; with `TRIMUL_REQUIRE_HIP_CLANG` set (CI) a missing tool fails instead.

use std::io::Write;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::backend::gemm::GemmSpec;
use crate::backend::hip::blas::{bias_update_spec, DataType, RocblasGemm};
use crate::backend::hip::kernels::{self, KernelImage, HIP_BUILD, HIP_STAGES};
use crate::backend::hip::sys::{self, ROCBLAS_OPERATION_NONE, ROCBLAS_OPERATION_TRANSPOSE};
use crate::backend::hip::{arch, HipBackend};
use crate::backend::params::{self, InputParams, OutputParams};
use crate::kernels::HIP_PREBUILT_ARCHS;
use crate::rand::Rng;
use crate::{suite, BackendKind, Device, Direction, Error, Formulation};

const REQUIRE: &str = "TRIMUL_REQUIRE_HIP_CLANG";
const ARCHS: [&str; 2] = ["gfx942", "gfx90a"];
const STAGES: [&str; 8] = [
    "backward",
    "input_gating",
    "input_norm",
    "input_projection",
    "output_gate",
    "output_norm",
    "output_projection",
    "prepare_weights",
];
/// The stages built on matrix-core (MFMA) instructions: CDNA only.
const MFMA_STAGES: [&str; 2] = ["input_projection", "output_projection"];

/// The kernels of a stage's code object: entry point, the C type of its one argument and that
/// type's size in the Rust mirror. Every forward stage has one kernel named after it; the
/// backward stage has the seventeen entry points of `common/backward.h`.
fn stage_kernels(stage: &'static str) -> Vec<(String, &'static str, usize)> {
    use crate::backend::backward_params::{BackwardParams, ColumnSums, Convert};
    use std::mem::size_of;
    match stage {
        "prepare_weights" => vec![(stage.into(), "TmPrepareParams", size_of::<params::PrepareParams>())],
        "input_norm" | "input_gating" | "input_projection" => {
            vec![(stage.into(), "TmInputParams", size_of::<InputParams>())]
        }
        "backward" => {
            let mut v: Vec<_> = [
                "backward_input_norm",
                "backward_gating",
                "backward_output_norm",
                "backward_output_gate",
                "backward_output_norm_grad",
                "backward_gating_grad",
                "backward_input_norm_grad",
            ]
            .into_iter()
            .flat_map(|k| [k.to_string(), format!("{k}_16")])
            .map(|k| (k, "TmBackwardParams", size_of::<BackwardParams>()))
            .collect();
            v.extend(
                ["backward_column_partials", "backward_column_finish"]
                    .map(|k| (k.into(), "TmColumnSums", size_of::<ColumnSums>())),
            );
            v.push(("backward_convert".into(), "TmConvert", size_of::<Convert>()));
            v
        }
        _ => vec![(stage.into(), "TmOutputParams", size_of::<OutputParams>())],
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Says why a tool-dependent test did not run, or fails when CI demands the tools.
fn skip(what: &str) {
    if std::env::var_os(REQUIRE).is_some() {
        panic!("{REQUIRE} is set but {what}");
    }
    // Straight to stderr, past the harness's capture, so the skip shows in a plain `cargo test`.
    let _ = writeln!(std::io::stderr(), "SKIPPED: {what}");
}

/// `$env_var`, else the first of `names` on PATH that runs.
fn tool(env_var: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env_var) {
        return Some(PathBuf::from(p));
    }
    names.iter().map(PathBuf::from).find(|n| {
        Command::new(n).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    })
}

fn clang() -> Option<PathBuf> {
    tool("TRIMUL_HIP_CLANG", &["clang++-19", "clang++"])
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("trimul-hip-host-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn built_with_clang() -> bool {
    if HIP_BUILD.starts_with("clang") {
        return true;
    }
    skip(&format!("this build embedded no code objects ({HIP_BUILD}); install clang-19 and lld-19 and rebuild"));
    false
}

fn stage(name: &str) -> &'static kernels::EmbeddedHipStage {
    HIP_STAGES.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("stage {name} not embedded"))
}

// ------------------------------------------------------------------------------- code objects

#[test]
fn every_stage_is_embedded_with_a_self_contained_source() {
    let names: Vec<&str> = HIP_STAGES.iter().map(|s| s.name).collect();
    assert_eq!(names, STAGES, "hip/*.hip and the embedded table disagree");
    for s in HIP_STAGES {
        assert!(!s.source.contains("#include \""), "{}: unexpanded include left for hipRTC", s.name);
        assert!(s.source.contains("__global__ void TM_LAUNCH_BOUNDS"), "{}", s.name);
        // Every kernel takes its family's params struct by value.
        for (kernel, ctype, _) in stage_kernels(s.name) {
            assert!(s.source.contains(&format!("{kernel}(const {ctype} ")), "{}: kernel {kernel}", s.name);
        }
    }
}

#[test]
fn every_stage_has_linked_code_objects_for_gfx942_and_gfx90a() {
    if !built_with_clang() {
        return;
    }
    assert_eq!(HIP_PREBUILT_ARCHS, ARCHS);
    for s in HIP_STAGES {
        let archs: Vec<&str> = s.code_objects.iter().map(|(a, _)| *a).collect();
        assert_eq!(archs, ARCHS, "{}", s.name);
        for (a, code) in s.code_objects {
            // 64-bit little-endian ELF, ET_DYN (linked: what hipModuleLoadData wants), EM_AMDGPU.
            assert_eq!(&code[..4], b"\x7fELF", "{} {a}", s.name);
            assert_eq!((code[4], code[5]), (2, 1), "{} {a}: ELF64 LE", s.name);
            assert_eq!(u16::from_le_bytes([code[16], code[17]]), 3, "{} {a}: ET_DYN", s.name);
            assert_eq!(u16::from_le_bytes([code[18], code[19]]), 224, "{} {a}: EM_AMDGPU", s.name);
            // e_flags: the processor in the low byte (EF_AMDGPU_MACH), 0x4c gfx942, 0x3f gfx90a.
            let flags = u32::from_le_bytes([code[48], code[49], code[50], code[51]]);
            let mach = match *a {
                "gfx942" => 0x4c,
                "gfx90a" => 0x3f,
                other => panic!("unexpected arch {other}"),
            };
            assert_eq!(flags & 0xff, mach, "{} {a}: e_flags {flags:#x}", s.name);
        }
    }
}

/// Writes each code object of `stage` to a file and runs `tool args… file`.
fn tool_output(tool: &Path, args: &[&str], stage: &str, arch: &str) -> String {
    let (_, code) = self::stage(stage).code_objects.iter().find(|(a, _)| *a == arch).unwrap();
    let dir = tmpdir("objects");
    let file = dir.join(format!("{stage}.{arch}.hsaco"));
    std::fs::write(&file, code).unwrap();
    let out = Command::new(tool).args(args).arg(&file).output().unwrap();
    assert!(out.status.success(), "{} failed: {}", tool.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The LLVM tool (`$env_var`, else the first of `names` found) that reads the embedded code
/// objects; `None`, the test skipped, where the build embedded none or no such tool is found.
fn code_object_tool(env_var: &str, names: &[&str]) -> Option<PathBuf> {
    if !built_with_clang() {
        return None;
    }
    let found = tool(env_var, names);
    if found.is_none() {
        skip(&format!("no {} (apt install llvm-19)", names[0]));
    }
    found
}

/// [`tool_output`] for the code object of each of `stages` for each of [`ARCHS`]:
/// `(stage, arch, output)`.
fn tool_outputs<'a>(
    tool: &'a Path,
    args: &'a [&'a str],
    stages: &'a [&'static str],
) -> impl Iterator<Item = (&'static str, &'static str, String)> + 'a {
    stages.iter().flat_map(move |s| ARCHS.iter().map(move |a| (*s, *a, tool_output(tool, args, s, a))))
}

#[test]
fn mfma_kernel_disassembly_contains_v_mfma() {
    let Some(objdump) = code_object_tool("TRIMUL_LLVM_OBJDUMP", &["llvm-objdump-19", "llvm-objdump"]) else {
        return;
    };
    for (stage, a, asm) in tool_outputs(&objdump, &["-d"], &MFMA_STAGES) {
        let mfma = asm.lines().filter(|l| l.trim_start().starts_with("v_mfma_f32_32x32x8")).count();
        assert!(mfma >= 2, "{a}: expected v_mfma_f32_32x32x8*f16 in {stage}, found {mfma}:\n{asm}");
        assert!(asm.contains(&format!("<{stage}>:")), "{a}: kernel symbol {stage} missing");
    }
    // The portable stages must not depend on matrix cores (they also run on RDNA via hipRTC).
    for (_, a, plain) in tool_outputs(&objdump, &["-d"], &["input_gating"]) {
        assert!(!plain.contains("v_mfma"), "{a}: input_gating uses MFMA");
    }
}

#[test]
fn code_object_metadata_matches_the_launches() {
    let Some(readelf) = code_object_tool("TRIMUL_LLVM_READELF", &["llvm-readelf-19", "llvm-readelf"]) else {
        return;
    };
    for (s, a, notes) in tool_outputs(&readelf, &["--notes"], &STAGES) {
        // One YAML map per kernel under `amdhsa.kernels`, each starting at "  - ".
        // (`amdhsa.version`'s list items start so too: keep the maps that name a kernel.)
        let entries: Vec<&str> = notes.split("\n  - ").skip(1).filter(|e| e.contains(".name:")).collect();
        let field = |entry: &str, key: &str| -> String {
            entry
                .lines()
                .find_map(|l| l.trim().strip_prefix(&format!("{key}:")).map(|v| v.trim().to_string()))
                .unwrap_or_else(|| panic!("{s} {a}: no {key} in\n{entry}"))
        };
        let expected = stage_kernels(s);
        assert_eq!(entries.len(), expected.len(), "{s} {a}: kernels in\n{notes}");
        for (kernel, _, bytes) in expected {
            let k = entries
                .iter()
                .find(|e| field(e, ".name") == kernel)
                .unwrap_or_else(|| panic!("{s} {a}: no kernel {kernel} in\n{notes}"));
            assert_eq!(field(k, ".wavefront_size"), "64", "{kernel} {a}");
            // All LDS is dynamic: the host passes its size, so no static LDS may add to it.
            assert_eq!(field(k, ".group_segment_fixed_size"), "0", "{kernel} {a}");
            // No scratch: spills would be a silent slowdown, and a private segment a surprise.
            assert_eq!(field(k, ".private_segment_fixed_size"), "0", "{kernel} {a}");
            assert_eq!(field(k, ".vgpr_spill_count"), "0", "{kernel} {a}");
            assert_eq!(field(k, ".max_flat_workgroup_size"), "256", "{kernel} {a}: launches use 256 threads");
            // The one kernel argument is its family's params struct by value, at the size of
            // the Rust mirror.
            let first_arg = k.split(".args:").nth(1).unwrap_or_default();
            let size = format!(".size:           {bytes}");
            assert!(first_arg.contains(&size), "{kernel} {a}: params size\n{first_arg}");
        }
    }
}

#[test]
fn embedded_sources_compile_as_hiprtc_would_see_them() {
    let Some(clang) = clang() else { return skip("no clang++-19 with the AMDGPU target") };
    let dir = tmpdir("rtc");
    // gfx1100 (RDNA3, wave32) has no prebuilt objects: the portable stages reach it only this
    // way. The MFMA kernel must build for every CDNA arch it claims (gfx908 has no object here).
    let mut jobs: Vec<(&str, &str)> =
        STAGES.iter().filter(|s| !MFMA_STAGES.contains(s)).map(|s| (*s, "gfx1100")).collect();
    for stage in MFMA_STAGES {
        jobs.extend([(stage, "gfx908"), (stage, "gfx942")]);
    }
    for (name, a) in jobs {
        let src = dir.join(format!("{name}.hip"));
        std::fs::write(&src, stage(name).source).unwrap();
        // No -I: the embedded source must stand alone, as it does under hipRTC.
        let out = Command::new(&clang)
            .args(["-x", "hip", "-nogpuinc", "-nogpulib", "-O3", "-std=c++17", "--cuda-device-only"])
            .args(["--no-gpu-bundle-output", "-c", &format!("--offload-arch={a}")])
            .arg(&src)
            .arg("-o")
            .arg(dir.join(format!("{name}.{a}.hsaco")))
            .output()
            .unwrap();
        assert!(out.status.success(), "{name} for {a}:\n{}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn device_side_params_layout_equals_the_rust_mirror() {
    let Some(clang) = clang() else { return skip("no clang++-19 with the AMDGPU target") };
    // offsetof on the derived structs (not standard-layout) is what the Itanium ABI lays out, which
    // every compiler of these kernels follows; clang warns that the standard does not promise it.
    let mut src = String::from(
        "#include \"common/compat.h\"\n#include \"common/params.h\"\n\
         #pragma clang diagnostic ignored \"-Winvalid-offsetof\"\n",
    );
    for (st, f, off) in params::field_offsets() {
        src += &format!("static_assert(__builtin_offsetof({st}, {f}) == {off}, \"{st}::{f}\");\n");
    }
    for (st, size) in [
        ("TmParams", std::mem::size_of::<params::CommonParams>()),
        ("TmInputParams", std::mem::size_of::<InputParams>()),
        ("TmOutputParams", std::mem::size_of::<OutputParams>()),
    ] {
        src += &format!("static_assert(sizeof({st}) == {size}, \"{st} size\");\n");
    }
    let file = tmpdir("params").join("params_layout.hip");
    std::fs::write(&file, src).unwrap();
    for a in ARCHS {
        let out = Command::new(&clang)
            .args(["-x", "hip", "-nogpuinc", "-nogpulib", "-std=c++17", "--cuda-device-only", "-fsyntax-only"])
            .arg(format!("--offload-arch={a}"))
            .arg("-I")
            .arg(root())
            .arg(&file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{a}: device layout differs:\n{}", String::from_utf8_lossy(&out.stderr));
    }
}

// ------------------------------------------------------------------ MFMA kernel, CPU emulation

/// Every `tm_*` name the kernel bodies use must exist in the CPU stand-in for compat.h/mfma.h,
/// or the emulation and the fake ROCm stop compiling when the portability layer grows.
#[test]
fn emulation_header_covers_every_name_the_kernels_use() {
    let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap();
    let emu = read(&root().join("tests/hip_emu/emu.h"));
    let mut bodies: Vec<PathBuf> = std::fs::read_dir(root().join("common"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "h"))
        // Definitions, not bodies: the portability layer, the parameter structs and the storage
        // types (which emu.h includes itself).
        .filter(|p| !p.ends_with("compat.h") && !p.ends_with("params.h") && !p.ends_with("storage_types.h"))
        .collect();
    bodies.push(root().join("hip/output_projection.h"));
    bodies.push(root().join("hip/input_projection.h"));
    let mut names: Vec<String> = bodies
        .iter()
        .flat_map(|p| {
            read(p)
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("tm_"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    // Helpers the bodies define themselves (common/pair_io.h: `TM_INLINE float tm_row_x(...)`)
    // come with them.
    let defined: Vec<String> = bodies
        .iter()
        .flat_map(|p| {
            read(p)
                .lines()
                .filter_map(|l| l.strip_prefix("TM_INLINE "))
                .filter_map(|l| l.split('(').next()?.split_whitespace().last().map(str::to_string))
                .collect::<Vec<_>>()
        })
        .collect();
    names.retain(|n| !defined.contains(n));
    names.sort();
    names.dedup();
    assert!(names.len() >= 10, "parsed too few names: {names:?}");
    assert!(defined.iter().any(|d| d == "tm_row_x4"), "parsed no body-defined helper: {defined:?}");
    let missing: Vec<&String> = names.iter().filter(|n| !emu.contains(n.as_str())).collect();
    assert!(missing.is_empty(), "tests/hip_emu/emu.h lacks {missing:?} (used by the kernels)");
}

/// Builds `tests/hip_emu/<name>.cpp` (a kernel body on the CPU emulation) with the host clang,
/// or `None` (a visible skip) without one.
fn build_emulation(name: &str) -> Option<PathBuf> {
    let Some(cxx) = tool("TRIMUL_HOST_CXX", &["clang++-19", "clang++"]) else {
        skip("no host clang++ (C++20, _Float16) for the emulation");
        return None;
    };
    let exe = tmpdir("emu").join(format!("{name}_emu"));
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-Wall", "-Wno-psabi"])
        .arg("-I")
        .arg(root())
        .arg(root().join(format!("tests/hip_emu/{name}.cpp")))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(out.status.success(), "building the {name} emulation:\n{}", String::from_utf8_lossy(&out.stderr));
    Some(exe)
}

/// Runs an emulation with `args`, failing the test if it fails or hangs (lanes that diverge at a
/// wave-wide operation deadlock the emulation); returns its last words.
fn run_emulation(exe: &Path, args: &[String]) -> String {
    let mut child = Command::new(exe).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("emulation of case {args:?} hung: lanes diverged at a barrier, a shuffle or an MFMA?");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(status.success(), "case {args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
    text.trim().to_string()
}

/// The emulated MFMA (which the kernel's emulated tests and the fake ROCm run on) reads A, B and
/// C and writes D where AMD's published layout of `v_mfma_f32_32x32x8f16` says, on CDNA1, CDNA2
/// and CDNA3 (`tests/hip_emu/mfma_tables/`, the Matrix Instruction Calculator's output): the
/// emulation was written from the same ISA description as `hip/mfma.h`, so without this a
/// layout error in both would pass every emulated test.
#[test]
fn mfma_emulation_follows_the_published_register_layout() {
    let Some(exe) = build_emulation("mfma_layout") else { return };
    let tables = root().join("tests/hip_emu/mfma_tables");
    for arch in ["cdna1", "cdna2", "cdna3"] {
        let text = run_emulation(&exe, &[tables.display().to_string(), arch.to_string()]);
        eprintln!("{text}");
    }
}

#[test]
fn mfma_output_kernel_matches_f64_in_cpu_emulation() {
    let Some(exe) = build_emulation("output_projection") else { return };
    // (B, N, H, C, af3, bias, row0, rows): partial blocks, a batch boundary inside a block,
    // column tails, more column tiles than waves, idle waves, a chunk not starting at 0, H at its
    // LDS limit.
    let m = |b: usize, n: usize| b * n * n;
    type Case = (usize, usize, usize, usize, u8, u8, usize, usize);
    let cases: [Case; 7] = [
        (2, 9, 32, 80, 0, 0, 0, m(2, 9)),
        (1, 8, 128, 128, 0, 0, 0, m(1, 8)),
        (1, 12, 64, 40, 1, 1, 0, m(1, 12)),
        (1, 16, 16, 130, 1, 0, 70, 100),
        (3, 5, 8, 7, 0, 0, 0, m(3, 5)),
        (1, 10, 248, 33, 1, 1, 0, m(1, 10)),
        (2, 11, 24, 161, 0, 0, 50, 150),
    ];
    for (i, (b, n, h, c, af3, bias, row0, rows)) in cases.into_iter().enumerate() {
        assert!(
            matches!(kernels::output_rule("gfx942", h, Some("1")), kernels::PathRule::Fixed { on: true, .. }),
            "H={h}"
        );
        let smem = kernels::output_projection_smem_bytes(h);
        let args = [b, n, h, c, af3 as usize, bias as usize, row0, rows, smem, 1000 + i].map(|v| v.to_string());
        let text = run_emulation(&exe, &args);
        eprintln!("output_projection B={b} N={n} H={h} C={c} af3={af3} bias={bias} rows {row0}+{rows}: {text}");
    }
}

/// The fused MFMA input stage (`hip/input_projection.h`: LN_C, the five projections, the gating)
/// on the CPU emulation against f64, every element of left, right and the gate, and nothing
/// written outside the launched positions: both formulations, bias and mask on and off, f32, bf16
/// and f16 x, partial blocks and a batch boundary inside one, partial hidden and gate tiles,
/// C % 8 == 4 (the last reduction step half empty), a launch not starting at 0, C at its LDS limit;
/// and the chunked plans' launches: a hidden pass's work items into a window of left/right (one
/// aligned to the 32-channel tiles, one not), the gate's items alone, nothing written outside them.
#[test]
fn mfma_input_kernel_matches_f64_in_cpu_emulation() {
    let Some(exe) = build_emulation("input_projection") else { return };
    // (B, N, C, H, af3, bias, mask, io, row0, rows, window's first channel, its channels (0: all),
    // first work item, end of the work items (0: all))
    let cases: [[usize; 14]; 10] = [
        [1, 9, 32, 40, 1, 1, 1, 0, 0, 81, 0, 0, 0, 0],
        [2, 7, 36, 16, 0, 0, 1, 1, 0, 98, 0, 0, 0, 0],
        [3, 5, 128, 128, 1, 0, 0, 2, 10, 60, 0, 0, 0, 0],
        [1, 12, 64, 8, 0, 1, 1, 0, 50, 94, 0, 0, 0, 0],
        [2, 9, 256, 32, 1, 1, 1, 1, 0, 162, 0, 0, 0, 0],
        [1, 16, 128, 128, 0, 0, 1, 0, 0, 256, 0, 0, 0, 0],
        [1, 11, 508, 24, 1, 1, 0, 2, 3, 100, 0, 0, 0, 0],
        [2, 9, 64, 96, 1, 1, 1, 0, 0, 162, 32, 32, 1, 2],
        [1, 10, 32, 128, 0, 0, 1, 2, 0, 100, 40, 30, 1, 3],
        [1, 12, 128, 64, 1, 1, 1, 1, 64, 80, 0, 0, 2, 6],
    ];
    for (i, case) in cases.into_iter().enumerate() {
        assert!(kernels::input_projection_smem_bytes(case[2]) <= kernels::LDS_BYTES, "{case:?}");
        let mut args: Vec<String> = case[..10].iter().map(|v| v.to_string()).collect();
        args.push((3000 + i).to_string());
        args.extend(case[10..].iter().map(|v| v.to_string()));
        let text = run_emulation(&exe, &args);
        eprintln!("input_projection {case:?}: {text}");
    }
}

/// The ten backward kernels of `common/backward.h` (which the HIP backward launches,
/// `backward.rs`; end to end on the fake ROCm in `tests/hip_fake_rocm.rs`) on wave64, one at a
/// time against f64 (`tests/hip_emu/backward.cpp`): the
/// LayerNorms forward and backward with their column sums, the gating and its backward, the
/// output gate's backward in both formulations, the two-pass column sums and the widening. The
/// LayerNorm backward kernels' 32-lane groups run different numbers of positions (the
/// emulation's shuffles wait for the lane's half alone, as the hardware's do).
#[test]
fn backward_kernels_match_f64_in_cpu_emulation() {
    let Some(exe) = build_emulation("backward") else { return };
    // (B, N, C, H, blocks, af3): 49 positions over 2 blocks (one 32-lane group of a wave one
    // position more than the other), widths with tails and below 32, H = 128, more blocks than
    // tiles, both formulations.
    for (i, (b, n, c, h, blocks, af3)) in
        [(1, 7, 128, 128, 2, 0), (2, 5, 40, 24, 3, 1), (3, 3, 7, 33, 5, 1), (1, 4, 64, 16, 4, 0)]
            .into_iter()
            .enumerate()
    {
        let args = [b, n, c, h, blocks, af3, 2000 + i].map(|v| v.to_string());
        let text = run_emulation(&exe, &args);
        eprintln!("backward kernels B={b} N={n} C={c} H={h} blocks={blocks} af3={af3}: {text}");
    }
}

// ------------------------------------------------------------------- rocBLAS argument checks

/// `D = alpha·op(A)·op(B) + beta·D` exactly as rocBLAS documents `rocblas_gemm_ex` /
/// `rocblas_gemm_strided_batched_ex` (column-major; `op` from `trans_a`/`trans_b`), driven only
/// by the arguments of the call, in f64.
fn rocblas_model(g: &RocblasGemm, alpha: f64, a: &[f64], b: &[f64], beta: f64, d: &mut [f64]) {
    assert!(a.len() >= g.a_elems && b.len() >= g.b_elems && d.len() >= g.d_elems, "spans");
    assert!(g.strided_batched || g.batch == 1);
    let op = |t| match t {
        ROCBLAS_OPERATION_NONE => false,
        ROCBLAS_OPERATION_TRANSPOSE => true,
        other => panic!("operation {other}"),
    };
    let (ta, tb) = (op(g.trans_a), op(g.trans_b));
    let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let (lda, ldb, ldd) = (g.a.ld as usize, g.b.ld as usize, g.d.ld as usize);
    assert_eq!(g.c, g.d, "C aliases D");
    for bt in 0..g.batch as usize {
        let (sa, sb, sd) = (bt * g.a.stride as usize, bt * g.b.stride as usize, bt * g.d.stride as usize);
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0.0;
                for p in 0..k {
                    let av = if ta { a[sa + p + i * lda] } else { a[sa + i + p * lda] };
                    let bv = if tb { b[sb + j + p * ldb] } else { b[sb + p + j * ldb] };
                    acc += av * bv;
                }
                let dv = &mut d[sd + i + j * ldd];
                *dv = if beta == 0.0 { alpha * acc } else { alpha * acc + beta * *dv };
            }
        }
    }
}

fn rnd(len: usize, seed: u64) -> Vec<f64> {
    let mut r = Rng::new(seed);
    (0..len).map(|_| r.normal()).collect()
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-9 * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
    }
}

/// The same spec through `GemmSpec::run_host` (the layout the CUDA path hands cuBLASLt).
fn cuda_layout(spec: &GemmSpec, a: &[f64], b: &[f64], d_len: usize) -> Vec<f64> {
    let (a32, b32): (Vec<f32>, Vec<f32>) =
        (a.iter().map(|&v| v as f32).collect(), b.iter().map(|&v| v as f32).collect());
    let mut d = vec![0f32; d_len];
    spec.run_host(&a32, &b32, &mut d);
    d.into_iter().map(f64::from).collect()
}

#[test]
fn rocblas_projection_and_output_calls_compute_the_spec_products() {
    // proj[rows, P] = z[rows, C]·Wcat[P, C]ᵀ, all row-major.
    let (rows, c, p) = (9, 7, 13);
    let (z, w) = (rnd(rows * c, 1), rnd(p * c, 2));
    let spec = GemmSpec::projection(rows, c, p);
    let g = RocblasGemm::from_spec(&spec, DataType::F16, DataType::F16).unwrap();
    let mut proj = vec![0.0; rows * p];
    rocblas_model(&g, 1.0, &w, &z, 0.0, &mut proj);
    let want: Vec<f64> = (0..rows)
        .flat_map(|i| (0..p).map(move |o| (i, o)))
        .map(|(i, o)| (0..c).map(|k| z[i * c + k] * w[o * c + k]).sum())
        .collect();
    assert_close(&proj, &want, "projection");
    let cuda = cuda_layout(&spec, &w, &z, rows * p);
    for (x, y) in proj.iter().zip(&cuda) {
        assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "rocBLAS and CUDA layouts differ: {x} {y}");
    }

    // y[rows, C] = a[rows, H]·Wout[C, H]ᵀ, then the af3 bias: y += bout.
    let (rows, c, h) = (11, 6, 8);
    let (a, wout, bias) = (rnd(rows * h, 3), rnd(c * h, 4), rnd(c, 5));
    let g = RocblasGemm::from_spec(&GemmSpec::output(rows, c, h), DataType::F16, DataType::F32).unwrap();
    // beta = 0: D is not read (BLAS convention), so NaN left in y by the poisoning must vanish.
    let mut y = vec![f64::NAN; rows * c];
    rocblas_model(&g, 1.0, &wout, &a, 0.0, &mut y);
    let want: Vec<f64> = (0..rows)
        .flat_map(|i| (0..c).map(move |o| (i, o)))
        .map(|(i, o)| (0..h).map(|k| a[i * h + k] * wout[o * h + k]).sum())
        .collect();
    assert_close(&y, &want, "output");
    let gb = RocblasGemm::from_spec(&bias_update_spec(rows, c), DataType::F32, DataType::F32).unwrap();
    rocblas_model(&gb, 1.0, &bias, &vec![1.0; rows], 1.0, &mut y);
    let with_bias: Vec<f64> = want.iter().enumerate().map(|(idx, v)| v + bias[idx % c]).collect();
    assert_close(&y, &with_bias, "output + bias");
}

#[test]
fn rocblas_contraction_calls_compute_both_directions() {
    let (b, h, n) = (2, 3, 5);
    let bh = b * h;
    // left/right in the contraction layout [B, H, N, N]: element (b, i, k, h) at ((b·H + h)·N + i)·N + k.
    let (left, right) = (rnd(bh * n * n, 6), rnd(bh * n * n, 7));
    let at = |v: &[f64], bb: usize, hh: usize, i: usize, k: usize| v[((bb * h + hh) * n + i) * n + k];
    for dir in [Direction::Outgoing, Direction::Incoming] {
        let spec = GemmSpec::contraction(dir, bh, n);
        let g = RocblasGemm::from_spec(&spec, DataType::F16, DataType::F16).unwrap();
        assert_eq!((g.batch as usize, g.d.stride as usize), (bh, n * n));
        let mut t = vec![0.0; bh * n * n];
        rocblas_model(&g, 1.0, &right, &left, 0.0, &mut t);
        for bb in 0..b {
            for hh in 0..h {
                for i in 0..n {
                    for j in 0..n {
                        let want: f64 = (0..n)
                            .map(|k| match dir {
                                // t[b,i,j,h] = Σ_k left[b,i,k,h]·right[b,j,k,h]
                                Direction::Outgoing => at(&left, bb, hh, i, k) * at(&right, bb, hh, j, k),
                                // t[b,i,j,h] = Σ_k left[b,k,i,h]·right[b,k,j,h]
                                Direction::Incoming => at(&left, bb, hh, k, i) * at(&right, bb, hh, k, j),
                            })
                            .sum();
                        let got = at(&t, bb, hh, i, j);
                        assert!((got - want).abs() <= 1e-9 * (1.0 + want.abs()), "{dir} b{bb} h{hh} ({i},{j})");
                    }
                }
            }
        }
        let cuda = cuda_layout(&spec, &right, &left, bh * n * n);
        for (x, y) in t.iter().zip(&cuda) {
            assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{dir}: rocBLAS and CUDA layouts differ");
        }
    }
}

#[test]
fn every_suite_and_bench_shape_has_valid_rocblas_calls_and_a_plan() {
    use crate::plan::Plan;
    for case in suite::test_cases().into_iter().chain(suite::bench_cases()) {
        for f in [Formulation::GpuMode, Formulation::Af3] {
            for dir in [Direction::Outgoing, Direction::Incoming] {
                let problem = case.problem(f, dir).unwrap();
                let plan = Plan::one_pass(&problem, super::ROCM_CAPS, false).unwrap();
                let cfg = problem.config;
                let m = problem.shape.rows();
                let what = format!("{} {f} {dir}", case.name());
                for (_, rows) in plan.input_chunks() {
                    let g = RocblasGemm::from_spec(
                        &GemmSpec::projection(rows, cfg.c, plan.p),
                        DataType::F16,
                        DataType::F16,
                    )
                    .unwrap();
                    assert!(g.b_elems <= rows * cfg.c && g.d_elems <= rows * plan.p, "{what}");
                }
                let g = RocblasGemm::from_spec(
                    &GemmSpec::contraction(dir, problem.shape.batch * cfg.h, problem.shape.n),
                    DataType::F16,
                    DataType::F16,
                )
                .unwrap();
                // The contraction reads and writes exactly the [B, H, N, N] buffers.
                assert_eq!((g.a_elems, g.b_elems, g.d_elems), (m * cfg.h, m * cfg.h, m * cfg.h), "{what}");
                let g =
                    RocblasGemm::from_spec(&GemmSpec::output(m, cfg.c, cfg.h), DataType::F16, DataType::F32).unwrap();
                assert_eq!((g.b_elems, g.d_elems), (m * cfg.h, m * cfg.c), "{what}");
            }
        }
    }
}

// ------------------------------------------------------------------ arch and kernel selection

#[test]
fn code_objects_are_selected_by_normalised_arch() {
    let no_rtc = || Err("libhiprtc.so: cannot open shared object file".to_string());
    for (id, want) in [
        ("gfx942", "gfx942"),
        ("gfx942:sramecc+:xnack-", "gfx942"),
        ("gfx90a", "gfx90a"),
        ("gfx90a:sramecc-:xnack+", "gfx90a"),
    ] {
        assert_eq!(arch::normalize_arch(id).as_deref(), Some(want));
        for s in STAGES {
            match kernels::select(HIP_STAGES, s, id, no_rtc(), false) {
                Ok(KernelImage::Prebuilt { code, arch, .. }) => {
                    assert_eq!(arch, want);
                    let (_, expected) = stage(s).code_objects.iter().find(|(a, _)| *a == want).unwrap();
                    assert!(std::ptr::eq(code, *expected), "{s} {id}: wrong object");
                }
                Ok(other) => panic!("{s} {id}: {other:?}"),
                // Built without clang: no objects, and without hipRTC that is a clear error.
                Err(e) => {
                    assert!(HIP_PREBUILT_ARCHS.is_empty(), "{s} {id}: {e}");
                    assert!(matches!(e, Error::NoKernels { .. }) && e.to_string().contains("hipRTC"), "{e}");
                }
            }
        }
    }
    // RDNA3: hipRTC if present, otherwise an error naming the arch and what the build has.
    match kernels::select(HIP_STAGES, "input_norm", "gfx1100", Ok(()), false).unwrap() {
        KernelImage::Compile { arch, options, source, .. } => {
            assert_eq!(arch, "gfx1100");
            assert!(options.iter().any(|o| o == "--offload-arch=gfx1100"));
            assert_eq!(source, stage("input_norm").source);
        }
        other => panic!("{other:?}"),
    }
    let e = kernels::select(HIP_STAGES, "input_norm", "gfx1100", no_rtc(), false).unwrap_err().to_string();
    assert!(e.contains("gfx1100") && e.contains("libhiprtc.so"), "{e}");
    let e = kernels::select(HIP_STAGES, "output_projection", "gfx1100:xnack-", Ok(()), false).unwrap_err().to_string();
    assert!(e.contains("MFMA"), "{e}");
    // Forcing hipRTC recompiles even where an object exists (to test that path on an MI300).
    assert!(matches!(
        kernels::select(HIP_STAGES, "input_norm", "gfx942:sramecc+:xnack-", Ok(()), true).unwrap(),
        KernelImage::Compile { .. }
    ));
}

// ------------------------------------------------------------------- libraries and detection

#[test]
fn missing_libraries_are_errors_that_name_what_was_tried() {
    let tried = vec!["libtrimul_no_such_library.so".to_string(), "/nonexistent/trimul/libamdhip64.so.6".to_string()];
    let errors = [
        sys::HipApi::load_from(&tried).map(|_| ()).unwrap_err(),
        sys::HiprtcApi::load_from(&tried).map(|_| ()).unwrap_err(),
        sys::RocblasApi::load_from(&tried).map(|_| ()).unwrap_err(),
    ];
    for (e, lib) in errors.iter().zip(["libamdhip64", "libhiprtc", "librocblas"]) {
        match e {
            Error::LibraryNotFound { library, tried: t, reason } => {
                assert!(library.contains(lib), "{library}");
                assert!(
                    t.contains("libtrimul_no_such_library.so") && t.contains("/nonexistent/trimul/libamdhip64.so.6")
                );
                assert!(!reason.is_empty());
            }
            other => panic!("{lib}: expected LibraryNotFound, got {other:?}"),
        }
    }
    // A library that loads but lacks our symbols (libc here) is MissingSymbol, not a crash.
    let libc = vec!["libc.so.6".to_string()];
    match sys::RocblasApi::load_from(&libc) {
        Err(Error::MissingSymbol { symbol, .. }) => assert_eq!(symbol, "rocblas_create_handle"),
        Err(other) => panic!("expected MissingSymbol, got {other:?}"),
        Ok(_) => panic!("libc is not rocBLAS"),
    }
    // The default candidates cover the sonames of ROCm 5 to 7 and /opt/rocm.
    let c = sys::candidates("TRIMUL_TEST_VARIABLE_NEVER_SET", sys::HIP_NAMES);
    for want in ["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.7", "/opt/rocm/lib/libamdhip64.so"] {
        assert!(c.iter().any(|x| x == want), "{want} not in {c:?}");
    }
}

#[test]
fn hip_device_is_an_error_without_rocm_and_detection_falls_back() {
    match HipBackend::new(0) {
        // On an AMD machine this test still has something to check.
        Ok(b) => {
            let info = Device::Hip(b).info();
            assert_eq!(info.vendor, "AMD");
            assert!(arch::normalize_arch(&info.arch).as_deref() == Some(info.arch.as_str()), "{}", info.arch);
        }
        Err(e) => {
            assert!(
                matches!(e, Error::LibraryNotFound { .. } | Error::NoDevice { backend: BackendKind::Hip, .. }),
                "unexpected error kind: {e:?}"
            );
            eprintln!("HIP unavailable here, as expected: {e}");
            let d = Device::detect_auto();
            assert_ne!(d.kind(), BackendKind::Hip);
            let probe = Device::probe_all();
            let hip = probe.iter().find(|(k, _)| *k == BackendKind::Hip).unwrap();
            assert!(hip.1.is_err());
        }
    }
}

#[test]
fn hip_versions_and_target_ids_read_from_property_images() {
    // The layout offsets the backend relies on, for both hipDeviceProp_t generations.
    for offset in [sys::PROP_R0600_GCN_ARCH_NAME, sys::PROP_R0000_GCN_ARCH_NAME] {
        let mut img = vec![0u8; sys::PROP_BUFFER_BYTES];
        img[..18].copy_from_slice(b"AMD Instinct MI250");
        img[offset..offset + 22].copy_from_slice(b"gfx90a:sramecc+:xnack-");
        assert_eq!(arch::arch_from_props(&img, offset).as_deref(), Some("gfx90a:sramecc+:xnack-"));
    }
    const { assert!(sys::PROP_R0600_GCN_ARCH_NAME + 256 <= 1472 && sys::PROP_BUFFER_BYTES >= 8 * 1472) };
}
