//! Benchmark reports: the bench JSON schema ([`schema`]), reference timings ([`anchors`]), and
//! `trimul report`'s output: `report.md` ([`markdown`]) and SVG plots ([`plot`]).
//!
//! Everything here is pure data in, text out. The output depends only on the inputs (no clock,
//! no environment, stable ordering, fixed float formatting), so committed JSONs reproduce a
//! committed report byte for byte.
//!
//! Shapes are matched across runs and anchors by [`ShapeResult::key`] (`n{N}_b{B}_c{C}`), in
//! the order they first appear (the first run's order, then shapes only later runs have).
//! Shapes some runs lack are listed in the report, and every geometric mean is taken over the
//! shapes all runs share, saying how many.

pub mod anchors;
pub mod markdown;
pub mod plot;
pub mod schema;

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub use anchors::Anchor;
pub use schema::{
    format_utc, git_commit, json_f64, now_utc, shape_key, BenchRun, Ceilings, MachineInfo, SampleStats, ShapeResult,
    TimingMethod, ToolInfo, SCHEMA_VERSION,
};

/// File name of the markdown part of a report.
pub const REPORT_MD: &str = "report.md";

/// A rendered report: `report.md` and the SVG files it links to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The report in markdown.
    pub markdown: String,
    /// `(file name, SVG document)`, in the order the markdown shows them.
    pub svgs: Vec<(String, String)>,
}

/// Renders runs and anchors into a report. `baseline` is the 0-based index of the run that
/// speedups are measured against (the first when `None`); the report itself numbers runs from 1.
pub fn render(runs: &[BenchRun], anchors: &[Anchor], baseline: Option<usize>) -> Result<Report> {
    let model = Model::new(runs, anchors, baseline)?;
    let svgs = plot::render_all(&model)?;
    let markdown = markdown::render(&model, &svgs);
    Ok(Report { markdown, svgs })
}

/// Writes `report.md` and the SVGs into `out_dir` (created if missing); returns the paths written.
/// Every file is checked before any is written ([`crate::io::check_output`]) and each is written
/// atomically ([`crate::io::write_file`]), so a failure leaves each previous file whole.
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

/// Runs and anchors lined up by shape: what both the markdown and the plots read.
pub(crate) struct Model<'a> {
    pub runs: &'a [BenchRun],
    pub anchors: &'a [Anchor],
    pub baseline: usize,
    /// Every shape key of every run, in first-appearance order.
    pub keys: Vec<String>,
    /// `cells[k][r]`: run `r`'s result for `keys[k]`.
    pub cells: Vec<Vec<Option<&'a ShapeResult>>>,
    /// Indexes into `keys` of the shapes every run has; the geomeans use only these.
    pub common: Vec<usize>,
}

impl<'a> Model<'a> {
    fn new(runs: &'a [BenchRun], anchors: &'a [Anchor], baseline: Option<usize>) -> Result<Model<'a>> {
        if runs.is_empty() {
            return Err(Error::InvalidArgument("no bench runs to report: give at least one bench JSON file".into()));
        }
        let baseline = baseline.unwrap_or(0);
        if baseline >= runs.len() {
            return Err(Error::InvalidArgument(format!(
                "baseline run #{} does not exist: {} run(s) given",
                baseline + 1,
                runs.len()
            )));
        }
        for (i, run) in runs.iter().enumerate() {
            run.validate().map_err(|e| Error::InvalidArgument(format!("run #{}: {}", i + 1, strip_kind(e))))?;
        }
        let mut names = std::collections::BTreeSet::new();
        for a in anchors {
            a.validate()?;
            if !names.insert(a.name.as_str()) {
                return Err(Error::InvalidArgument(format!("two anchors are named {:?}", a.name)));
            }
        }

        let mut keys: Vec<String> = Vec::new();
        for run in runs {
            for s in &run.shapes {
                let k = s.key();
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
        }
        let cells: Vec<Vec<Option<&ShapeResult>>> =
            keys.iter().map(|k| runs.iter().map(|run| run.shapes.iter().find(|s| &s.key() == k)).collect()).collect();
        let common = (0..keys.len()).filter(|&k| cells[k].iter().all(Option::is_some)).collect();
        Ok(Model { runs, anchors, baseline, keys, cells, common })
    }

    /// `#1 cuda` or `#1 <label>`: short enough for a table header.
    pub fn run_name(&self, r: usize) -> String {
        let run = &self.runs[r];
        match &run.label {
            Some(l) if !l.trim().is_empty() => format!("#{} {}", r + 1, l.trim()),
            _ => format!("#{} {}", r + 1, run.backend),
        }
    }

    /// The first result any run has for shape `k` (mask, distribution and H come from it).
    pub fn first(&self, k: usize) -> Option<&'a ShapeResult> {
        self.cells[k].iter().flatten().next().copied()
    }

    /// Geometric mean over the common shapes of `f`, or `None` if any value is missing or not
    /// positive (a geomean over fewer shapes than stated would mislead).
    pub fn common_geomean(&self, f: impl Fn(usize) -> Option<f64>) -> Option<f64> {
        if self.common.is_empty() {
            return None;
        }
        geomean(self.common.iter().map(|&k| f(k)))
    }
}

/// `exp(mean(ln v))`; `None` when empty or when any value is missing, zero, negative or not finite.
pub(crate) fn geomean(values: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let mut sum = 0.0;
    let mut n = 0usize;
    for v in values {
        let v = v?;
        if !(v.is_finite() && v > 0.0) {
            return None;
        }
        sum += v.ln();
        n += 1;
    }
    (n > 0).then(|| (sum / n as f64).exp())
}

/// The message of an error without its variant's prefix, for re-wrapping with more context.
fn strip_kind(e: Error) -> String {
    match e {
        Error::InvalidArgument(m) => m,
        other => other.to_string(),
    }
}

/// Milliseconds with three decimals, the precision of SPEC.md's tables.
pub(crate) fn fmt_ms(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.3}")
    } else {
        "n/a".into()
    }
}

/// A ratio such as a speedup or time/floor, with three significant digits: `2.35×`, `23.5×`,
/// `235×`, `0.0123×` (a CPU run against a GPU baseline lands far below 1).
pub(crate) fn fmt_ratio(v: f64) -> String {
    if !v.is_finite() || v <= 0.0 {
        return "n/a".into();
    }
    let decimals = (2.0 - (v.log10() + 1e-12).floor()).clamp(0.0, 12.0) as usize;
    format!("{v:.decimals$}×")
}

/// Error norms: `5.12e-4`, or `NaN` / `inf` spelled out because that is the finding.
pub fn fmt_err(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        "inf".into()
    } else if v == 0.0 {
        "0".into()
    } else {
        format!("{v:.2e}")
    }
}

/// Bytes in binary units: `512 B`, `79.2 GiB`, `512.0 MiB` (shared by the report and the CLI).
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geomean_refuses_partial_data() {
        assert_eq!(geomean([Some(1.0), Some(4.0)]), Some(2.0));
        assert_eq!(geomean([Some(1.0), None]), None);
        assert_eq!(geomean([Some(1.0), Some(0.0)]), None);
        assert_eq!(geomean(std::iter::empty()), None);
    }

    #[test]
    fn formatting_is_fixed() {
        assert_eq!(fmt_ms(0.0456), "0.046");
        assert_eq!(fmt_ms(f64::NAN), "n/a");
        assert_eq!(fmt_ratio(2.346), "2.35×");
        assert_eq!(fmt_ratio(23.46), "23.5×");
        assert_eq!(fmt_ratio(234.4), "234×");
        assert_eq!(fmt_ratio(0.0), "n/a");
        assert_eq!(fmt_ratio(0.01234), "0.0123×");
        assert_eq!(fmt_ratio(1.0), "1.00×");
        assert_eq!(fmt_err(5.123e-4), "5.12e-4");
        assert_eq!(fmt_err(f64::NAN), "NaN");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(80 * 1024 * 1024 * 1024), "80.0 GiB");
    }
}
