//! `report.md`: who ran what (and what each run's floor means), the anchors, then one section
//! per suite with one table per question: how fast (a table per formulation and I/O precision,
//! with the anchors of that kind), how it compares with like anchors and like runs, how close
//! to the floor, how noisy, how correct, how much memory, at what clocks and power; then which
//! shapes did not line up, then the suite's plots.

use std::fmt::Write as _;

use super::format::{fmt_err, fmt_ms, fmt_ratio};
use super::model::{geomean, Against, Model, Suite};
use super::plot::Plot;
use super::schema::{BenchRun, ShapeResult, ShapeTelemetry};
use crate::units::fmt_bytes;

/// Column alignment in a markdown table.
#[derive(Copy, Clone)]
enum Align {
    Left,
    Right,
}

/// A markdown table built row by row; cells are escaped when added.
struct Table {
    header: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new() -> Table {
        Table { header: Vec::new(), rows: Vec::new() }
    }

    fn col(&mut self, name: impl AsRef<str>, align: Align) -> &mut Table {
        self.header.push((escape(name.as_ref()), align));
        self
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn write(&self, out: &mut String) {
        let line = |cells: &mut dyn Iterator<Item = &str>| {
            let mut s = String::from("|");
            for c in cells {
                s.push(' ');
                s.push_str(c);
                s.push_str(" |");
            }
            s.push('\n');
            s
        };
        out.push_str(&line(&mut self.header.iter().map(|(h, _)| h.as_str())));
        out.push('|');
        for (_, a) in &self.header {
            out.push_str(match a {
                Align::Left => "---|",
                Align::Right => "---:|",
            });
        }
        out.push('\n');
        for r in &self.rows {
            // Short rows are padded so a malformed row cannot shift later columns.
            let mut cells: Vec<&str> = r.iter().map(String::as_str).collect();
            cells.resize(self.header.len(), "");
            out.push_str(&line(&mut cells.into_iter()));
        }
        out.push('\n');
    }
}

/// Makes user text (device names, labels, anchor names) safe inside a table cell.
fn escape(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// Inline code, safe in a table cell or a heading (user text: suite names).
fn code(s: &str) -> String {
    format!("`{}`", escape(&s.replace('`', "'")))
}

/// The whole `report.md`. `plots` are the SVG files written beside it.
pub(crate) fn render(m: &Model<'_>, plots: &[Plot]) -> String {
    let mut out = String::new();
    header(m, &mut out);
    runs(m, &mut out);
    anchors(m, &mut out);
    for (i, suite) in m.suites.iter().enumerate() {
        let mine: Vec<&Plot> = plots.iter().filter(|p| p.suite == i).collect();
        suite_section(m, suite, &mine, &mut out);
    }
    // One trailing newline exactly, whatever the last section wrote.
    while out.ends_with("\n\n") {
        out.pop();
    }
    out
}

/// A section's heading (`## …` or `### …`) and its opening paragraph, each closed by a blank line.
fn section(out: &mut String, heading: &str, intro: &str) {
    let _ = writeln!(out, "{heading}\n\n{intro}\n");
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// `#1, #2 and #3`.
fn and_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

fn run_nums(rs: &[usize]) -> String {
    and_list(&rs.iter().map(|r| format!("#{}", r + 1)).collect::<Vec<_>>())
}

fn header(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "# TriMul benchmark report\n");
    let suites: Vec<String> =
        m.suites.iter().map(|s| format!("{} ({})", code(&s.name), plural(s.runs.len(), "run", "runs"))).collect();
    let _ = writeln!(
        out,
        "{} in {}: {}; {}. Times are medians in milliseconds; lower is better.\n",
        plural(m.runs.len(), "run", "runs"),
        plural(m.suites.len(), "suite", "suites"),
        suites.join(", "),
        plural(m.anchors.len(), "anchor", "anchors"),
    );
    let _ = write!(
        out,
        "Each suite is reported on its own. A time is compared (a speedup, a ratio to an anchor) only with \
         times of the same formulation and I/O precision, the element type of x and y, and an anchor that \
         names its device only with runs on that device: every run and anchor is labelled with both \
         (`gpumode f32-io`). Every geometric mean names the shapes it is over."
    );
    let between = m.suites.iter().any(|s| s.classes().iter().any(|c| s.class_columns(c).len() > 1));
    if between {
        let _ = write!(
            out,
            " Speedups between runs are taken against {} within its suite, formulation and precision, and \
             against the first run of every other combination.",
            escape(&m.run_name(m.baseline))
        );
    }
    let _ = writeln!(out, "\n");
}

fn commit(run: &BenchRun) -> String {
    run.tool.git_commit.as_deref().map(code).unwrap_or_else(|| "unknown".into())
}

/// Why a run has no clock and power readings; `None` when it has them.
fn probe_missing(run: &BenchRun) -> Option<String> {
    match &run.telemetry {
        None => Some("written before bench recorded clocks and power".into()),
        Some(t) if t.available => None,
        Some(t) => {
            let reason = t.reason.as_deref().unwrap_or("no probe");
            Some(if t.source == "none" || reason.contains(t.source.as_str()) {
                reason.to_string()
            } else {
                format!("{reason} ({})", t.source)
            })
        }
    }
}

/// How a run's clocks and power were recorded, for the software list.
fn probe_text(run: &BenchRun) -> String {
    match (&run.telemetry, probe_missing(run)) {
        (_, Some(why)) => format!("clocks and power not read: {why}"),
        (Some(t), None) => {
            let mut s = format!("clocks and power read by {}", t.source);
            if let Some(ms) = t.interval_ms {
                let _ = write!(s, " (every {ms} ms during the timed calls)");
            }
            if let Some(d) = &t.driver_version {
                let _ = write!(s, ", driver {d}");
            }
            if let Some(g) = &t.gpu {
                let _ = write!(s, ", {g}");
            }
            s
        }
        (None, None) => String::new(),
    }
}

fn runs(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "## Runs\n");
    let mut t = Table::new();
    t.col("run", Align::Left)
        .col("suite", Align::Left)
        .col("device", Align::Left)
        .col("arch", Align::Left)
        .col("compute units", Align::Right)
        .col("memory", Align::Right)
        .col("backend", Align::Left)
        .col("formulation", Align::Left)
        .col("I/O precision", Align::Left)
        .col("date (UTC)", Align::Left)
        .col("tool", Align::Left)
        .col("commit", Align::Left)
        .col("seed", Align::Right);
    for (r, run) in m.runs.iter().enumerate() {
        let mc = &run.machine;
        let device =
            if mc.device.starts_with(&mc.vendor) { mc.device.clone() } else { format!("{} {}", mc.vendor, mc.device) };
        let (suite, inferred) = run.suite_name();
        t.row(vec![
            escape(&m.run_name(r)),
            if inferred { format!("{} (inferred)", code(&suite)) } else { code(&suite) },
            escape(device.trim()),
            escape(&mc.arch),
            mc.compute_units.to_string(),
            fmt_bytes(mc.memory_bytes),
            escape(&run.backend),
            escape(&run.formulation),
            escape(&run.precision),
            escape(run.date()),
            escape(&format!("{} {}", run.tool.name, run.tool.version)),
            commit(run),
            run.seed.map_or_else(|| "not recorded".into(), |s| s.to_string()),
        ]);
    }
    t.write(out);

    let mut t = Table::new();
    t.col("run", Align::Left)
        .col("timing", Align::Left)
        .col("GEMM ceiling", Align::Left)
        .col("copy ceiling", Align::Left);
    for (r, run) in m.runs.iter().enumerate() {
        let tm = &run.timing;
        let weights = if tm.fresh_weights { "weights re-prepared in every call" } else { "weights prepared once" };
        let c = &run.ceilings;
        let gemm = if c.gemm_tflops > 0.0 && c.gemm_tflops.is_finite() {
            format!("{:.1} TFLOP/s ({})", c.gemm_tflops, escape(&c.gemm_desc))
        } else {
            "not measured".into()
        };
        let copy = if c.copy_gbs > 0.0 && c.copy_gbs.is_finite() {
            format!("{:.0} GB/s", c.copy_gbs)
        } else {
            "not measured".into()
        };
        t.row(vec![
            escape(&m.run_name(r)),
            escape(&format!(
                "{} warm-up, {} timed, {}, {} clock, {weights}",
                tm.warmup,
                tm.repeats,
                plural(tm.buffer_sets as usize, "buffer set", "buffer sets"),
                tm.clock
            )),
            gemm,
            copy,
        ]);
    }
    t.write(out);
    floors_meaning(m, out);

    // Runs with the same software share a line: the version strings can be long.
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (r, run) in m.runs.iter().enumerate() {
        let mut parts: Vec<String> = run.machine.versions.iter().map(|(k, v)| format!("{k} {v}")).collect();
        if let Some(h) = &run.machine.host {
            parts.push(format!("host {h}"));
        }
        parts.push(probe_text(run));
        let text = escape(&parts.join(" · "));
        match groups.iter_mut().find(|(t, _)| *t == text) {
            Some((_, rs)) => rs.push(r),
            None => groups.push((text, vec![r])),
        }
    }
    let lines: Vec<String> = groups.iter().map(|(text, rs)| format!("- {}: {text}", run_nums(rs))).collect();
    let _ = writeln!(out, "Software, driver and clock probe:\n\n{}\n", lines.join("\n"));
}

fn is_cpu(run: &BenchRun) -> bool {
    run.backend.trim().eq_ignore_ascii_case("cpu")
}

/// What a floor is on each kind of device; the CPU's says that it is no independent bound.
fn floors_meaning(m: &Model<'_>, out: &mut String) {
    let cpu: Vec<usize> = (0..m.runs.len()).filter(|&r| is_cpu(&m.runs[r])).collect();
    let _ = write!(
        out,
        "**What the floors mean.** A shape's floor is max(FLOPs / GEMM ceiling, bytes of x and y at the run's I/O \
         precision, and the mask, / copy ceiling), from the ceilings its own run measured."
    );
    if cpu.len() < m.runs.len() {
        let _ = write!(
            out,
            " On a GPU the GEMM ceiling is a large GEMM of the vendor library (cuBLASLt, rocBLAS) in the \
             contraction's element type, timed in the same process: what the device sustains, not its \
             datasheet peak; the copy ceiling is a device-to-device copy."
        );
    }
    if !cpu.is_empty() {
        let _ = write!(
            out,
            " On the CPU ({}) the GEMM ceiling is the rate of the `gemm` crate, the same library the CPU backend \
             runs its GEMMs in, so it is not an independent bound: a time/floor near 1× there says the layer runs \
             about as fast as its own GEMMs do on that machine (little is lost around them), not that it reaches \
             the CPU's peak. A faster GEMM library would lower the floor and the time together.",
            run_nums(&cpu)
        );
    }
    let _ = writeln!(out, "\n");
}

fn anchors(m: &Model<'_>, out: &mut String) {
    if m.anchors.is_empty() {
        return;
    }
    section(
        out,
        "## Anchors",
        "Times measured elsewhere and copied from the anchors file, not by these runs. Each is compared only with \
         runs of its formulation and I/O precision (and device, where it names one).",
    );
    let mut lines = Vec::new();
    for a in m.anchors {
        let mut s = format!("- **{}**", escape(&a.name));
        match a.class() {
            Some((f, p)) => {
                let _ = write!(s, " ({f} {p})");
            }
            None => s.push_str(" (formulation and precision not given: compared with nothing)"),
        }
        if let Some(d) = &a.device {
            let _ = write!(s, " on {}", escape(d));
        }
        if let Some(n) = &a.note {
            let _ = write!(s, ": {}", escape(n));
        }
        lines.push(s);
    }
    let _ = writeln!(out, "{}\n", lines.join("\n"));
    let measured: Vec<&String> = m.suites.iter().flat_map(|s| s.keys.iter()).collect();
    let mut notes = Vec::new();
    for a in m.anchors {
        let extra: Vec<String> = a.shapes.keys().filter(|k| !measured.contains(k)).map(|k| code(k)).collect();
        if !extra.is_empty() {
            notes.push(format!(
                "- **{}** has times for shapes no run measured: {}.",
                escape(&a.name),
                extra.join(", ")
            ));
        }
    }
    if !notes.is_empty() {
        let _ = writeln!(out, "{}\n", notes.join("\n"));
    }
}

/// Why a suite's runs are in it, when some did not record it.
fn inferred_why(name: &str) -> &'static str {
    match name {
        "long" => "every shape is B = 1, C = H = 128 with N ≥ 2048",
        "quick" => "the shapes are exactly the quick suite's",
        "gpumode" => "the shapes are GPU MODE benchmark shapes",
        _ => "the shapes match no known suite",
    }
}

fn suite_section(m: &Model<'_>, s: &Suite<'_>, plots: &[&Plot], out: &mut String) {
    let _ = writeln!(out, "## Suite {}\n", code(&s.name));
    let _ = write!(
        out,
        "{} ({}), {}.",
        plural(s.runs.len(), "run", "runs"),
        run_nums(&s.runs),
        plural(s.keys.len(), "shape", "shapes")
    );
    if s.inferred {
        let all = s.runs.iter().all(|&r| m.runs[r].suite.as_deref().is_none_or(|n| n.trim().is_empty()));
        let _ = write!(
            out,
            " {} did not record their suite; {} is inferred because {}.",
            if all { "The runs" } else { "Some of the runs" },
            code(&s.name),
            inferred_why(&s.name)
        );
    }
    for col in s.columns.iter().filter(|c| c.runs.len() > 1) {
        let mut commits: Vec<String> = Vec::new();
        for &r in &col.runs {
            let c = commit(&m.runs[r]);
            if !commits.contains(&c) {
                commits.push(c);
            }
        }
        let _ = write!(
            out,
            " Runs {} share the column {}: one configuration (label or backend, device, formulation, precision, \
             weight preparation, memory budget), different shapes{}.",
            run_nums(&col.runs),
            escape(&col.name),
            if commits.len() > 1 { format!(", builds {}", and_list(&commits)) } else { String::new() }
        );
    }
    let _ = writeln!(out, "\n");
    times(m, s, out);
    against_anchors(m, s, out);
    between_runs(m, s, out);
    floors(m, s, out);
    throughput(s, out);
    spread(s, out);
    correctness(s, out);
    memory(s, out);
    clocks(m, s, out);
    coverage(m, s, out);
    plot_links(plots, out);
}

/// Shape, mask and distribution columns; `H` only when some shape is not H = 128.
fn shape_cols(s: &Suite<'_>, t: &mut Table) -> bool {
    let show_h = s.columns.iter().flat_map(|c| c.cells.iter().flatten()).any(|r| r.h != 128);
    t.col("shape", Align::Left).col("mask", Align::Left).col("dist", Align::Left);
    if show_h {
        t.col("H", Align::Right);
    }
    show_h
}

fn shape_cells(s: &Suite<'_>, k: usize, show_h: bool) -> Vec<String> {
    let first = s.first[k];
    let mut v = vec![code(&s.keys[k]), if first.masked { "random" } else { "none" }.to_string(), escape(&first.dist)];
    if show_h {
        v.push(first.h.to_string());
    }
    v
}

/// The table of the sections that show every column's results side by side, a row per shape:
/// the shape columns ([`shape_cols`]), then for each of the suite's columns one header per entry
/// of `heads` (the column's name, followed by the entry's suffix when it has one) and, in each
/// row, the cells `cells` makes of that column's result at the shape (`None`: it has none).
/// Returned unwritten, with `show_h`, for a section that adds a geomean row.
fn per_shape_table(
    s: &Suite<'_>,
    heads: &[(&str, Align)],
    cells: impl Fn(Option<&ShapeResult>) -> Vec<String>,
) -> (Table, bool) {
    let mut t = Table::new();
    let show_h = shape_cols(s, &mut t);
    for col in &s.columns {
        for &(suffix, align) in heads {
            t.col(if suffix.is_empty() { col.name.clone() } else { format!("{} {suffix}", col.name) }, align);
        }
    }
    for k in 0..s.keys.len() {
        let mut row = shape_cells(s, k, show_h);
        for col in &s.columns {
            let these = cells(col.cells[k]);
            debug_assert_eq!(these.len(), heads.len(), "a cell per header, or the columns slide");
            row.extend(these);
        }
        t.row(row);
    }
    (t, show_h)
}

/// The keys each column's geometric mean is over: those every one of `cols` has, named in the
/// row label; when they share none, each column's own, named in its cell (`own` true).
struct GeoSets {
    label: String,
    /// Per entry of `cols`: the keys, and whether they are the column's own rather than common.
    sets: Vec<(Vec<usize>, bool)>,
    common: Vec<usize>,
}

fn geo_sets(s: &Suite<'_>, cols: &[usize], rows: &[usize]) -> GeoSets {
    let common: Vec<usize> = s.common_of(cols).into_iter().filter(|k| rows.contains(k)).collect();
    if common.is_empty() {
        GeoSets {
            label: "**geomean** over each column's own shapes".into(),
            sets: cols.iter().map(|&c| (s.keys_of(c), true)).collect(),
            common,
        }
    } else {
        GeoSets {
            label: format!("**geomean** over {}", s.describe(&common, rows, "above")),
            sets: cols.iter().map(|_| (common.clone(), false)).collect(),
            common,
        }
    }
}

/// A geomean cell: bold value, and the keys it is over when they are the column's own.
fn geo_cell(
    s: &Suite<'_>,
    set: &(Vec<usize>, bool),
    f: impl Fn(usize) -> Option<f64>,
    fmt: fn(f64) -> String,
) -> String {
    match geomean(set.0.iter().map(|&k| f(k))) {
        Some(v) if set.1 => format!("**{}** (over {})", fmt(v), s.describe(&set.0, &[], "")),
        Some(v) => format!("**{}**", fmt(v)),
        None => "—".into(),
    }
}

/// A geomean row's leading cells: the label spanning the shape columns.
fn geomean_lead(label: &str, show_h: bool) -> Vec<String> {
    let mut v = vec![label.to_string(), String::new(), String::new()];
    if show_h {
        v.push(String::new());
    }
    v
}

fn cell(v: Option<f64>, fmt: fn(f64) -> String) -> String {
    v.map(fmt).unwrap_or_else(|| "—".into())
}

/// Keys some of `cols` has, in suite order.
fn rows_of(s: &Suite<'_>, cols: &[usize]) -> Vec<usize> {
    (0..s.keys.len()).filter(|&k| cols.iter().any(|&c| s.columns[c].has(k))).collect()
}

fn times(m: &Model<'_>, s: &Suite<'_>, out: &mut String) {
    section(
        out,
        "### Median time (ms)",
        "One table per formulation and I/O precision: runs appear only beside runs and anchors that computed \
         the same thing with the same element type.",
    );
    for class in s.classes() {
        let cols = s.class_columns(&class);
        let anchors = s.anchors_for(m, &cols);
        let rows = rows_of(s, &cols);
        let _ = writeln!(out, "**{}**\n", escape(&class.label()));
        let mut t = Table::new();
        let show_h = shape_cols(s, &mut t);
        for &c in &cols {
            t.col(&s.columns[c].name, Align::Right);
        }
        for &a in &anchors {
            t.col(format!("{} (anchor)", m.anchors[a].name), Align::Right);
        }
        for &k in &rows {
            let mut row = shape_cells(s, k, show_h);
            row.extend(cols.iter().map(|&c| cell(s.columns[c].median(k), fmt_ms)));
            row.extend(anchors.iter().map(|&a| cell(s.anchor_value(m, a, k), fmt_ms)));
            t.row(row);
        }
        let g = geo_sets(s, &cols, &rows);
        let mut row = geomean_lead(&g.label, show_h);
        row.extend(cols.iter().zip(&g.sets).map(|(&c, set)| geo_cell(s, set, |k| s.columns[c].median(k), fmt_ms)));
        for &a in &anchors {
            let v = if g.common.is_empty() { None } else { geomean(g.common.iter().map(|&k| s.anchor_value(m, a, k))) };
            row.push(v.map(|v| format!("**{}**", fmt_ms(v))).unwrap_or_else(|| "—".into()));
        }
        t.row(row);
        t.write(out);
    }

    // Anchors with times for these shapes that stand beside no run here, and why.
    let all: Vec<usize> = (0..s.columns.len()).collect();
    let shown = s.anchors_for(m, &all);
    // Grouped by reason: one line per class and device. Each reason in the singular and plural.
    let mut notes: Vec<((String, String), Vec<String>)> = Vec::new();
    for &a in s.anchors.iter().filter(|a| !shown.contains(a)) {
        let anchor = &m.anchors[a];
        let why = match anchor.class() {
            None => {
                let tail = "no formulation and precision, so compared with nothing";
                (format!("gives {tail}"), format!("give {tail}"))
            }
            Some((f, p)) if !s.columns.iter().any(|c| c.class.formulation == f && c.class.precision == p) => {
                let tail = format!("{f} {p}: no run of this suite has that formulation and precision");
                (format!("is {tail}"), format!("are {tail}"))
            }
            Some((f, p)) => {
                let tail = format!(
                    "{f} {p}, measured on {}, where no {f} {p} run of this suite ran",
                    escape(anchor.device.as_deref().unwrap_or("another device"))
                );
                (format!("is {tail}"), format!("are {tail}"))
            }
        };
        let name = format!("**{}**", escape(&anchor.name));
        match notes.iter_mut().find(|(w, _)| *w == why) {
            Some((_, names)) => names.push(name),
            None => notes.push((why, vec![name])),
        }
    }
    if !notes.is_empty() {
        let lines: Vec<String> = notes
            .iter()
            .map(|((one, many), names)| format!("- {} {}.", and_list(names), if names.len() == 1 { one } else { many }))
            .collect();
        let _ =
            writeln!(out, "Anchors with times for these shapes that are not compared here:\n\n{}\n", lines.join("\n"));
    }
}

fn against_anchors(m: &Model<'_>, s: &Suite<'_>, out: &mut String) {
    if s.anchors.is_empty() {
        return;
    }
    let _ = writeln!(out, "### Against the anchors\n");
    let pairs: Vec<(usize, usize)> = s
        .pairs(m)
        .into_iter()
        .filter_map(|(c, a)| match a {
            Against::Anchor(a) => Some((c, a)),
            Against::Column(_) => None,
        })
        .collect();
    let _ = writeln!(
        out,
        "Anchor time / run time (above 1×: the run is faster), as a geometric mean over the shapes both have and \
         its range over them. Only runs and anchors of the same formulation and I/O precision are paired, and an \
         anchor that names a device only with runs on it.\n"
    );
    if !pairs.is_empty() {
        let mut t = Table::new();
        t.col("run", Align::Left)
            .col("anchor", Align::Left)
            .col("shapes", Align::Left)
            .col("anchor / run", Align::Right)
            .col("per shape", Align::Right);
        for &(c, a) in &pairs {
            let pair = (c, Against::Anchor(a));
            let keys = s.pair_keys(m, pair);
            let ratios: Vec<f64> = keys.iter().filter_map(|&k| s.ratio(m, pair, k)).collect();
            let (lo, hi) = ratios.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let label = m.anchors[a].class().map(|(f, p)| format!(" ({f} {p})")).unwrap_or_default();
            t.row(vec![
                escape(&s.columns[c].name),
                escape(&format!("{}{label}", m.anchors[a].name)),
                s.describe(&keys, &s.keys_of(c), "of the run"),
                cell(geomean(ratios.iter().map(|&v| Some(v))), fmt_ratio),
                if ratios.len() > 1 { format!("{} – {}", fmt_ratio(lo), fmt_ratio(hi)) } else { fmt_ratio(lo) },
            ]);
        }
        t.write(out);
    }
    let alone: Vec<String> = (0..s.columns.len())
        .filter(|c| !pairs.iter().any(|(pc, _)| pc == c))
        .map(|c| escape(&s.columns[c].name))
        .collect();
    if !alone.is_empty() {
        let _ = writeln!(
            out,
            "No anchor has the formulation, I/O precision and device of {}, so {} compared with none.\n",
            and_list(&alone),
            if alone.len() == 1 { "it is" } else { "they are" }
        );
    }
}

fn between_runs(m: &Model<'_>, s: &Suite<'_>, out: &mut String) {
    let classes: Vec<_> = s.classes().into_iter().filter(|c| s.class_columns(c).len() > 1).collect();
    if classes.is_empty() {
        return;
    }
    section(
        out,
        "### Speedups between runs",
        "Baseline time / run time (above 1×: faster than the baseline), within one formulation and I/O precision.",
    );
    for class in classes {
        let cols = s.class_columns(&class);
        let Some(b) = s.baseline_of(m, &class) else { continue };
        let others: Vec<usize> = cols.iter().copied().filter(|&c| c != b).collect();
        let _ = writeln!(out, "**{}**, against {}\n", escape(&class.label()), escape(&s.columns[b].name));
        let rows = rows_of(s, &cols);
        let mut t = Table::new();
        let show_h = shape_cols(s, &mut t);
        for &c in &others {
            t.col(&s.columns[c].name, Align::Right);
        }
        for &k in &rows {
            let mut row = shape_cells(s, k, show_h);
            row.extend(others.iter().map(|&c| cell(s.ratio(m, (c, Against::Column(b)), k), fmt_ratio)));
            t.row(row);
        }
        // Over the keys the baseline and every other column have, or each pair's own.
        let g = geo_sets(s, &cols, &rows);
        let mut row = geomean_lead(&g.label, show_h);
        for &c in &others {
            let pair = (c, Against::Column(b));
            let set = if g.common.is_empty() { (s.pair_keys(m, pair), true) } else { (g.common.clone(), false) };
            row.push(geo_cell(s, &set, |k| s.ratio(m, pair, k), fmt_ratio));
        }
        t.row(row);
        t.write(out);
    }
}

fn floors(m: &Model<'_>, s: &Suite<'_>, out: &mut String) {
    let _ = writeln!(out, "### Distance from the floor\n");
    let _ = write!(
        out,
        "Time / floor, with each run's own floor (see *What the floors mean* above): 1× would be as fast as the \
         device allows."
    );
    let cpu: Vec<String> =
        s.columns.iter().filter(|c| c.runs.iter().any(|&r| is_cpu(&m.runs[r]))).map(|c| escape(&c.name)).collect();
    if !cpu.is_empty() {
        let _ = write!(
            out,
            " For {}, the floor is the `gemm` crate's own rate, so the ratio measures the layer against its GEMM \
             library, not against the CPU.",
            and_list(&cpu)
        );
    }
    let _ = writeln!(out, "\n");
    let cols: Vec<usize> = (0..s.columns.len()).collect();
    let rows: Vec<usize> = (0..s.keys.len()).collect();
    let (mut t, show_h) = per_shape_table(s, &[("floor (ms)", Align::Right), ("time/floor", Align::Right)], |r| {
        vec![cell(r.map(|r| r.floor_ms), fmt_ms), cell(r.map(|r| r.floor_ratio), fmt_ratio)]
    });
    let g = geo_sets(s, &cols, &rows);
    let mut row = geomean_lead(&g.label, show_h);
    for (col, set) in s.columns.iter().zip(&g.sets) {
        row.push(geo_cell(s, set, |k| col.cells[k].map(|r| r.floor_ms), fmt_ms));
        row.push(geo_cell(s, set, |k| col.cells[k].map(|r| r.floor_ratio), fmt_ratio));
    }
    t.row(row);
    t.write(out);
}

fn throughput(s: &Suite<'_>, out: &mut String) {
    section(
        out,
        "### Throughput",
        "TFLOP/s counts the FLOPs of SPEC.md's formula; GB/s counts x read and y written at the run's I/O precision \
         (and the mask), so neither includes intermediate traffic.",
    );
    let (t, _) = per_shape_table(s, &[("TFLOP/s", Align::Right), ("GB/s", Align::Right)], |r| {
        vec![cell(r.map(|r| r.tflops), |v| format!("{v:.2}")), cell(r.map(|r| r.gbs), |v| format!("{v:.1}"))]
    });
    t.write(out);
}

fn spread(s: &Suite<'_>, out: &mut String) {
    section(
        out,
        "### Timing spread",
        "p10 – p90 of the timed calls in ms, with the fastest call and the number of calls.",
    );
    let (t, _) = per_shape_table(s, &[("", Align::Right)], |r| {
        vec![match r {
            Some(r) => {
                format!("{} – {} (min {}, n={})", fmt_ms(r.p10_ms), fmt_ms(r.p90_ms), fmt_ms(r.min_ms), r.repeats)
            }
            None => "—".into(),
        }]
    });
    t.write(out);
}

fn correctness(s: &Suite<'_>, out: &mut String) {
    let _ = writeln!(out, "### Correctness\n");
    let all: Vec<&ShapeResult> = s.columns.iter().flat_map(|c| c.cells.iter().flatten().copied()).collect();
    let checked = all.iter().filter(|r| r.passed.is_some()).count();
    let passed = all.iter().filter(|r| r.passed == Some(true)).count();
    let _ = write!(
        out,
        "Against the f64 reference on each run's own inputs. rel L2 = ‖out − ref‖ / ‖ref‖; pass = every element \
         within 2e-2 + 2e-2·|ref| and no NaN the reference lacks (GPU MODE's rule). "
    );
    if checked == passed {
        let _ = write!(out, "{} of {} checked results pass", passed, checked);
    } else {
        let _ = write!(out, "**{} of {} checked results FAIL**", checked - passed, checked);
    }
    let unchecked = all.len() - checked;
    if unchecked > 0 {
        let _ = write!(out, "; {} not checked", unchecked);
    }
    let _ = writeln!(out, ".\n");

    let heads = [("rel L2", Align::Right), ("max abs", Align::Right), ("result", Align::Left)];
    let (t, _) = per_shape_table(s, &heads, |r| match r {
        Some(r) => {
            let result = match r.passed {
                Some(true) => "pass",
                Some(false) => "**FAIL**",
                None => "not checked",
            };
            vec![cell(r.rel_l2_err, fmt_err), cell(r.max_abs_err, fmt_err), result.into()]
        }
        None => vec!["—".to_string(), "—".to_string(), "—".to_string()],
    });
    t.write(out);
}

fn memory(s: &Suite<'_>, out: &mut String) {
    let _ = writeln!(out, "### Device memory\n");
    let cells = || s.columns.iter().flat_map(|c| c.cells.iter().flatten());
    if !cells().any(|r| r.peak_device_bytes.is_some() || r.workspace_bytes.is_some()) {
        let _ = writeln!(out, "No run recorded memory use.\n");
        return;
    }
    let _ =
        write!(out, "Peak device memory of one forward (weights, x, mask, y, workspace), and the backend's workspace.");
    if cells().any(|r| r.in_place || r.memory_budget_bytes.is_some()) {
        let _ = write!(out, " *in place*: y was written over x; *budget*: the forward ran under `--max-memory`.");
    }
    let _ = writeln!(out, "\n");
    let (t, _) = per_shape_table(s, &[("peak", Align::Right), ("workspace", Align::Right)], |r| {
        let bytes = |v: Option<u64>| v.map(fmt_bytes).unwrap_or_else(|| "—".into());
        let mut peak = bytes(r.and_then(|r| r.peak_device_bytes));
        if let Some(r) = r {
            if r.in_place {
                peak.push_str(" (in place)");
            }
            if let Some(b) = r.memory_budget_bytes {
                let _ = write!(peak, " (budget {})", fmt_bytes(b));
            }
        }
        vec![peak, bytes(r.and_then(|r| r.workspace_bytes))]
    });
    t.write(out);
}

fn mhz(v: f64) -> String {
    format!("{v:.0}")
}

/// One shape's clocks and power: the span over the timed calls when there were readings, else
/// the readings before and after.
fn telemetry_cell(t: &ShapeTelemetry) -> String {
    let mut parts = Vec::new();
    let reasons: Vec<String> = match &t.during {
        Some(d) if d.samples > 0 => {
            match (d.sm_clock_mhz_min, d.sm_clock_mhz_max) {
                (Some(lo), Some(hi)) if lo != hi => parts.push(format!("SM {}–{} MHz", mhz(lo), mhz(hi))),
                (Some(v), _) | (None, Some(v)) => parts.push(format!("SM {} MHz", mhz(v))),
                _ => {}
            }
            match (d.power_w_max, d.power_limit_w) {
                (Some(p), Some(l)) => parts.push(format!("≤ {p:.0} W of {l:.0} W")),
                (Some(p), None) => parts.push(format!("≤ {p:.0} W")),
                _ => {}
            }
            parts.push(format!("{} readings", d.samples));
            d.clock_event_reasons.clone()
        }
        _ => {
            let (b, a) = (t.before.clone().unwrap_or_default(), t.after.clone().unwrap_or_default());
            let pair = |x: Option<f64>, y: Option<f64>, unit: &str, f: fn(f64) -> String| match (x, y) {
                (Some(x), Some(y)) => Some(format!("{} → {} {unit}", f(x), f(y))),
                (Some(v), None) | (None, Some(v)) => Some(format!("{} {unit}", f(v))),
                (None, None) => None,
            };
            parts.extend(pair(b.sm_clock_mhz, a.sm_clock_mhz, "MHz", mhz).map(|s| format!("SM {s}")));
            parts.extend(pair(b.power_w, a.power_w, "W", |v| format!("{v:.0}")));
            if parts.is_empty() {
                return "no reading".into();
            }
            parts.push("before → after".into());
            a.clock_event_reasons.unwrap_or_default()
        }
    };
    let held: Vec<&String> = reasons.iter().filter(|r| r.as_str() != "gpu_idle").collect();
    if !held.is_empty() {
        parts.push(held.iter().map(|r| format!("**{}**", escape(r))).collect::<Vec<_>>().join(", "));
    }
    parts.join(" · ")
}

fn clocks(m: &Model<'_>, s: &Suite<'_>, out: &mut String) {
    let _ = writeln!(out, "### Clocks and power\n");
    let any = s.columns.iter().flat_map(|c| c.cells.iter().flatten()).any(|r| r.telemetry.is_some());
    if !any {
        let mut why: Vec<(String, Vec<usize>)> = Vec::new();
        for &r in &s.runs {
            let text = probe_missing(&m.runs[r]).unwrap_or_else(|| "no shape has readings".into());
            match why.iter_mut().find(|(t, _)| *t == text) {
                Some((_, rs)) => rs.push(r),
                None => why.push((text, vec![r])),
            }
        }
        let why: Vec<String> = why.iter().map(|(t, rs)| format!("{}: {}", run_nums(rs), escape(t))).collect();
        let _ = writeln!(out, "No run of this suite recorded clocks or power ({}).\n", why.join("; "));
        return;
    }
    let _ = writeln!(
        out,
        "SM clock range and highest board power over each shape's warm-up and timed calls, against the power \
         limit, with the reasons the driver gave for holding the clocks down (**sw_power_cap**: the power limit; \
         idle periods left out). Without readings during the calls, the readings just before and after.\n"
    );
    let (t, _) = per_shape_table(s, &[("", Align::Left)], |r| {
        vec![match r {
            Some(r) => match &r.telemetry {
                Some(tel) => telemetry_cell(tel),
                None => "not recorded".into(),
            },
            None => "—".into(),
        }]
    });
    t.write(out);
    if let Some(max) = s
        .columns
        .iter()
        .flat_map(|c| c.cells.iter().flatten())
        .filter_map(|r| r.telemetry.as_ref()?.before.as_ref()?.max_sm_clock_mhz)
        .reduce(f64::max)
    {
        let _ = writeln!(out, "Highest SM clock the GPU reports: {} MHz.\n", mhz(max));
    }
}

/// Reads one configuration field of a result as text, for comparing columns.
type ShapeField = fn(&ShapeResult) -> String;

/// Where columns and anchors do not line up. Always written, so a reader knows it was checked.
fn coverage(m: &Model<'_>, s: &Suite<'_>, out: &mut String) {
    let _ = writeln!(out, "### Shape coverage\n");
    let names = |cs: &[usize]| and_list(&cs.iter().map(|&c| escape(&s.columns[c].name)).collect::<Vec<_>>());
    let mut notes = Vec::new();
    for k in 0..s.keys.len() {
        let missing: Vec<usize> = (0..s.columns.len()).filter(|&c| !s.columns[c].has(k)).collect();
        if !missing.is_empty() {
            let have: Vec<usize> = (0..s.columns.len()).filter(|&c| s.columns[c].has(k)).collect();
            notes.push(format!(
                "- {} is missing from {} (measured by {}); geometric means over shapes it lacks say so.",
                code(&s.keys[k]),
                names(&missing),
                names(&have)
            ));
        }
    }
    // Same key, different problem: the times are not comparable, so say how they differ.
    for k in 0..s.keys.len() {
        let present: Vec<(usize, &ShapeResult)> =
            (0..s.columns.len()).filter_map(|c| s.columns[c].cells[k].map(|r| (c, r))).collect();
        let fields: [(&str, ShapeField); 4] = [
            ("mask", |r| if r.masked { "random".into() } else { "none".into() }),
            ("distribution", |r| r.dist.clone()),
            ("direction", |r| r.direction.clone()),
            ("H", |r| r.h.to_string()),
        ];
        for (what, f) in fields {
            let first = present.first().map(|(_, r)| f(r));
            if present.iter().any(|(_, r)| Some(f(r)) != first) {
                let each = present.iter().map(|(c, r)| format!("{} {}", escape(&s.columns[*c].name), escape(&f(r))));
                notes.push(format!(
                    "- {}: the {what} differs between runs ({}).",
                    code(&s.keys[k]),
                    each.collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    let all: Vec<usize> = (0..s.columns.len()).collect();
    for a in s.anchors_for(m, &all) {
        let lacks: Vec<String> =
            (0..s.keys.len()).filter(|&k| s.anchor_value(m, a, k).is_none()).map(|k| code(&s.keys[k])).collect();
        if !lacks.is_empty() {
            notes.push(format!("- Anchor **{}** has no time for {}.", escape(&m.anchors[a].name), lacks.join(", ")));
        }
    }
    if notes.is_empty() {
        let _ = writeln!(
            out,
            "Every column has the same {} with the same mask, distribution and direction.\n",
            plural(s.keys.len(), "shape", "shapes"),
        );
    } else {
        let _ = writeln!(out, "{}\n", notes.join("\n"));
    }
}

fn plot_links(plots: &[&Plot], out: &mut String) {
    if plots.is_empty() {
        return;
    }
    let _ = writeln!(out, "### Plots\n");
    for p in plots {
        let _ = writeln!(out, "![{}]({})\n", escape(&p.alt), p.name);
    }
}
