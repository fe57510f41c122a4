//! The `trimul` command line: parses the arguments ([`args`]), runs the command (one module
//! each), and turns its outcome into an exit code. What the commands share lives in siblings of
//! theirs, not here, so that this module only dispatches: the errors and exit codes ([`exit`]),
//! the output helpers ([`output`]) and the seeds ([`seed`]).
//!
//! Conventions: results go to stdout, progress bars and log lines to stderr (bars only when
//! stderr is a terminal); `--json` switches `info` and `check` to one JSON document on stdout.
//! Exit codes: 0 success; 1 a check failed, the device or host memory failed while computing, a
//! `run` whose intermediates overflowed, or a failed write to stdout; 2 a usage or input error (bad
//! arguments, unreadable or inconsistent files, an output that cannot be written, a backend that
//! is not compiled in or cannot be opened); 141 stdout was closed by its reader (`| head`): the
//! command stops quietly. Errors are one line on stderr: `trimul: error: ...`.

mod args;
mod bench;
#[cfg(feature = "cuda")]
mod bench_gpus;
mod check;
mod exit;
mod info;
mod output;
mod report;
mod run;
mod seed;
mod tune;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

use args::{Cli, Command};
use exit::{CliError, EXIT_FAILED};
use output::one_line;

/// Starts rayon's worker threads now, while the process is small. Started lazily, at the first
/// parallel loop, they would be spawned after the inputs are loaded, and under an address-space
/// or memory limit that the inputs nearly fill, rayon panics when it cannot spawn them ("The
/// global thread pool has not been initialized"). If even now they cannot start, the error says
/// so (exit 1) instead.
fn start_worker_threads() -> Result<(), CliError> {
    rayon::ThreadPoolBuilder::new()
        .build_global()
        .or_else(|e| {
            // Already built (a second call), or too many threads for the limit: try one.
            if rayon::current_num_threads() >= 1 && e.to_string().contains("already") {
                return Ok(());
            }
            rayon::ThreadPoolBuilder::new().num_threads(1).build_global()
        })
        .map_err(|e| CliError {
            code: EXIT_FAILED,
            message: format!("cannot start worker threads (memory or thread limit?): {e}"),
        })
}

/// Parses the arguments, runs the command, and turns its outcome into an exit code.
pub fn main() -> ExitCode {
    // clap prints its own usage errors and exits with code 2, which is our usage code too.
    let cli = Cli::parse();
    let outcome = start_worker_threads().and_then(|()| match &cli.command {
        Command::Info(a) => info::run(a),
        Command::Check(a) => check::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Run(a) => run::run(a),
        Command::Report(a) => report::run(a),
        Command::Tune(a) => tune::run(a),
    });
    match outcome {
        Ok(code) => code,
        Err(e) => {
            if !e.message.is_empty() {
                // A closed or full stderr leaves nothing to report the error on; the code still says it.
                let _ = writeln!(std::io::stderr(), "trimul: error: {}", one_line(&e.message));
            }
            ExitCode::from(e.code)
        }
    }
}
