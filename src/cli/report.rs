//! `trimul report`: bench JSON files in, `report.md` and SVG plots out (see `trimul::report`).
//! Every input problem (unreadable or truncated file, unknown schema version, bad anchors,
//! a baseline that does not exist) is a one-line error with exit code 2.

use std::process::ExitCode;

use trimul::report::{self, Anchor, BenchRun};

use super::args::ReportArgs;
use super::exit::{CliError, CliResult};
use super::output::emit;

pub fn run(args: &ReportArgs) -> CliResult {
    // Before reading the runs: an --out that is a file or sits in a read-only folder says so first.
    report::check_output_dir(&args.out).map_err(|e| CliError::usage(format!("--out {e}")))?;
    let runs = args.runs.iter().map(BenchRun::from_path).collect::<trimul::Result<Vec<_>>>().map_err(usage)?;
    let anchors = match &args.anchors {
        Some(path) => Anchor::load(path).map_err(usage)?,
        None => Vec::new(),
    };
    // The command line numbers runs from 1, as the report does.
    let baseline = args.baseline.map(|k| k as usize - 1);
    let rendered = report::render(&runs, &anchors, baseline).map_err(usage)?;
    let written = report::write(&rendered, &args.out).map_err(usage)?;
    for path in written {
        emit(&path.display().to_string())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Everything `report` can meet is about its inputs or its output directory.
fn usage(e: trimul::Error) -> CliError {
    CliError::usage(e.to_string())
}
