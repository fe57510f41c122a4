//! `report.md`: who ran what, then one table per question (how fast, how much faster than the
//! baseline and the anchors, how close to the floor, how noisy, how correct, how much memory),
//! then which shapes did not line up, then the plots.

use std::fmt::Write as _;

use super::{fmt_bytes, fmt_err, fmt_ms, fmt_ratio, geomean, BenchRun, Model, ShapeResult};

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

fn code(s: &str) -> String {
    format!("`{}`", s.replace('`', "'"))
}

/// The whole `report.md`. `svgs` are the plot files written beside it.
pub(crate) fn render(m: &Model<'_>, svgs: &[(String, String)]) -> String {
    let mut out = String::new();
    header(m, &mut out);
    runs(m, &mut out);
    times(m, &mut out);
    speedups(m, &mut out);
    against_anchors(m, &mut out);
    floors(m, &mut out);
    throughput(m, &mut out);
    spread(m, &mut out);
    correctness(m, &mut out);
    memory(m, &mut out);
    coverage(m, &mut out);
    plots(svgs, &mut out);
    // One trailing newline exactly, whatever the last section wrote.
    while out.ends_with("\n\n") {
        out.pop();
    }
    out
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn header(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "# TriMul benchmark report\n");
    let _ = write!(
        out,
        "{}, {}, {}. Times are medians in milliseconds; lower is better. ",
        plural(m.runs.len(), "run", "runs"),
        plural(m.keys.len(), "shape", "shapes"),
        plural(m.anchors.len(), "anchor", "anchors"),
    );
    if m.runs.len() > 1 {
        let _ = write!(out, "Speedups are against {}. ", escape(&m.run_name(m.baseline)));
    }
    let _ = writeln!(out, "Geometric means use the {} every run has.\n", plural(m.common.len(), "shape", "shapes"));
}

fn commit(run: &BenchRun) -> String {
    run.tool.git_commit.as_deref().map(code).unwrap_or_else(|| "unknown".into())
}

fn runs(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "## Runs\n");
    let mut t = Table::new();
    t.col("run", Align::Left)
        .col("device", Align::Left)
        .col("arch", Align::Left)
        .col("compute units", Align::Right)
        .col("memory", Align::Right)
        .col("backend", Align::Left)
        .col("precision", Align::Left)
        .col("formulation", Align::Left)
        .col("date (UTC)", Align::Left)
        .col("tool", Align::Left)
        .col("commit", Align::Left);
    for (r, run) in m.runs.iter().enumerate() {
        let mc = &run.machine;
        let device =
            if mc.device.starts_with(&mc.vendor) { mc.device.clone() } else { format!("{} {}", mc.vendor, mc.device) };
        t.row(vec![
            escape(&m.run_name(r)),
            escape(device.trim()),
            escape(&mc.arch),
            mc.compute_units.to_string(),
            fmt_bytes(mc.memory_bytes),
            escape(&run.backend),
            escape(&run.precision),
            escape(&run.formulation),
            escape(run.date()),
            escape(&format!("{} {}", run.tool.name, run.tool.version)),
            commit(run),
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
                "{} warm-up, {} timed, {} buffer sets, {} clock, {weights}",
                tm.warmup, tm.repeats, tm.buffer_sets, tm.clock
            )),
            gemm,
            copy,
        ]);
    }
    t.write(out);

    let mut lines = Vec::new();
    for (r, run) in m.runs.iter().enumerate() {
        let mut parts: Vec<String> = run.machine.versions.iter().map(|(k, v)| format!("{k} {v}")).collect();
        if let Some(h) = &run.machine.host {
            parts.push(format!("host {h}"));
        }
        if !parts.is_empty() {
            lines.push(format!("- {}: {}", m.run_name(r), parts.join(" · ").replace(['\n', '\r'], " ")));
        }
    }
    if !lines.is_empty() {
        let _ = writeln!(out, "Software:\n\n{}\n", lines.join("\n"));
    }
}

/// Shape, mask and distribution columns; `H` only when some shape is not H = 128.
fn shape_cols(m: &Model<'_>, t: &mut Table) -> bool {
    let show_h = m.cells.iter().flatten().flatten().any(|s| s.h != 128);
    t.col("shape", Align::Left).col("mask", Align::Left).col("dist", Align::Left);
    if show_h {
        t.col("H", Align::Right);
    }
    show_h
}

fn shape_cells(m: &Model<'_>, k: usize, show_h: bool) -> Vec<String> {
    let first = m.first(k);
    let mut v = vec![
        code(&m.keys[k]),
        first.map(|s| if s.masked { "random" } else { "none" }.to_string()).unwrap_or_default(),
        first.map(|s| escape(&s.dist)).unwrap_or_default(),
    ];
    if show_h {
        v.push(first.map(|s| s.h.to_string()).unwrap_or_default());
    }
    v
}

/// A geomean row's leading cells: a bold label spanning the shape columns.
fn geomean_cells(m: &Model<'_>, show_h: bool) -> Vec<String> {
    let mut v =
        vec![format!("**geomean** ({})", plural(m.common.len(), "shape", "shapes")), String::new(), String::new()];
    if show_h {
        v.push(String::new());
    }
    v
}

fn bold_or_dash(v: Option<f64>, fmt: fn(f64) -> String) -> String {
    v.map(|v| format!("**{}**", fmt(v))).unwrap_or_else(|| "—".into())
}

fn cell(v: Option<f64>, fmt: fn(f64) -> String) -> String {
    v.map(fmt).unwrap_or_else(|| "—".into())
}

fn median(m: &Model<'_>, k: usize, r: usize) -> Option<f64> {
    m.cells[k][r].map(|s| s.median_ms)
}

fn times(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "## Median time (ms)\n");
    if !m.anchors.is_empty() {
        let _ = writeln!(
            out,
            "Anchor columns are times measured elsewhere and copied from the anchors file, not by these runs \
             (see the anchor notes below the table).\n"
        );
    }
    let mut t = Table::new();
    let show_h = shape_cols(m, &mut t);
    for r in 0..m.runs.len() {
        t.col(m.run_name(r), Align::Right);
    }
    for a in m.anchors {
        t.col(&a.name, Align::Right);
    }
    for k in 0..m.keys.len() {
        let mut row = shape_cells(m, k, show_h);
        row.extend((0..m.runs.len()).map(|r| cell(median(m, k, r), fmt_ms)));
        row.extend(m.anchors.iter().map(|a| cell(a.shapes.get(&m.keys[k]).copied(), fmt_ms)));
        t.row(row);
    }
    let mut row = geomean_cells(m, show_h);
    row.extend((0..m.runs.len()).map(|r| bold_or_dash(m.common_geomean(|k| median(m, k, r)), fmt_ms)));
    row.extend(m.anchors.iter().map(|a| bold_or_dash(m.common_geomean(|k| a.shapes.get(&m.keys[k]).copied()), fmt_ms)));
    t.row(row);
    t.write(out);

    if !m.anchors.is_empty() {
        let mut lines = Vec::new();
        for a in m.anchors {
            let mut s = format!("- **{}**", escape(&a.name));
            if let Some(d) = &a.device {
                let _ = write!(s, " on {}", escape(d));
            }
            if let Some(n) = &a.note {
                let _ = write!(s, ": {}", escape(n));
            }
            lines.push(s);
        }
        let _ = writeln!(out, "{}\n", lines.join("\n"));
    }
}

fn speedups(m: &Model<'_>, out: &mut String) {
    if m.runs.len() < 2 {
        return;
    }
    let b = m.baseline;
    let _ = writeln!(out, "## Speedup over {}\n", escape(&m.run_name(b)));
    let _ = writeln!(out, "Baseline time / run time: above 1× is faster than the baseline.\n");
    let others: Vec<usize> = (0..m.runs.len()).filter(|&r| r != b).collect();
    let mut t = Table::new();
    let show_h = shape_cols(m, &mut t);
    for &r in &others {
        t.col(m.run_name(r), Align::Right);
    }
    let speedup = |k: usize, r: usize| Some(median(m, k, b)? / median(m, k, r)?);
    for k in 0..m.keys.len() {
        let mut row = shape_cells(m, k, show_h);
        row.extend(others.iter().map(|&r| cell(speedup(k, r), fmt_ratio)));
        t.row(row);
    }
    let mut row = geomean_cells(m, show_h);
    row.extend(others.iter().map(|&r| bold_or_dash(m.common_geomean(|k| speedup(k, r)), fmt_ratio)));
    t.row(row);
    t.write(out);
}

fn against_anchors(m: &Model<'_>, out: &mut String) {
    if m.anchors.is_empty() {
        return;
    }
    let _ = writeln!(out, "## Against the anchors\n");
    let _ = writeln!(
        out,
        "Anchor time / run time, geometric mean over the shapes the run and the anchor share (all of the \
         run's shapes unless a count is given): above 1× means the run is faster. Anchors measured on \
         another device compare devices as much as code.\n"
    );
    let mut t = Table::new();
    t.col("run", Align::Left);
    for a in m.anchors {
        t.col(&a.name, Align::Right);
    }
    for (r, run) in m.runs.iter().enumerate() {
        let mut row = vec![escape(&m.run_name(r))];
        for a in m.anchors {
            let ratios: Vec<Option<f64>> =
                run.shapes.iter().filter_map(|s| a.shapes.get(&s.key()).map(|&av| Some(av / s.median_ms))).collect();
            let n = ratios.len();
            row.push(match geomean(ratios) {
                Some(g) if n == run.shapes.len() => fmt_ratio(g),
                Some(g) => format!("{} ({})", fmt_ratio(g), plural(n, "shape", "shapes")),
                None => "—".into(),
            });
        }
        t.row(row);
    }
    t.write(out);
}

fn floors(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "## Distance from the floor\n");
    let _ = writeln!(
        out,
        "Floor = max(FLOPs / GEMM ceiling, f32 bytes in+out / copy ceiling), from each run's own ceilings: \
         the time no implementation can beat on that device. Time / floor of 1× would be perfect.\n"
    );
    let mut t = Table::new();
    let show_h = shape_cols(m, &mut t);
    for r in 0..m.runs.len() {
        let name = m.run_name(r);
        t.col(format!("{name} floor (ms)"), Align::Right).col(format!("{name} time/floor"), Align::Right);
    }
    let floor = |k: usize, r: usize| m.cells[k][r].map(|s| s.floor_ms);
    let ratio = |k: usize, r: usize| m.cells[k][r].map(|s| s.floor_ratio);
    for k in 0..m.keys.len() {
        let mut row = shape_cells(m, k, show_h);
        for r in 0..m.runs.len() {
            row.push(cell(floor(k, r), fmt_ms));
            row.push(cell(ratio(k, r), fmt_ratio));
        }
        t.row(row);
    }
    let mut row = geomean_cells(m, show_h);
    for r in 0..m.runs.len() {
        row.push(bold_or_dash(m.common_geomean(|k| floor(k, r)), fmt_ms));
        row.push(bold_or_dash(m.common_geomean(|k| ratio(k, r)), fmt_ratio));
    }
    t.row(row);
    t.write(out);
}

fn throughput(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "## Throughput\n");
    let _ = writeln!(
        out,
        "TFLOP/s counts the FLOPs of SPEC.md's formula; GB/s counts f32 x read and y written (and the mask), \
         so neither includes intermediate traffic.\n"
    );
    let mut t = Table::new();
    let show_h = shape_cols(m, &mut t);
    for r in 0..m.runs.len() {
        let name = m.run_name(r);
        t.col(format!("{name} TFLOP/s"), Align::Right).col(format!("{name} GB/s"), Align::Right);
    }
    for k in 0..m.keys.len() {
        let mut row = shape_cells(m, k, show_h);
        for r in 0..m.runs.len() {
            let s = m.cells[k][r];
            row.push(cell(s.map(|s| s.tflops), |v| format!("{v:.2}")));
            row.push(cell(s.map(|s| s.gbs), |v| format!("{v:.1}")));
        }
        t.row(row);
    }
    t.write(out);
}

fn spread(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "## Timing spread\n");
    let _ = writeln!(out, "p10 – p90 of the timed calls in ms, with the fastest call and the number of calls.\n");
    let mut t = Table::new();
    let show_h = shape_cols(m, &mut t);
    for r in 0..m.runs.len() {
        t.col(m.run_name(r), Align::Right);
    }
    for k in 0..m.keys.len() {
        let mut row = shape_cells(m, k, show_h);
        for r in 0..m.runs.len() {
            row.push(match m.cells[k][r] {
                Some(s) => {
                    format!("{} – {} (min {}, n={})", fmt_ms(s.p10_ms), fmt_ms(s.p90_ms), fmt_ms(s.min_ms), s.repeats)
                }
                None => "—".into(),
            });
        }
        t.row(row);
    }
    t.write(out);
}

fn correctness(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "## Correctness\n");
    let all: Vec<(usize, usize, &ShapeResult)> = (0..m.keys.len())
        .flat_map(|k| (0..m.runs.len()).filter_map(move |r| m.cells[k][r].map(|s| (k, r, s))))
        .collect();
    let checked = all.iter().filter(|(_, _, s)| s.passed.is_some()).count();
    let passed = all.iter().filter(|(_, _, s)| s.passed == Some(true)).count();
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

    let mut t = Table::new();
    let show_h = shape_cols(m, &mut t);
    for r in 0..m.runs.len() {
        let name = m.run_name(r);
        t.col(format!("{name} rel L2"), Align::Right)
            .col(format!("{name} max abs"), Align::Right)
            .col(format!("{name} result"), Align::Left);
    }
    for k in 0..m.keys.len() {
        let mut row = shape_cells(m, k, show_h);
        for r in 0..m.runs.len() {
            match m.cells[k][r] {
                Some(s) => {
                    row.push(cell(s.rel_l2_err, fmt_err));
                    row.push(cell(s.max_abs_err, fmt_err));
                    row.push(
                        match s.passed {
                            Some(true) => "pass",
                            Some(false) => "**FAIL**",
                            None => "not checked",
                        }
                        .into(),
                    );
                }
                None => row.extend(["—".to_string(), "—".to_string(), "—".to_string()]),
            }
        }
        t.row(row);
    }
    t.write(out);
}

fn memory(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "## Device memory\n");
    let any = m.cells.iter().flatten().flatten().any(|s| s.peak_device_bytes.is_some() || s.workspace_bytes.is_some());
    if !any {
        let _ = writeln!(out, "No run recorded memory use.\n");
        return;
    }
    let _ = writeln!(out, "Peak device memory during the timed calls, and the backend's workspace for the shape.\n");
    let mut t = Table::new();
    let show_h = shape_cols(m, &mut t);
    for r in 0..m.runs.len() {
        let name = m.run_name(r);
        t.col(format!("{name} peak"), Align::Right).col(format!("{name} workspace"), Align::Right);
    }
    for k in 0..m.keys.len() {
        let mut row = shape_cells(m, k, show_h);
        for r in 0..m.runs.len() {
            let s = m.cells[k][r];
            let bytes = |v: Option<u64>| v.map(fmt_bytes).unwrap_or_else(|| "—".into());
            row.push(bytes(s.and_then(|s| s.peak_device_bytes)));
            row.push(bytes(s.and_then(|s| s.workspace_bytes)));
        }
        t.row(row);
    }
    t.write(out);
}

/// Reads one configuration field of a result as text, for comparing runs.
type ShapeField = fn(&ShapeResult) -> String;

/// Where runs and anchors do not line up. Always written, so a reader knows it was checked.
fn coverage(m: &Model<'_>, out: &mut String) {
    let _ = writeln!(out, "## Shape coverage\n");
    let names = |rs: &[usize]| rs.iter().map(|&r| escape(&m.run_name(r))).collect::<Vec<_>>().join(", ");
    let mut notes = Vec::new();

    for k in 0..m.keys.len() {
        let missing: Vec<usize> = (0..m.runs.len()).filter(|&r| m.cells[k][r].is_none()).collect();
        if !missing.is_empty() {
            let have: Vec<usize> = (0..m.runs.len()).filter(|&r| m.cells[k][r].is_some()).collect();
            notes.push(format!(
                "- {} is missing from {} (measured by {}); it is left out of the geomeans.",
                code(&m.keys[k]),
                names(&missing),
                names(&have)
            ));
        }
    }
    // Same key, different problem: the times are not comparable, so say how they differ.
    for k in 0..m.keys.len() {
        let present: Vec<(usize, &ShapeResult)> =
            (0..m.runs.len()).filter_map(|r| m.cells[k][r].map(|s| (r, s))).collect();
        let fields: [(&str, ShapeField); 4] = [
            ("mask", |s| if s.masked { "random".into() } else { "none".into() }),
            ("distribution", |s| s.dist.clone()),
            ("direction", |s| s.direction.clone()),
            ("H", |s| s.h.to_string()),
        ];
        for (what, f) in fields {
            let first = present.first().map(|(_, s)| f(s));
            if present.iter().any(|(_, s)| Some(f(s)) != first) {
                let each = present.iter().map(|(r, s)| format!("{} {}", escape(&m.run_name(*r)), escape(&f(s))));
                notes.push(format!(
                    "- {}: the {what} differs between runs ({}).",
                    code(&m.keys[k]),
                    each.collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    for a in m.anchors {
        let lacks: Vec<String> = m.keys.iter().filter(|k| !a.shapes.contains_key(*k)).map(|k| code(k)).collect();
        if !lacks.is_empty() {
            notes.push(format!("- Anchor **{}** has no time for {}.", escape(&a.name), lacks.join(", ")));
        }
        let extra: Vec<String> = a.shapes.keys().filter(|k| !m.keys.contains(k)).map(|k| code(k)).collect();
        if !extra.is_empty() {
            notes.push(format!(
                "- Anchor **{}** has times for shapes no run measured: {}.",
                escape(&a.name),
                extra.join(", ")
            ));
        }
    }

    if notes.is_empty() {
        let _ = writeln!(
            out,
            "Every run measured the same {} with the same mask, distribution and direction{}.\n",
            plural(m.keys.len(), "shape", "shapes"),
            if m.anchors.is_empty() { "" } else { ", and every anchor has a time for each" }
        );
    } else {
        let _ = writeln!(out, "{}\n", notes.join("\n"));
    }
    if m.common.is_empty() {
        let _ = writeln!(out, "No shape is common to all runs, so there are no geometric means.\n");
    }
}

fn plots(svgs: &[(String, String)], out: &mut String) {
    if svgs.is_empty() {
        return;
    }
    let _ = writeln!(out, "## Plots\n");
    for (name, _) in svgs {
        let alt = match name.as_str() {
            super::plot::TIME_SVG => "Median time per shape, log scale",
            super::plot::FLOOR_SVG => "Time over floor per shape, log scale",
            _ => "plot",
        };
        let _ = writeln!(out, "![{alt}]({name})\n");
    }
}
