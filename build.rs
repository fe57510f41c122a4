//! Build script: embeds the GPU kernels. Building never requires a GPU toolkit, and a toolkit that
//! is present but cannot build them never fails the build: the kernels are then compiled at run
//! time instead, and the build says so (a `cargo:warning`, and the `kernels` line of
//! `trimul info`/`DeviceInfo::versions`, which also reaches users who depend on the crate from a
//! registry, where cargo hides warnings).
//!
//! CUDA (`--features cuda`): every `cuda/*.cu` is compiled with nvcc, when one is found (`NVCC`,
//! then `CUDA_HOME`/`CUDA_PATH`, then `PATH`), into one fatbin per stage holding sm_80 and
//! sm_90a machine code plus compute_80 PTX (sm_100a too when the nvcc accepts it). The sources,
//! with their `#include "common/..."` lines expanded, are always embedded as well, so a build
//! without nvcc compiles them once per process with NVRTC for the device's arch. An nvcc that
//! fails (too old for sm_90a, a host compiler it rejects, a kernel it does not accept) leaves
//! every stage to NVRTC, with a warning; `TRIMUL_REQUIRE_NVCC=1` (CI) makes a missing or failing
//! nvcc an error instead, and `TRIMUL_NO_NVCC=1` skips nvcc deliberately.
//!
//! HIP (`--features rocm`): every `hip/*.hip` is compiled with a clang that has the AMDGPU target
//! (`TRIMUL_HIP_CLANG`, then `$HIP_CLANG_PATH/clang++`, then `clang++-19`, `clang++` on `PATH`,
//! then ROCm's `/opt/rocm/llvm/bin/clang++`; Debian's clang-19 with lld-19 works, no ROCm needed)
//! into one linked code object (ELF `ET_DYN`, what `hipModuleLoadData` loads) per stage for each of
//! gfx942 (MI300) and gfx90a (MI200). The include-expanded sources are always embedded too, for
//! hipRTC on other archs or when no clang was found. A missing, unusable or failing clang leaves
//! every stage to hipRTC, with a warning; `TRIMUL_REQUIRE_HIP_CLANG=1` (CI) makes it an error, and
//! `TRIMUL_NO_HIP_CLANG=1` skips clang deliberately.
//!
//! On docs.rs (`DOCS_RS` set) neither compiler is run: documentation needs no kernels.
//!
//! Compiled kernels are cached in `OUT_DIR` under a hash of the compiler, its flags and the
//! include-expanded source, so a re-run of this script (an environment variable it watches
//! changed, or one kernel file) recompiles only what changed.
//!
//! It also stamps the source commit into the crate (`TRIMUL_GIT_COMMIT`) for bench reports.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every environment variable this script reads, besides cargo's own. Declared first thing, so that
/// no early return leaves one unwatched. `PATH` is watched where a compiler lookup reaches it
/// ([`watch_path_lookup`]): a build told where its compilers are (`NVCC`, `TRIMUL_HIP_CLANG`, as
/// `scripts/setup.sh` exports) is not rebuilt whenever `PATH` changes.
const WATCHED_ENV: &[&str] = &[
    "TRIMUL_GIT_COMMIT",
    "DOCS_RS",
    "TRIMUL_NO_NVCC",
    "TRIMUL_REQUIRE_NVCC",
    "NVCC",
    "CUDA_HOME",
    "CUDA_PATH",
    "TRIMUL_NO_HIP_CLANG",
    "TRIMUL_REQUIRE_HIP_CLANG",
    "TRIMUL_HIP_CLANG",
    "HIP_CLANG_PATH",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=common");
    for var in WATCHED_ENV {
        println!("cargo:rerun-if-env-changed={var}");
    }
    git_commit_env();
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    kernel_geometry(&out);
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        cuda_kernels(&out);
    }
    if env::var_os("CARGO_FEATURE_ROCM").is_some() {
        hip_kernels(&out);
    }
}

fn manifest_dir() -> PathBuf {
    PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
}

fn flag(var: &str) -> bool {
    env::var_os(var).is_some()
}

/// `PATH` is about to be searched for a compiler: its value now decides what this build embeds.
fn watch_path_lookup() {
    println!("cargo:rerun-if-env-changed=PATH");
}

/// A vendor compiler this build will not use: an error when CI asked for prebuilt kernels
/// (`require_var` set), otherwise a one-line warning (a long compiler output goes to a log file in
/// `OUT_DIR`, named in the warning), and the kernels are compiled at run time. Returns the build
/// description: compiled at run time by `runtime_compiler`, with the short reason.
fn no_prebuilt(out: &Path, require_var: &str, vendor: &str, runtime_compiler: &str, why: &str) -> String {
    if flag(require_var) {
        panic!("{require_var} is set, but {why}");
    }
    let short = first_lines(why);
    let mut warning =
        format!("{vendor} kernels not prebuilt, {runtime_compiler} will compile them at run time: {short}");
    if why.lines().count() > 3 {
        let log = out.join(format!("{}-build-error.log", vendor.to_lowercase()));
        if fs::write(&log, why).is_ok() {
            let _ = write!(warning, " (full output: {})", log.display());
        }
    }
    println!("cargo:warning={warning}");
    format!("compiled at run time by {runtime_compiler} (not prebuilt: {short})")
}

/// Whether this build may look for a vendor compiler at all: not in a documentation build, nor
/// with `opt_out` (`TRIMUL_NO_NVCC`, `TRIMUL_NO_HIP_CLANG`) set; the error says which.
fn prebuilding_allowed(opt_out: &str) -> Result<(), String> {
    if flag("DOCS_RS") {
        return Err("DOCS_RS is set (a documentation build needs no kernels)".into());
    }
    if flag(opt_out) {
        return Err(format!("{opt_out} is set"));
    }
    Ok(())
}

/// The first lines of a compiler's error output, on one line (a `cargo:warning` is one line).
fn first_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).take(3).collect();
    let mut s = lines.join(" | ");
    if s.len() > 400 {
        let cut = (0..=400).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// 64-bit FNV-1a: a stable hash (unlike std's, which may change between Rust releases) for the
/// kernel cache keys.
fn fnv1a(parts: &[&[u8]]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(&[0xff]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// What identifies a compiler binary for the cache: its path, size and modification time.
fn tool_id(tool: &Path) -> String {
    let meta = fs::metadata(tool).ok();
    let mtime = meta.as_ref().and_then(|m| m.modified().ok()).map(|t| format!("{t:?}")).unwrap_or_default();
    format!("{}|{}|{mtime}", tool.display(), meta.map_or(0, |m| m.len()))
}

/// Runs `cmd` to produce `output` unless `output` exists with the same `key` (written beside it
/// only after a successful run, and removed before a new one).
fn cached_compile(mut cmd: Command, output: &Path, key: &str) -> Result<(), String> {
    let key_file = output.with_extension(format!("{}.key", output.extension().and_then(|e| e.to_str()).unwrap_or("")));
    if output.is_file() && fs::read_to_string(&key_file).is_ok_and(|k| k == key) {
        return Ok(());
    }
    let _ = fs::remove_file(&key_file);
    let program = cmd.get_program().to_string_lossy().into_owned();
    let o = cmd.output().map_err(|e| format!("running {program}: {e}"))?;
    if !o.status.success() {
        let mut text = String::from_utf8_lossy(&o.stderr).into_owned();
        text.push_str(&String::from_utf8_lossy(&o.stdout));
        return Err(text);
    }
    fs::write(&key_file, key).map_err(|e| format!("writing {}: {e}", key_file.display()))?;
    Ok(())
}

/// `#include "common/x.h"` lines replaced by the file's contents (once each), so the embedded
/// source compiles under NVRTC/hipRTC with no include path.
fn expand_includes(root: &Path, file: &Path, seen: &mut Vec<PathBuf>) -> String {
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    let mut out = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("#include \"") {
            let name = rest.trim_end_matches('"');
            let path = root.join(name);
            if !seen.contains(&path) {
                seen.push(path.clone());
                out.push_str(&expand_includes(root, &path, seen));
            }
            continue;
        }
        if trimmed.starts_with("#pragma once") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// One kernel file: its stem (the stage name), path, and include-expanded source (also written to
/// `OUT_DIR` with `ext`, for the crate to embed).
struct Source {
    stem: String,
    path: PathBuf,
    expanded: String,
    embedded: PathBuf,
}

fn sources(root: &Path, dir: &str, ext: &str, out: &Path) -> Vec<Source> {
    println!("cargo:rerun-if-changed={dir}");
    let mut paths: Vec<PathBuf> = fs::read_dir(root.join(dir))
        .unwrap_or_else(|e| panic!("reading {dir}/: {e}"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let stem = path.file_stem().and_then(|s| s.to_str()).expect("utf-8 kernel file name").to_string();
            let expanded = expand_includes(root, &path, &mut Vec::new());
            let embedded = out.join(format!("{stem}.{ext}"));
            fs::write(&embedded, &expanded).expect("write expanded source");
            Source { stem, path, expanded, embedded }
        })
        .collect()
}

/// The generated table of the `vendor` stages, `pub const <name>: &[<ty>]`: one `<ty>` per
/// source, with its name, its embedded source and then `code(i)`, the field that holds source
/// `i`'s prebuilt code.
fn stage_table(vendor: &str, name: &str, ty: &str, srcs: &[Source], code: impl Fn(usize) -> String) -> String {
    let mut table = format!("/// Embedded {vendor} stages (generated by build.rs).\npub const {name}: &[{ty}] = &[\n");
    for (i, src) in srcs.iter().enumerate() {
        let _ = writeln!(
            table,
            "    {ty} {{ name: {:?}, source: include_str!({:?}), {} }},",
            src.stem,
            src.embedded.display().to_string(),
            code(i)
        );
    }
    table.push_str("];\n");
    table
}

// ------------------------------------------------------------------------------ kernel geometry

/// Turns `common/smem.h` (block sizes and shared-memory sizes, which the kernels assert their
/// layouts against) into `OUT_DIR/smem.rs`, included by `src/backend/params.rs`: each
/// `#define NAME value` becomes `pub const NAME: usize = value;` and each
/// `#define NAME(A, B) value` a `pub const fn NAME(A: usize, B: usize) -> usize`. The values are
/// integer arithmetic, which reads the same in C and in Rust; anything else fails the build
/// rather than being translated by guesswork. `TM_MAX` is C's ternary, written here in Rust.
fn kernel_geometry(out: &Path) {
    let path = manifest_dir().join("common/smem.h");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut rs = String::from(
        "// Generated by build.rs from common/smem.h: edit that file, not this one.\n\
         pub const fn TM_MAX(a: usize, b: usize) -> usize {\n    if a > b { a } else { b }\n}\n",
    );
    for (i, line) in text.lines().enumerate() {
        let Some(def) = line.trim().strip_prefix("#define ") else { continue };
        let bad = |why: &str| -> ! { panic!("common/smem.h:{}: {why}: {line}", i + 1) };
        let def = def.split("//").next().unwrap_or_default().trim();
        let name_end = def.find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')).unwrap_or(def.len());
        let (name, rest) = def.split_at(name_end);
        if name == "TM_MAX" {
            continue;
        }
        let (args, value) = match rest.strip_prefix('(') {
            Some(r) => {
                let (args, value) = r.split_once(')').unwrap_or_else(|| bad("unclosed argument list"));
                (Some(args.split(',').map(str::trim).collect::<Vec<_>>()), value.trim())
            }
            None => (None, rest.trim()),
        };
        if value.is_empty() || !value.chars().all(|ch| ch.is_ascii_alphanumeric() || " _+-*/(),".contains(ch)) {
            bad("not integer arithmetic");
        }
        match args {
            Some(args) => {
                let params: Vec<String> = args.iter().map(|a| format!("{a}: usize")).collect();
                let _ = writeln!(rs, "pub const fn {name}({}) -> usize {{\n    {value}\n}}", params.join(", "));
            }
            None => {
                let _ = writeln!(rs, "pub const {name}: usize = {value};");
            }
        }
    }
    fs::write(out.join("smem.rs"), rs).expect("write smem.rs");
}

// ------------------------------------------------------------------------------------------ CUDA

/// The nvcc to use, or why there is none.
fn find_nvcc() -> Result<PathBuf, String> {
    prebuilding_allowed("TRIMUL_NO_NVCC")?;
    if let Some(p) = env::var_os("NVCC") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        println!("cargo:warning=NVCC={} is not a file; looking for nvcc elsewhere", p.display());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(p) = env::var_os(var) {
            let p = PathBuf::from(p).join("bin").join("nvcc");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    watch_path_lookup();
    env::var_os("PATH")
        .and_then(|path| env::split_paths(&path).map(|d| d.join("nvcc")).find(|c| c.is_file()))
        .ok_or_else(|| "no nvcc found (NVCC, CUDA_HOME, CUDA_PATH, PATH)".to_string())
}

/// `13.0` from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88").
fn nvcc_release(nvcc: &Path) -> Result<String, String> {
    let o = Command::new(nvcc).arg("--version").output().map_err(|e| format!("running {}: {e}", nvcc.display()))?;
    let text = String::from_utf8_lossy(&o.stdout);
    if !o.status.success() {
        return Err(format!(
            "{} --version failed: {}",
            nvcc.display(),
            first_lines(&String::from_utf8_lossy(&o.stderr))
        ));
    }
    text.split("release ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .map(|r| r.trim().to_string())
        .ok_or_else(|| format!("{} --version names no release: {}", nvcc.display(), first_lines(&text)))
}

/// The oldest NVIDIA driver that loads what nvcc `release` builds (CUDA's minimum driver for
/// its major version, Linux), for the build description.
fn min_driver(release: &str) -> Option<&'static str> {
    match release.split('.').next()?.parse::<u32>().ok()? {
        13 => Some("R580"),
        12 => Some("R525"),
        11 => Some("R450"),
        _ => None,
    }
}

fn nvcc_accepts(nvcc: &Path, arch: &str) -> bool {
    Command::new(nvcc)
        .arg("--list-gpu-code")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(arch))
        .unwrap_or(false)
}

/// Compiles every stage into a fatbin; the first failure is returned whole (nvcc's output).
fn nvcc_fatbins(
    nvcc: &Path,
    release: &str,
    gencodes: &[&str],
    root: &Path,
    srcs: &[Source],
    out: &Path,
) -> Result<Vec<PathBuf>, String> {
    let tool = tool_id(nvcc);
    let mut bins = Vec::new();
    for src in srcs {
        let bin = out.join(format!("{}.fatbin", src.stem));
        let mut cmd = Command::new(nvcc);
        cmd.arg("-fatbin").arg("-O3").arg("-std=c++17").arg("-I").arg(root);
        for g in gencodes {
            cmd.arg(format!("-gencode={g}"));
        }
        cmd.arg(&src.path).arg("-o").arg(&bin);
        let key = fnv1a(&[tool.as_bytes(), release.as_bytes(), gencodes.join(" ").as_bytes(), src.expanded.as_bytes()]);
        cached_compile(cmd, &bin, &key).map_err(|e| format!("nvcc {release} failed on {}: {e}", src.path.display()))?;
        bins.push(bin);
    }
    Ok(bins)
}

fn cuda_kernels(out: &Path) {
    let root = manifest_dir();
    let srcs = sources(&root, "cuda", "cu", out);
    let mut gencodes =
        vec!["arch=compute_80,code=sm_80", "arch=compute_90a,code=sm_90a", "arch=compute_80,code=compute_80"];
    let built = find_nvcc().and_then(|nvcc| {
        println!("cargo:rerun-if-changed={}", nvcc.display());
        let release = nvcc_release(&nvcc)?;
        if nvcc_accepts(&nvcc, "sm_100a") {
            gencodes.push("arch=compute_100a,code=sm_100a");
        }
        let bins = nvcc_fatbins(&nvcc, &release, &gencodes, &root, &srcs, out)?;
        Ok((release, bins))
    });
    let (bins, build) = match built {
        Ok((release, bins)) => {
            let targets: Vec<String> = gencodes
                .iter()
                .map(|g| match g.split_once(",code=") {
                    Some((_, code)) if code.starts_with("compute_") => format!("{code} PTX"),
                    Some((_, code)) => code.to_string(),
                    None => g.to_string(),
                })
                .collect();
            let driver = min_driver(&release).map(|d| format!(", which need an {d}+ driver")).unwrap_or_default();
            let build = format!(
                "prebuilt by nvcc {release} ({}{driver}); NVRTC compiles at run time only where they do not load",
                targets.join(", ")
            );
            (Some(bins), build)
        }
        Err(why) => (None, no_prebuilt(out, "TRIMUL_REQUIRE_NVCC", "CUDA", "NVRTC", &why)),
    };
    let mut table = stage_table("CUDA", "CUDA_STAGES", "EmbeddedStage", &srcs, |i| match &bins {
        Some(b) => format!("binary: Some(include_bytes!({:?}))", b[i].display().to_string()),
        None => "binary: None".to_string(),
    });
    let _ = writeln!(table, "/// How the CUDA kernels were built: prebuilt, or compiled at run time and why.");
    let _ = writeln!(table, "pub const CUDA_BUILD: &str = {build:?};");
    fs::write(out.join("cuda_kernels.rs"), table).expect("write cuda_kernels.rs");
}

// ------------------------------------------------------------------------------------------- HIP

/// Processors every HIP kernel is compiled for ahead of time: MI300 (CDNA3) and MI200 (CDNA2).
const HIP_ARCHS: &[&str] = &["gfx942", "gfx90a"];

/// Flags for one device-only, linked HIP compile without ROCm headers or device libraries. In
/// non-RDC mode clang links the device code with lld even under `-c`, so the output is a loadable
/// code object, not a relocatable one; `--no-gpu-bundle-output` keeps it a plain ELF.
fn hip_clang_args(arch: &str) -> Vec<String> {
    ["-x", "hip", "-nogpuinc", "-nogpulib", "-O3", "-std=c++17", "--cuda-device-only", "--no-gpu-bundle-output"]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("--offload-arch={arch}")])
        .collect()
}

fn clang_lists_amdgpu(clang: &Path) -> bool {
    Command::new(clang)
        .arg("--print-targets")
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("amdgcn"))
        .unwrap_or(false)
}

/// The clang to use, or why there is none.
fn find_hip_clang() -> Result<PathBuf, String> {
    prebuilding_allowed("TRIMUL_NO_HIP_CLANG")?;
    if let Some(p) = env::var_os("TRIMUL_HIP_CLANG") {
        let p = PathBuf::from(p);
        // An explicit choice is not second-guessed by a search elsewhere.
        return if clang_lists_amdgpu(&p) {
            Ok(p)
        } else {
            Err(format!("TRIMUL_HIP_CLANG={} is not a clang with the AMDGPU target", p.display()))
        };
    }
    if let Some(dir) = env::var_os("HIP_CLANG_PATH") {
        let c = PathBuf::from(dir).join("clang++");
        if c.is_file() && clang_lists_amdgpu(&c) {
            return Ok(c);
        }
    }
    watch_path_lookup();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(path) = env::var_os("PATH") {
        for name in ["clang++-19", "clang++"] {
            candidates.extend(env::split_paths(&path).map(|d| d.join(name)));
        }
    }
    candidates.push(PathBuf::from("/opt/rocm/llvm/bin/clang++"));
    candidates
        .into_iter()
        .find(|c| c.is_file() && clang_lists_amdgpu(c))
        .ok_or_else(|| "no clang with the AMDGPU target found (install clang-19 and lld-19)".to_string())
}

/// Checks that `path` is a linked AMDGPU code object: 64-bit little-endian ELF, `e_type` ET_DYN
/// (3), `e_machine` EM_AMDGPU (224). A relocatable object (ET_REL) would fail in hipModuleLoadData.
fn check_code_object(path: &Path) -> Result<(), String> {
    let b = fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    if b.len() < 20 || &b[..4] != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return Err(format!("{} is not a 64-bit little-endian ELF file", path.display()));
    }
    let e_type = u16::from_le_bytes([b[16], b[17]]);
    let e_machine = u16::from_le_bytes([b[18], b[19]]);
    if e_machine != 224 {
        return Err(format!("{} is for machine {e_machine}, not AMDGPU (224)", path.display()));
    }
    if e_type != 3 {
        return Err(format!("{} has ELF type {e_type}, not ET_DYN (3): it was not linked", path.display()));
    }
    Ok(())
}

/// Compiles `src` for `arch` into `obj` (cached) and checks the result is a linked code object.
fn hip_compile(clang: &Path, root: &Path, src: &Path, expanded: &str, arch: &str, obj: &Path) -> Result<(), String> {
    let args = hip_clang_args(arch);
    let mut cmd = Command::new(clang);
    cmd.args(&args).arg("-I").arg(root).arg("-c").arg(src).arg("-o").arg(obj);
    let key = fnv1a(&[tool_id(clang).as_bytes(), args.join(" ").as_bytes(), expanded.as_bytes()]);
    cached_compile(cmd, obj, &key)
        .map_err(|e| format!("{} failed on {} for {arch}: {e}", clang.display(), src.display()))?;
    check_code_object(obj)
}

/// Compiles a one-line kernel to see whether `clang` can also link (lld) before trusting it with
/// the real kernels.
fn hip_clang_works(clang: &Path, out: &Path) -> Result<(), String> {
    let src = out.join("trimul_probe.hip");
    let text = "extern \"C\" __attribute__((global)) void trimul_probe(int* p) { *p = 1; }\n";
    fs::write(&src, text).map_err(|e| e.to_string())?;
    hip_compile(clang, out, &src, text, HIP_ARCHS[0], &out.join("trimul_probe.hsaco"))
        .map_err(|e| format!("{} cannot build a HIP code object: {}", clang.display(), first_lines(&e)))
}

fn hip_kernels(out: &Path) {
    let root = manifest_dir();
    let srcs = sources(&root, "hip", "hip", out);
    let built = find_hip_clang().and_then(|clang| {
        println!("cargo:rerun-if-changed={}", clang.display());
        hip_clang_works(&clang, out)?;
        let mut objects: Vec<Vec<(&str, PathBuf)>> = Vec::new();
        for src in &srcs {
            let mut per_arch = Vec::new();
            for arch in HIP_ARCHS {
                let obj = out.join(format!("{}.{arch}.hsaco", src.stem));
                hip_compile(&clang, &root, &src.path, &src.expanded, arch, &obj)?;
                per_arch.push((*arch, obj));
            }
            objects.push(per_arch);
        }
        Ok((clang, objects))
    });
    let (objects, build) = match built {
        Ok((clang, objects)) => {
            // Starts with "clang": src/backend/hip/host_tests.rs tells a build with code objects by it.
            let build = format!(
                "clang ({}) prebuilt code objects for {}; hipRTC compiles at run time for other processors",
                clang.display(),
                HIP_ARCHS.join(", ")
            );
            (Some(objects), build)
        }
        Err(why) => (None, no_prebuilt(out, "TRIMUL_REQUIRE_HIP_CLANG", "HIP", "hipRTC", &why)),
    };
    let mut table = stage_table("HIP", "HIP_STAGES", "EmbeddedHipStage", &srcs, |i| {
        let objs: Vec<String> = objects.as_ref().map_or(vec![], |o| {
            o[i].iter()
                .map(|(arch, obj)| format!("({arch:?}, include_bytes!({:?}))", obj.display().to_string()))
                .collect()
        });
        format!("code_objects: &[{}]", objs.join(", "))
    });
    let archs: Vec<String> =
        if objects.is_some() { HIP_ARCHS.iter().map(|a| format!("{a:?}")).collect() } else { vec![] };
    let _ = writeln!(
        table,
        "/// Processors with prebuilt code objects in this build.\npub const HIP_PREBUILT_ARCHS: &[&str] = &[{}];",
        archs.join(", ")
    );
    let _ = writeln!(
        table,
        "/// How the HIP kernels were built: prebuilt (for which processors), or compiled at run time and why."
    );
    let _ = writeln!(table, "pub const HIP_BUILD: &str = {build:?};");
    fs::write(out.join("hip_kernels.rs"), table).expect("write hip_kernels.rs");
}

// ---------------------------------------------------------------------------------- git commit

/// Stamps the source commit into the crate as `TRIMUL_GIT_COMMIT`, so that a bench JSON names the
/// code that produced it (read back by `trimul::report::git_commit`).
///
/// In order: an explicit `TRIMUL_GIT_COMMIT` in the build environment (builds from a tarball, or
/// CI that knows better); the commit `cargo package` recorded in `.cargo_vcs_info.json` (a crate
/// from a registry, with `-dirty` when it was packaged from a modified tree); this crate's own git
/// repository, only when the crate's directory is that repository's top level, so that a copy
/// vendored inside another repository does not stamp the other repository's commit. Otherwise
/// nothing is set and the crate reports no commit rather than failing to build.
fn git_commit_env() {
    if let Ok(commit) = env::var("TRIMUL_GIT_COMMIT") {
        let commit = commit.trim();
        if !commit.is_empty() {
            println!("cargo:rustc-env=TRIMUL_GIT_COMMIT={commit}");
            return;
        }
    }
    let dir = manifest_dir();

    let vcs_info = dir.join(".cargo_vcs_info.json");
    if vcs_info.is_file() {
        watch(&vcs_info);
        if let Some(commit) = fs::read_to_string(&vcs_info).ok().and_then(|t| packaged_commit(&t)) {
            println!("cargo:rustc-env=TRIMUL_GIT_COMMIT={commit}");
        }
        return;
    }

    let same_dir = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    match git(&dir, &["rev-parse", "--show-toplevel"]) {
        Some(top) if same_dir(Path::new(&top), &dir) => {}
        _ => return,
    }

    // A new commit moves the branch ref, not HEAD (which holds `ref: refs/heads/...`), and a
    // worktree's `.git` is a file pointing elsewhere, so ask git where HEAD and its ref live
    // instead of assuming `.git/HEAD`.
    if let Some(git_dir) = git(&dir, &["rev-parse", "--git-dir"]) {
        watch(&dir.join(git_dir).join("HEAD"));
    }
    if let Some(common) = git(&dir, &["rev-parse", "--git-common-dir"]) {
        let common = dir.join(common);
        watch(&common.join("packed-refs"));
        if let Some(head_ref) = git(&dir, &["symbolic-ref", "-q", "HEAD"]) {
            watch(&common.join(head_ref));
        }
    }

    if let Some(commit) = git(&dir, &["rev-parse", "--short", "HEAD"]) {
        println!("cargo:rustc-env=TRIMUL_GIT_COMMIT={commit}");
    }
}

/// The short commit in `.cargo_vcs_info.json` (`{"git": {"sha1": "…", "dirty": true}, …}`),
/// read without a JSON parser: the build script has no dependencies.
fn packaged_commit(text: &str) -> Option<String> {
    let after = text.split("\"sha1\"").nth(1)?;
    let sha: String = after.split('"').nth(1)?.chars().take_while(char::is_ascii_hexdigit).collect();
    if sha.len() < 7 {
        return None;
    }
    let dirty =
        text.split("\"dirty\"").nth(1).is_some_and(|rest| rest.trim_start_matches([':', ' ']).starts_with("true"));
    Some(format!("{}{}", &sha[..7], if dirty { "-dirty" } else { "" }))
}

/// Output of a git command run in `dir`, trimmed; `None` when git is missing or fails. `GIT_DIR`
/// and `GIT_WORK_TREE` (set inside git hooks) are cleared so that git looks at `dir`.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .env_remove("GIT_INDEX_FILE")
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// Re-run this script when `path` changes; paths that do not exist are skipped because cargo
/// treats them as always changed.
fn watch(path: &Path) {
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}
