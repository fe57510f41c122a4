//! Benchmark reports: the bench JSON schema ([`schema`]), reference timings ([`anchors`]), and
//! `trimul report`'s output: `report.md` (`markdown`) and SVG plots (`plot`), both rendered from
//! one model of the runs and anchors (`model`) with fixed number formats (`format`).
//!
//! Everything here but [`gpu_probe`] (the clock and power readings `trimul bench` takes) is pure
//! data in, text out. The output depends only on the inputs (no clock,
//! no environment, stable ordering, fixed float formatting), so committed JSONs reproduce a
//! committed report byte for byte.
//!
//! Each suite (`gpumode`, `quick`, `long`: [`BenchRun::suite_name`]) is reported on its own.
//! Within a suite, runs of one configuration whose shapes do not overlap are merged into one
//! column (the long suite's sizes that need in-place mode are run separately), and shapes are
//! matched across columns and anchors by [`ShapeResult::key`] (`n{N}_b{B}_c{C}`), in the order
//! they first appear.
//!
//! Like with like only: a time is compared (a speedup, a ratio to an anchor) only with times of
//! the same formulation and I/O precision (`Class`), and an anchor that names a device only
//! with runs on it; runs and plot legends carry both. Every geometric mean names the shapes it
//! is over.

// `render` and `write` need the `report` feature (plotters; on by default through `cli`); the
// schema, the anchors and the formatting helpers do not. Without it the model the renderers read
// is compiled but unused.
#![cfg_attr(not(feature = "report"), allow(dead_code, unused_imports))]

pub mod anchors;
mod format;
pub mod gpu_probe;
#[cfg(feature = "report")]
pub mod markdown;
mod model;
#[cfg(feature = "report")]
pub mod plot;
pub mod schema;

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub use anchors::Anchor;
pub use format::fmt_err;
// Defined in the foundation (the layer's out-of-memory messages use it too); kept here, where
// the report and the CLI have always found it.
pub use crate::units::fmt_bytes;
pub use schema::{
    format_utc, git_commit, infer_suite, json_f64, now_utc, shape_key, BenchRun, Ceilings, GpuSample, GpuSpan,
    MachineInfo, RunTelemetry, SampleStats, ShapeResult, ShapeTelemetry, TimingMethod, ToolInfo, SCHEMA_VERSION,
};

/// File name of the markdown part of a report.
pub const REPORT_MD: &str = "report.md";

/// A rendered report: `report.md` and the SVG files it links to.
#[cfg(feature = "report")]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The report in markdown.
    pub markdown: String,
    /// `(file name, SVG document)`, in the order the markdown shows them.
    pub svgs: Vec<(String, String)>,
}

/// Renders runs and anchors into a report. `baseline` is the 0-based index of the run that
/// speedups between runs of its suite, formulation and precision are measured against (the
/// first when `None`; other combinations use their first run); the report numbers runs from 1.
#[cfg(feature = "report")]
pub fn render(runs: &[BenchRun], anchors: &[Anchor], baseline: Option<usize>) -> Result<Report> {
    let model = model::Model::new(runs, anchors, baseline)?;
    let plots = plot::render_all(&model)?;
    let markdown = markdown::render(&model, &plots);
    Ok(Report { markdown, svgs: plots.into_iter().map(|p| (p.name, p.svg)).collect() })
}

/// Writes `report.md` and the SVGs into `out_dir` (created if missing); returns the paths written.
/// Every file is checked before any is written ([`crate::io::check_output`]) and each is written
/// atomically ([`crate::io::write_file`]), so a failure leaves each previous file whole.
#[cfg(feature = "report")]
pub fn write(report: &Report, out_dir: impl AsRef<Path>) -> Result<Vec<PathBuf>> {
    let dir = out_dir.as_ref();
    check_output_dir(dir)?;
    let file_err = |p: &Path, e: std::io::Error| Error::File { path: p.display().to_string(), reason: e.to_string() };
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir, e))?;
    let mut files: Vec<(PathBuf, &str)> = vec![(dir.join(REPORT_MD), &report.markdown)];
    files.extend(report.svgs.iter().map(|(name, svg)| (dir.join(name), svg.as_str())));
    for (path, _) in &files {
        crate::io::check_output(path)?;
    }
    for (path, text) in &files {
        crate::io::write_file(path, text.as_bytes())?;
    }
    Ok(files.into_iter().map(|(p, _)| p).collect())
}

/// Checks, before rendering, that a report can go to `out_dir`: it is a directory, or one can
/// be created there, and files can be created in it.
pub fn check_output_dir(out_dir: impl AsRef<Path>) -> Result<()> {
    crate::io::check_output_dir(out_dir)
}
