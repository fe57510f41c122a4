//! Running the `trimul` binary from tests: its output, temporary directories, and the one-line
//! error contract. Shared by tests/cli.rs, tests/cli_reliability.rs and tests/report.rs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The built binary, with any backend override from the caller's environment removed.
pub fn trimul(args: &[&str]) -> Output {
    command(args).output().expect("the trimul binary runs")
}

/// The command [`trimul`] runs, to adjust before running.
pub fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_trimul"));
    c.args(args).env_remove("TRIMUL_BACKEND");
    c
}

/// `trimul bench` of the quick suite on the CPU without warm-up calls, with `args` added, writing
/// its JSON run to `json`.
pub fn cpu_quick_bench(json: &Path, args: &[&str]) -> Output {
    let mut all = vec!["bench", "--backend", "cpu", "--suite", "quick", "--warmup", "0", "--json", s(json)];
    all.extend_from_slice(args);
    trimul(&all)
}

/// The binary run by `bash` after `setup` (e.g. `ulimit -v 150000`), which applies to it.
pub fn trimul_after(setup: &str, args: &[&str]) -> Output {
    Command::new("bash")
        .arg("-c")
        .arg(format!("{setup}\nexec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_trimul"))
        .args(args)
        .env_remove("TRIMUL_BACKEND")
        .output()
        .expect("bash runs")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let dir = std::env::temp_dir().join(format!("trimul-cli-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }

    /// Names of the files in the directory, sorted (to see leftovers such as temporary files).
    pub fn listing(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Tests make files read-only; make them removable again.
        let _ = Command::new("chmod").arg("-R").arg("u+w").arg(&self.0).output();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

/// Exit code `code` and exactly one line on stderr, in the `trimul: error: ...` form.
pub fn assert_error(o: &Output, code: i32, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(code), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line expected, got: {err:?}");
    assert!(err.starts_with("trimul: error: "), "{err}");
    assert!(err.contains(needle), "{err:?} should mention {needle:?}");
}

/// Exit code 2 and exactly one line on stderr, in the `trimul: error: ...` form.
pub fn assert_usage_error(o: &Output, needle: &str) {
    assert_error(o, 2, needle);
}
