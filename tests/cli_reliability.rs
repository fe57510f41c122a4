//! Regression tests for issue 25 (a hostile review of the command line): unbounded reads, outputs
//! checked too late or written non-atomically, ignored stdout errors, host out-of-memory aborts,
//! silent non-finite output and misleading messages. Each test's doc says what the code before
//! the fix did. Library-level cases (symbolic links, file modes) are in tests/io.rs.

#![cfg(unix)]

use std::path::Path;
use std::process::Command;

use trimul::{io, Config, Formulation, NamingScheme, PairInput, Weights};

#[path = "support/cli.rs"]
mod support;
use support::{assert_error, assert_usage_error, command, s, stderr, stdout, trimul, trimul_after, TempDir};
#[path = "support/safetensors_bytes.rs"]
mod safetensors_bytes;
use safetensors_bytes::with_tensor_named_twice;

/// Weights (C = `c`, H = 8, gpumode) and an input of `n` (B = 1, masked) in `dir`.
fn fixtures(dir: &TempDir, n: usize, c: usize) -> (String, String) {
    let w = dir.path("w.safetensors");
    Weights::random(Config::new(Formulation::GpuMode, c, 8).unwrap(), false, 1)
        .unwrap()
        .to_safetensors(&w, NamingScheme::GpuMode)
        .unwrap();
    let x = dir.path("x.safetensors");
    let mut rng = trimul::rand::Rng::new(2);
    let input = PairInput::new(rng.normal_vec(n * n * c, 1.0), Some(rng.mask_vec(n * n)), 1, n, c).unwrap();
    io::write_input(&x, &input).unwrap();
    (s(&w).to_string(), s(&x).to_string())
}

/// An address-space limit in KiB for `ulimit -v`: far below what reading /dev/zero or a
/// multi-gigabyte file whole would need, far above what the bounded reads need.
const LIMIT_2G: &str = "ulimit -v 2000000";

/// Reads are bounded by their format. Before: `--weights /dev/zero` went through `fs::read` and
/// `report` inputs and `--anchors` through `read_to_string`, which read until memory ran out
/// (without a limit, until the OOM killer; under this 2 GB address-space limit they stopped at
/// "/dev/zero: cannot read: out of memory"); an 8 GiB (sparse) bench JSON was read whole the same
/// way; `--input /dev/zero` was opened and read as a file.
#[test]
fn reads_are_bounded() {
    let dir = TempDir::new("bounded");
    let (w, x) = fixtures(&dir, 4, 16);
    let y = dir.path("y.safetensors");
    let out = dir.path("report");

    let o = trimul_after(LIMIT_2G, &["run", "--weights", "/dev/zero", "--input", &x, "--output", s(&y)]);
    assert_usage_error(&o, "is a character device, not a regular file");
    let o = trimul_after(LIMIT_2G, &["run", "--weights", &w, "--input", "/dev/zero", "--output", s(&y)]);
    assert_usage_error(&o, "is a character device, not a regular file");

    let o = trimul_after(LIMIT_2G, &["report", "/dev/zero", "--out", s(&out)]);
    assert_usage_error(&o, "more than any bench JSON file");
    let good = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/synthetic-cpu.json");
    let o = trimul_after(LIMIT_2G, &["report", s(&good), "--anchors", "/dev/zero", "--out", s(&out)]);
    assert_usage_error(&o, "more than any anchors JSON file");

    let huge = dir.path("huge.json");
    std::fs::File::create(&huge).unwrap().set_len(8 << 30).unwrap();
    let o = trimul_after(LIMIT_2G, &["report", s(&huge), "--out", s(&out)]);
    assert_usage_error(&o, "is 8589934592 bytes, larger than any bench JSON file");
    assert!(!out.join("report.md").exists());
}

/// A layer taken out of a checkpoint reads only its own tensors. Before: the whole file was read
/// with `fs::read`, so a checkpoint holding a 16 GiB tensor beside the layer failed under this
/// 2 GB limit ("ckpt.safetensors: cannot read: out of memory") and, without one, needed 16 GiB.
#[test]
fn a_layer_is_read_out_of_a_checkpoint_larger_than_memory() {
    let dir = TempDir::new("checkpoint");
    let (w, x) = fixtures(&dir, 4, 16);
    let layer = std::fs::read(&w).unwrap();
    let st = safetensors::SafeTensors::deserialize(&layer).unwrap();
    // The layer's tensors under `trunk.0.`, then a 16 GiB tensor whose bytes are a hole.
    let mut infos: Vec<(String, safetensors::tensor::TensorInfo)> = Vec::new();
    let mut data = Vec::new();
    let mut named: Vec<_> = st.tensors();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, view) in &named {
        let start = data.len();
        data.extend_from_slice(view.data());
        infos.push((
            format!("trunk.0.{name}"),
            safetensors::tensor::TensorInfo {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                data_offsets: (start, data.len()),
            },
        ));
    }
    let big = 1usize << 32; // f32 values: 16 GiB
    infos.push((
        "trunk.1.embedding".into(),
        safetensors::tensor::TensorInfo {
            dtype: safetensors::Dtype::F32,
            shape: vec![big],
            data_offsets: (data.len(), data.len() + 4 * big),
        },
    ));
    let meta = safetensors::tensor::Metadata::new(None, infos).unwrap();
    let mut header = serde_json::to_vec(&meta).unwrap();
    header.resize(header.len().next_multiple_of(8), b' ');
    let ckpt = dir.path("ckpt.safetensors");
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(&data);
    std::fs::write(&ckpt, &bytes).unwrap();
    std::fs::OpenOptions::new().write(true).open(&ckpt).unwrap().set_len((bytes.len() + 4 * big) as u64).unwrap();

    let y = dir.path("y.safetensors");
    let o = trimul_after(
        LIMIT_2G,
        &["run", "--backend", "cpu", "--weights", s(&ckpt), "--prefix", "trunk.0", "--input", &x, "--output", s(&y)],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(io::read_output(&y).is_ok());
}

/// Outputs are checked before the work. Before: only "the folder exists and the path is not a
/// folder" was checked, so a folder nothing can be created in (/proc), a trailing '/', a link
/// into a missing folder and a write-protected file all passed, the whole benchmark ran, and the
/// write failed (or, for the read-only file, replaced it) at the end.
#[test]
fn outputs_that_cannot_be_written_fail_before_the_work() {
    let dir = TempDir::new("early");
    let bench = |json: &str| trimul(&["bench", "--backend", "cpu", "--n", "256", "--repeats", "1", "--json", json]);
    for (json, needle) in [
        ("/proc/trimul-bench.json", "cannot create a file in /proc"),
        (&format!("{}/", s(&dir.path("new"))), "ends in '/'"),
    ] {
        let o = bench(json);
        assert_usage_error(&o, needle);
        assert!(stdout(&o).is_empty(), "{json}: refused before measuring: {}", stdout(&o));
    }
    let link = dir.path("dangling.json");
    std::os::unix::fs::symlink(dir.path("missing-dir/run.json"), &link).unwrap();
    let o = bench(s(&link));
    assert_usage_error(&o, "whose directory");
    assert!(stdout(&o).is_empty());

    let ro = dir.path("read-only.json");
    std::fs::write(&ro, "previous").unwrap();
    set_mode(&ro, 0o444);
    let o = bench(s(&ro));
    assert_usage_error(&o, "write-protected (mode 0444)");
    assert!(stdout(&o).is_empty());
    assert_eq!(std::fs::read_to_string(&ro).unwrap(), "previous");

    let (w, x) = fixtures(&dir, 4, 16);
    let o = trimul(&["run", "--weights", &w, "--input", &x, "--output", s(&ro)]);
    assert_usage_error(&o, "write-protected");
    let o = trimul(&["report", "/nonexistent.json", "--out", "/proc/trimul-report"]);
    assert_usage_error(&o, "cannot create a file in /proc");
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A write that fails at the end (here: the file-size limit, standing in for a full disk) leaves
/// the previous file whole. Before: `bench --json` and `report` used `fs::write`, which truncates
/// first, so the previous JSON or report was destroyed and a cut-off one left in its place.
#[test]
fn json_and_report_outputs_are_replaced_atomically() {
    let dir = TempDir::new("atomic");
    let json = dir.path("run.json");
    let previous = "{\"previous\": true}\n";
    std::fs::write(&json, previous).unwrap();
    // SIGXFSZ ignored, so an oversized write fails with EFBIG instead of killing the process.
    let limit = "trap '' XFSZ; ulimit -f 1";
    let o = trimul_after(
        limit,
        &["bench", "--backend", "cpu", "--n", "256", "--repeats", "1", "--warmup", "0", "--json", s(&json)],
    );
    assert_ne!(o.status.code(), Some(0), "the 1 KiB file-size limit must stop the write");
    assert!(stderr(&o).contains("File too large") && stderr(&o).contains("unchanged"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&json).unwrap(), previous);
    assert_eq!(dir.listing(), ["run.json"], "no temporary file left behind");

    let good = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/synthetic-cpu.json");
    let out = dir.path("report");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("report.md"), "previous report").unwrap();
    let o = trimul_after(limit, &["report", s(&good), "--out", s(&out)]);
    assert_usage_error(&o, "File too large");
    assert_eq!(std::fs::read_to_string(out.join("report.md")).unwrap(), "previous report");
}

/// Standard output errors. Before: `emit` dropped every error, so `trimul info --json >
/// /dev/full` and `check --json > /dev/full` exited 0 having written nothing; a closed pipe was
/// ignored the same way (and `tune`'s `println!` panicked on it).
#[test]
fn stdout_write_errors_are_reported() {
    let full = || std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    for args in [&["info", "--json"][..], &["info"], &["check", "--backend", "cpu", "--suite", "quick", "--json"]] {
        let o = command(args).stdout(full()).output().unwrap();
        assert_error(&o, 1, "cannot write to standard output: No space left on device");
    }
    // A reader that is gone before anything is written: the pipe's read end closes at once, the
    // writer starts later. Ends quietly with 141, as a process killed by SIGPIPE reports.
    let o = Command::new("bash")
        .arg("-c")
        .arg("(sleep 0.3; exec \"$0\" info; ) | (exec 0<&-; sleep 1); echo \"status ${PIPESTATUS[0]}\" >&2")
        .arg(env!("CARGO_BIN_EXE_trimul"))
        .env_remove("TRIMUL_BACKEND")
        .output()
        .unwrap();
    assert_eq!(stderr(&o).trim(), "status 141", "quiet, exit 141: {}", stderr(&o));
}

/// Host memory limits. Before: under a 150 MB address-space limit `trimul run` aborted with
/// "memory allocation of 75497472 bytes failed" (SIGABRT, 134 in a shell) when allocating y with
/// `vec!`, and
/// out-of-memory errors counted MemAvailable only ("24039206912 bytes available" under a
/// 250 MB limit).
#[test]
fn host_memory_limits_give_errors_not_aborts() {
    let dir = TempDir::new("hostmem");
    let (w, x) = fixtures(&dir, 384, 128);
    let y = dir.path("y.safetensors");
    for limit_kib in [150_000u64, 250_000] {
        let o = trimul_after(
            &format!("ulimit -v {limit_kib}"),
            &["run", "--backend", "cpu", "--weights", &w, "--input", &x, "--output", s(&y)],
        );
        let err = stderr(&o);
        assert_error(&o, 1, "out of memory on cpu");
        let available = bytes_available(&err);
        assert!(available < limit_kib * 1024, "{available} bytes available under a {limit_kib} KiB limit: {err}");
        assert!(!y.exists());
    }
}

/// Non-finite outputs. Before: NaN in x gave a y a quarter NaN without a word, and weights large
/// enough to overflow the intermediates gave an all-NaN y, written and reported as success.
#[test]
fn non_finite_outputs_are_reported_or_refused() {
    let dir = TempDir::new("nonfinite");
    let (n, c) = (6, 16);
    let (w, _) = fixtures(&dir, n, c);
    let mut xv = trimul::rand::Rng::new(5).normal_vec(n * n * c, 1.0);
    xv[(2 * n + 3) * c] = f32::NAN; // x[0, 2, 3, 0]
    let nan_x = dir.path("nan-x.safetensors");
    io::write_input(&nan_x, &PairInput::new(xv, None, 1, n, c).unwrap()).unwrap();
    let y = dir.path("y.safetensors");
    let o = trimul(&["run", "--backend", "cpu", "--weights", &w, "--input", s(&nan_x), "--output", s(&y)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (yv, _) = io::read_output(&y).unwrap();
    let nan = yv.iter().filter(|v| v.is_nan()).count();
    assert!(nan > 0);
    assert!(
        stderr(&o).contains(&format!("warning: y has {nan} non-finite values ({nan} NaN, 0 infinite)")),
        "{}",
        stderr(&o)
    );

    // Weights 1e19 times their trained size overflow even f32: refused, nothing written.
    let big = dir.path("big.safetensors");
    let mut weights = Weights::random(Config::new(Formulation::GpuMode, c, 8).unwrap(), false, 1).unwrap();
    for lin in [&mut weights.left_proj, &mut weights.right_proj] {
        lin.weight.iter_mut().for_each(|v| *v *= 1e19);
    }
    weights.to_safetensors(&big, NamingScheme::GpuMode).unwrap();
    let x = dir.path("x.safetensors");
    let y2 = dir.path("y2.safetensors");
    let o = trimul(&["run", "--backend", "cpu", "--weights", s(&big), "--input", s(&x), "--output", s(&y2)]);
    assert_error(&o, 1, "although x is finite");
    assert!(stderr(&o).contains("f32 intermediates"), "{}", stderr(&o));
    assert!(!y2.exists(), "an overflowed y is not written");
}

/// Messages name the real problem. Before: a directory as --input said "4096 bytes is too
/// short", a pipe said "truncated or corrupt", a duplicated tensor name said "truncated",
/// `report --out` at a file said "File exists (os error 17)", a --max-memory no plan fits
/// exited 1 as if the device had failed, and a TRIMUL_BACKEND that is not UTF-8 was ignored.
#[test]
fn messages_name_the_real_problem() {
    let dir = TempDir::new("messages");
    let (w, x) = fixtures(&dir, 4, 16);
    let y = dir.path("y.safetensors");
    let run = |input: &str| trimul(&["run", "--backend", "cpu", "--weights", &w, "--input", input, "--output", s(&y)]);

    assert_usage_error(&run(s(&dir.0)), "is a directory, not a regular file");

    let fifo = dir.path("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    // A writer that would block forever if the reader never opened the pipe: none should open it.
    assert_usage_error(&run(s(&fifo)), "is a named pipe (FIFO), not a regular file");

    // `x` named twice in the header.
    let dup_path = dir.path("dup.safetensors");
    std::fs::write(&dup_path, with_tensor_named_twice(&std::fs::read(&x).unwrap(), "x")).unwrap();
    assert_usage_error(&run(s(&dup_path)), "names tensor `x` twice");

    let good = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/synthetic-cpu.json");
    let file = dir.path("a-file");
    std::fs::write(&file, "").unwrap();
    assert_usage_error(&trimul(&["report", s(&good), "--out", s(&file)]), "is a regular file, not a directory");

    let o =
        trimul(&["run", "--backend", "cpu", "--weights", &w, "--input", &x, "--output", s(&y), "--max-memory", "1000"]);
    assert_usage_error(&o, "--max-memory 1000");
    assert!(!y.exists());

    use std::os::unix::ffi::OsStrExt;
    let o = command(&["check", "--suite", "quick"])
        .env("TRIMUL_BACKEND", std::ffi::OsStr::from_bytes(b"cp\xffu"))
        .output()
        .unwrap();
    assert_usage_error(&o, "is not valid UTF-8");
    let o = command(&["info"]).env("TRIMUL_BACKEND", std::ffi::OsStr::from_bytes(b"\xff")).output().unwrap();
    assert!(stdout(&o).contains("is not valid UTF-8"), "{}", stdout(&o));
}

/// Another user's file is not taken over. Before: a user who could write in the folder replaced
/// root's file by rename, and the output came out owned by that user (as root, run here as uid
/// 65534 through setpriv; skipped visibly where that is not possible).
#[test]
fn another_users_file_is_refused() {
    use std::os::unix::fs::MetadataExt;
    let dir = TempDir::new("owner");
    let (w, x) = fixtures(&dir, 4, 16);
    let shared = dir.path("shared");
    std::fs::create_dir(&shared).unwrap();
    set_mode(&shared, 0o777);
    set_mode(&dir.0, 0o755);
    let out = shared.join("y.safetensors");
    std::fs::write(&out, "root's").unwrap();
    set_mode(&out, 0o666);
    let owner = std::fs::metadata(&out).unwrap().uid();
    let setpriv = Command::new("setpriv").arg("--version").output().is_ok_and(|o| o.status.success());
    if owner != 0 || !setpriv {
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"SKIPPED: another_users_file_is_refused needs root and setpriv to run trimul as another user\n",
        );
        return;
    }
    let o = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_trimul"))
        .args(["run", "--backend", "cpu", "--weights", &w, "--input", &x, "--output", s(&out)])
        .env_remove("TRIMUL_BACKEND")
        .output()
        .unwrap();
    assert_usage_error(&o, "is owned by uid 0");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "root's");
    assert_eq!(std::fs::metadata(&out).unwrap().uid(), 0);
}

/// `--output /dev/stdout` into a pipe is written into the pipe. Before: the path's links were
/// followed by hand to /proc/self/fd/1's target "pipe:[…]", which is no path, so the write tried
/// to create a temporary file in /proc/self/fd and failed after the forward ("cannot write: No
/// such file or directory").
#[test]
fn output_to_dev_stdout_goes_into_the_pipe() {
    let dir = TempDir::new("stdout");
    let (w, x) = fixtures(&dir, 4, 16);
    let o = trimul(&["run", "--backend", "cpu", "--weights", &w, "--input", &x, "--output", "/dev/stdout"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let st = safetensors::SafeTensors::deserialize(&o.stdout).expect("stdout holds the safetensors file");
    assert_eq!(st.tensor("y").unwrap().shape(), &[1, 4, 4, 16]);
}

/// A memory cgroup (v1 `memory.limit_in_bytes`, v2 `memory.max`) made for one child process, or
/// `None` where this process may not make one (not root, no writable memory controller).
fn memory_cgroup(limit: u64) -> Option<std::path::PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let name = format!("trimul-test-{}", std::process::id());
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let (dir, file) = if id == "0" && controllers.is_empty() {
            (Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/')), "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/')), "memory.limit_in_bytes")
        } else {
            continue;
        };
        let cg = dir.join(&name);
        if std::fs::create_dir(&cg).is_ok() {
            if std::fs::write(cg.join(file), limit.to_string()).is_ok() {
                return Some(cg);
            }
            let _ = std::fs::remove_dir(&cg);
        }
    }
    None
}

/// A cgroup memory limit. Before: budgets and allocations knew only MemAvailable, so under a
/// 120 MB cgroup y's 72 MiB were allocated (address space, which the cgroup does not count) and
/// the kernel's OOM killer ended the process when the pages were written (SIGKILL, no message).
/// Skipped, visibly, where no memory cgroup can be made.
#[test]
fn cgroup_memory_limits_give_errors_not_kills() {
    let dir = TempDir::new("cgroup");
    let (w, x) = fixtures(&dir, 384, 128);
    let limit = 120u64 << 20;
    let Some(cg) = memory_cgroup(limit) else {
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"SKIPPED: cgroup_memory_limits_give_errors_not_kills cannot make a memory cgroup here\n",
        );
        return;
    };
    let y = dir.path("y.safetensors");
    let o = trimul_after(
        &format!("echo $$ > {}/cgroup.procs", s(&cg)),
        &["run", "--backend", "cpu", "--weights", &w, "--input", &x, "--output", s(&y)],
    );
    let _ = std::fs::remove_dir(&cg);
    let err = stderr(&o);
    assert_error(&o, 1, "out of memory on cpu");
    let available = bytes_available(&err);
    assert!(available < limit, "{available} bytes available under a {limit}-byte cgroup: {err}");
}

/// The `N` of "N bytes available" in an out-of-memory message.
fn bytes_available(err: &str) -> u64 {
    err.split(" bytes available")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no available bytes in {err}"))
}
