use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    git_commit_env();
}

/// Stamps the source commit into the crate as `TRIMUL_GIT_COMMIT`, so that a bench JSON names the
/// code that produced it (read back by `trimul::report::git_commit`).
///
/// An explicit `TRIMUL_GIT_COMMIT` in the build environment wins (builds from a tarball, or CI
/// that knows better). Outside a git checkout, or without `git`, nothing is set and the crate
/// reports no commit rather than failing to build.
fn git_commit_env() {
    println!("cargo:rerun-if-env-changed=TRIMUL_GIT_COMMIT");
    // Watching at least one existing file keeps cargo from re-running this script (and so
    // recompiling the crate) on every build: with no rerun-if line it reruns on any change in
    // the package, and with a rerun-if on a missing path it reruns always.
    println!("cargo:rerun-if-changed=build.rs");

    if let Ok(commit) = std::env::var("TRIMUL_GIT_COMMIT") {
        let commit = commit.trim();
        if !commit.is_empty() {
            println!("cargo:rustc-env=TRIMUL_GIT_COMMIT={commit}");
            return;
        }
    }

    let dir = match std::env::var_os("CARGO_MANIFEST_DIR") {
        Some(d) => PathBuf::from(d),
        None => return,
    };

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

/// Output of a git command run in `dir`, trimmed; `None` when git is missing or fails.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).current_dir(dir).output().ok()?;
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
