//! What the commands print and how: result lines and JSON on stdout (with a write that fails
//! or a reader that left turned into the right exit code), progress bars on stderr, and the
//! one-line summaries of a device and of an error.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use trimul::report::fmt_bytes;
use trimul::{BackendKind, DeviceInfo};

use super::exit::{CliError, CliResult, EXIT_BROKEN_PIPE, EXIT_FAILED};

/// Writes one line to stdout. A failed write (`> /dev/full`, a disk that filled) is an error
/// with exit code 1; a closed pipe ends the command quietly with [`EXIT_BROKEN_PIPE`].
pub fn emit(line: &str) -> CliResult<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).map_err(stdout_error)
}

/// The error a failed write to stdout earns: see [`emit`]. An empty message prints nothing.
fn stdout_error(e: std::io::Error) -> CliError {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        CliError { code: EXIT_BROKEN_PIPE, message: String::new() }
    } else {
        CliError { code: EXIT_FAILED, message: format!("cannot write to standard output: {e}") }
    }
}

/// Pretty JSON of `value` on stdout.
pub fn emit_json<T: serde::Serialize>(value: &T) -> CliResult<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| CliError { code: EXIT_FAILED, message: format!("JSON output: {e}") })?;
    emit(&text)
}

/// A progress bar on stderr, hidden when stderr is not a terminal, through which the commands
/// print their results to stdout with the bar lifted out of the way.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar of `len` steps; the message shows what is running now.
    pub fn bar(len: u64) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(len), draw_target());
        if let Ok(style) = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {wide_msg}")
        {
            bar.set_style(style);
        }
        // Steady ticks keep the clock moving through single steps that take seconds (a
        // reference check of a large case, a slow CPU forward).
        bar.enable_steady_tick(Duration::from_millis(200));
        Progress { bar }
    }

    /// A spinner for work of unknown length.
    pub fn spinner() -> Progress {
        let target = draw_target();
        let visible = !target.is_hidden();
        let bar = ProgressBar::with_draw_target(None, target);
        if let Ok(style) = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_msg}") {
            bar.set_style(style);
        }
        // The tick is a thread of its own: none where nothing is drawn, so that a run piped or in
        // CI starts no thread that could first run when the host is out of memory (a thread
        // that cannot set up its signal stack then panics and deadlocks printing why).
        if visible {
            bar.enable_steady_tick(Duration::from_millis(200));
        }
        Progress { bar }
    }

    pub fn set_message(&self, msg: impl Into<String>) {
        self.bar.set_message(msg.into());
    }

    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    pub fn position(&self) -> u64 {
        self.bar.position()
    }

    /// A result line on stdout (see [`emit`] for its errors).
    pub fn out(&self, line: &str) -> CliResult<()> {
        self.bar.suspend(|| emit(line))
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // An early return through `?` must not leave a half-drawn bar above the error line.
        self.bar.finish_and_clear();
    }
}

fn draw_target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

/// `AMD EPYC 7B13, x86_64, 2 threads, 7.8 GiB` or `NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79.1 GiB`.
pub fn device_summary(kind: BackendKind, info: &DeviceInfo) -> String {
    let units = match kind {
        BackendKind::Cpu => "threads",
        BackendKind::Cuda => "SMs",
        BackendKind::Hip => "CUs",
        _ => "compute units",
    };
    let mut parts = vec![info.name.clone()];
    if !info.arch.is_empty() {
        parts.push(info.arch.clone());
    }
    if info.compute_units > 0 {
        parts.push(format!("{} {units}", info.compute_units));
    }
    if info.memory_bytes > 0 {
        parts.push(fmt_bytes(info.memory_bytes));
    }
    parts.join(", ")
}

/// Collapses a message onto one line (errors from files or drivers may carry newlines).
pub(super) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use trimul::report::{fmt_err, json_f64};

    use super::*;

    #[test]
    fn formatting() {
        assert_eq!(one_line("a\n  b\tc "), "a b c");
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
        assert_eq!(fmt_err(0.0), "0");
        assert_eq!(fmt_err(1.234e-4), "1.23e-4");
        assert_eq!(fmt_err(f64::INFINITY), "inf");
        #[derive(serde::Serialize)]
        struct V {
            #[serde(serialize_with = "json_f64")]
            a: f64,
            #[serde(serialize_with = "json_f64")]
            b: f64,
        }
        let s = serde_json::to_string(&V { a: 0.5, b: f64::NAN }).unwrap();
        assert_eq!(s, r#"{"a":0.5,"b":"NaN"}"#);
    }
}
