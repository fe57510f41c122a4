//! SVG plots of a report, drawn with `plotters`' SVG backend (text is emitted as SVG `<text>`,
//! so no font files are needed and the output is the same on every machine).
//!
//! Each suite gets its own plots, named after it (`gpumode-time.svg`):
//! - `{suite}-time.svg`: median time per shape, the shapes on a categorical x axis in the
//!   report's order; or, for a suite that sweeps N at fixed B and C (the long suite),
//!   `{suite}-time-vs-n.svg`: time against N, log–log, one line per column;
//! - `{suite}-memory-vs-n.svg` (sweeps only): peak device memory against N, log–log, with each
//!   device's memory as a dashed line, the ceiling a plan must fit under;
//! - `{suite}-speedup.svg`: like-with-like speedups per shape as bars from 1× (the anchor's or
//!   the class baseline's time over the run's), one bar per comparison;
//! - `{suite}-floor.svg` (`{suite}-floor-vs-n.svg` for sweeps): time over the run's floor.
//!
//! Times, memory and ratios sit on log y axes: the shapes span orders of magnitude in work.
//! Runs are solid lines with filled markers (a square where the forward ran in place, a
//! triangle where it ran under a memory budget); anchors are dashed lines with hollow markers.
//! On a shape axis a missing shape leaves a gap in a line rather than bridging it. Legends name
//! each line's formulation and I/O precision and sit in their own panel so they never hide
//! data.

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::model::{Model, Pair, Suite};
use super::schema::ShapeResult;
use crate::error::{Error, Result};
use crate::units::fmt_bytes;

const FONT: &str = "sans-serif";
const LEGEND_W: u32 = 380;
const PLOT_H: u32 = 560;
/// Horizontal room per shape: enough for a two-line label such as `N=1024` / `B=1 C=384`.
const PER_SHAPE_W: u32 = 92;
/// Horizontal room per bar of a speedup group.
const PER_BAR_W: u32 = 16;
/// Width of the plot area of a plot against N.
const SWEEP_W: u32 = 760;

/// Runs: strong, distinct colours (Tableau 10's first five, then more).
const RUN_COLORS: [RGBColor; 8] =
    rgb_table([0x1f77b4, 0xd62728, 0x2ca02c, 0xff7f0e, 0x9467bd, 0x17becf, 0x8c564b, 0xe377c2]);
/// Anchors: muted colours that stay behind the runs.
const ANCHOR_COLORS: [RGBColor; 8] =
    rgb_table([0x7f7f7f, 0xa6761d, 0xbc80bd, 0x66a61e, 0x4d4d4d, 0x9ebcda, 0x008b8b, 0x7570b3]);
/// Colours written as `0xRRGGBB`, as palettes publish them.
const fn rgb_table<const K: usize>(hex: [u32; K]) -> [RGBColor; K] {
    let mut out = [RGBColor(0, 0, 0); K];
    let mut i = 0;
    while i < K {
        out[i] = RGBColor((hex[i] >> 16) as u8, (hex[i] >> 8) as u8, hex[i] as u8);
        i += 1;
    }
    out
}
const GRID: RGBColor = RGBColor(232, 232, 232);
const GRID_BOLD: RGBColor = RGBColor(205, 205, 205);
const TEXT: RGBColor = RGBColor(40, 40, 40);
const SUBTEXT: RGBColor = RGBColor(110, 110, 110);

/// One plot file of a report.
pub(crate) struct Plot {
    /// Index of the suite it belongs to.
    pub suite: usize,
    pub name: String,
    /// The markdown image's alt text.
    pub alt: String,
    pub svg: String,
}

#[derive(Copy, Clone)]
enum Look {
    Run(usize),
    Anchor(usize),
    /// A speedup series: both palettes in turn, so up to 16 comparisons keep distinct colours.
    Bar(usize),
}

impl Look {
    fn color(self) -> RGBColor {
        match self {
            Look::Run(i) => RUN_COLORS[i % RUN_COLORS.len()],
            Look::Anchor(i) => ANCHOR_COLORS[i % ANCHOR_COLORS.len()],
            Look::Bar(i) => {
                let i = i % (RUN_COLORS.len() + ANCHOR_COLORS.len());
                if i < RUN_COLORS.len() {
                    RUN_COLORS[i]
                } else {
                    ANCHOR_COLORS[i - RUN_COLORS.len()]
                }
            }
        }
    }
}

/// How a run's point was measured, shown by its marker.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Mark {
    Plain,
    /// `y` overwrote `x`.
    InPlace,
    /// Under `--max-memory`.
    Budget,
}

impl Mark {
    fn of(s: &ShapeResult) -> Mark {
        if s.in_place {
            Mark::InPlace
        } else if s.memory_budget_bytes.is_some() {
            Mark::Budget
        } else {
            Mark::Plain
        }
    }
}

struct Series {
    title: String,
    subtitle: Option<String>,
    look: Look,
    /// One value per shape key; `None` (or a value that cannot sit on a log axis) is a gap.
    values: Vec<Option<f64>>,
    /// One per shape key (runs only; anchors are all plain).
    marks: Vec<Mark>,
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Kind {
    Lines,
    Bars,
}

struct Figure<'a> {
    title: String,
    y_desc: &'a str,
    /// Under the x axis of a plot against N (a shape axis explains itself).
    x_desc: Option<String>,
    /// Per key: two label lines and the x position (the key's index, or log2 N).
    keys: Vec<(String, String, f64)>,
    /// Plotted against log2 N rather than in key order.
    sweep: bool,
    kind: Kind,
    series: Vec<Series>,
    /// A line at y = 1 with this label; `shade` greys what lies below it.
    unit_line: Option<(&'a str, bool)>,
    /// Dashed horizontal lines with labels (a device's memory).
    hlines: Vec<(f64, String)>,
    /// Legend headings of runs and of anchors.
    headings: (&'a str, &'a str),
}

/// Every plot of a report, suite by suite.
pub(crate) fn render_all(m: &Model<'_>) -> Result<Vec<Plot>> {
    let mut plots = Vec::new();
    for (i, suite) in m.suites.iter().enumerate() {
        let mut add = |file: &str, alt: String, svg: String| {
            plots.push(Plot { suite: i, name: format!("{}-{file}", suite.stem), alt, svg })
        };
        let name = &suite.name;
        if suite.sweep {
            add(
                "time-vs-n.svg",
                format!("Suite {name}: median time against N, log-log, one line per implementation"),
                time(m, suite)?,
            );
            if suite.columns.iter().flat_map(|c| c.cells.iter().flatten()).any(|s| s.peak_device_bytes.is_some()) {
                add(
                    "memory-vs-n.svg",
                    format!("Suite {name}: peak device memory against N, log-log"),
                    memory(m, suite)?,
                );
            }
        } else {
            add("time.svg", format!("Suite {name}: median time per shape, log scale"), time(m, suite)?);
        }
        let pairs = suite.pairs(m);
        if !pairs.is_empty() {
            add(
                "speedup.svg",
                format!(
                    "Suite {name}: speedup per shape over anchors and baselines of the same formulation and precision"
                ),
                speedup(m, suite, &pairs)?,
            );
        }
        let floor_file = if suite.sweep { "floor-vs-n.svg" } else { "floor.svg" };
        let floor_alt =
            if suite.sweep { "time over floor against N, log-log" } else { "time over floor per shape, log scale" };
        add(floor_file, format!("Suite {name}: {floor_alt}"), floor_ratio(suite)?);
    }
    Ok(plots)
}

/// Key labels and positions: `N=768` / `B=1 C=128` in key order, or `N=4096` at log2 N.
fn keys(suite: &Suite<'_>) -> Vec<(String, String, f64)> {
    suite
        .first
        .iter()
        .enumerate()
        .map(|(k, s)| {
            if suite.sweep {
                (format!("N={}", s.n), String::new(), (s.n as f64).log2())
            } else {
                (format!("N={}", s.n), format!("B={} C={}", s.batch, s.c), k as f64)
            }
        })
        .collect()
}

fn sweep_desc(suite: &Suite<'_>) -> Option<String> {
    let s = suite.first.first()?;
    suite.sweep.then(|| format!("N (log scale); B = {}, C = {}", s.batch, s.c))
}

fn run_series(suite: &Suite<'_>, m: &Model<'_>, value: impl Fn(&ShapeResult) -> Option<f64>) -> Vec<Series> {
    suite
        .columns
        .iter()
        .enumerate()
        .map(|(c, col)| Series {
            title: col.name.clone(),
            subtitle: Some(m.runs[col.runs[0]].machine.device.clone()),
            look: Look::Run(c),
            values: col.cells.iter().map(|s| s.and_then(&value)).collect(),
            marks: col.cells.iter().map(|s| s.map_or(Mark::Plain, Mark::of)).collect(),
        })
        .collect()
}

fn time(m: &Model<'_>, suite: &Suite<'_>) -> Result<String> {
    let mut series = run_series(suite, m, |s| Some(s.median_ms));
    let all: Vec<usize> = (0..suite.columns.len()).collect();
    for (i, a) in suite.anchors_for(m, &all).into_iter().enumerate() {
        let anchor = &m.anchors[a];
        series.push(Series {
            title: anchor.name.clone(),
            subtitle: anchor.class().map(|(f, p)| format!("{f} {p}")),
            look: Look::Anchor(i),
            values: (0..suite.keys.len()).map(|k| suite.anchor_value(m, a, k)).collect(),
            marks: vec![Mark::Plain; suite.keys.len()],
        });
    }
    draw(&Figure {
        title: if suite.sweep {
            format!("Suite {}: median time against N (lower is better)", suite.name)
        } else {
            format!("Suite {}: median time per shape (lower is better)", suite.name)
        },
        y_desc: "median time per call (ms, log scale)",
        x_desc: sweep_desc(suite),
        keys: keys(suite),
        sweep: suite.sweep,
        kind: Kind::Lines,
        series,
        unit_line: None,
        hlines: Vec::new(),
        headings: ("Runs", "Anchors (copied, not measured here)"),
    })
}

fn memory(m: &Model<'_>, suite: &Suite<'_>) -> Result<String> {
    const GIB: f64 = (1u64 << 30) as f64;
    let series = run_series(suite, m, |s| s.peak_device_bytes.map(|b| b as f64 / GIB));
    let mut hlines: Vec<(f64, String)> = Vec::new();
    for col in &suite.columns {
        let mc = &m.runs[col.runs[0]].machine;
        let v = mc.memory_bytes as f64 / GIB;
        if mc.memory_bytes > 0 && !hlines.iter().any(|(h, _)| *h == v) {
            hlines.push((v, format!("{}: {}", mc.device, fmt_bytes(mc.memory_bytes))));
        }
    }
    draw(&Figure {
        title: format!("Suite {}: peak device memory against N", suite.name),
        y_desc: "peak device memory (GiB, log scale)",
        x_desc: sweep_desc(suite),
        keys: keys(suite),
        sweep: true,
        kind: Kind::Lines,
        series,
        unit_line: None,
        hlines,
        headings: ("Runs", "Anchors"),
    })
}

fn speedup(m: &Model<'_>, suite: &Suite<'_>, pairs: &[Pair]) -> Result<String> {
    let series = pairs
        .iter()
        .enumerate()
        .map(|(i, &pair)| Series {
            title: format!("vs {}", suite.against_name(m, pair.1)),
            subtitle: Some(suite.columns[pair.0].name.clone()),
            look: Look::Bar(i),
            values: (0..suite.keys.len()).map(|k| suite.ratio(m, pair, k)).collect(),
            marks: vec![Mark::Plain; suite.keys.len()],
        })
        .collect();
    draw(&Figure {
        title: format!("Suite {}: speedup, like with like (higher is better)", suite.name),
        y_desc: "other time / run time (log scale)",
        x_desc: None,
        keys: suite
            .first
            .iter()
            .enumerate()
            .map(|(k, s)| (format!("N={}", s.n), format!("B={} C={}", s.batch, s.c), k as f64))
            .collect(),
        sweep: false,
        kind: Kind::Bars,
        series,
        unit_line: Some(("1×: as fast; above: the run is faster", false)),
        hlines: Vec::new(),
        headings: ("Run (below) against", ""),
    })
}

fn floor_ratio(suite: &Suite<'_>) -> Result<String> {
    let series = suite
        .columns
        .iter()
        .enumerate()
        .map(|(c, col)| Series {
            title: col.name.clone(),
            subtitle: None,
            look: Look::Run(c),
            values: col.cells.iter().map(|s| s.map(|s| s.floor_ratio)).collect(),
            marks: col.cells.iter().map(|s| s.map_or(Mark::Plain, Mark::of)).collect(),
        })
        .collect();
    draw(&Figure {
        title: format!("Suite {}: time over the device's floor (1 = as fast as the hardware allows)", suite.name),
        y_desc: "median time / floor (log scale)",
        x_desc: sweep_desc(suite),
        keys: keys(suite),
        sweep: suite.sweep,
        kind: Kind::Lines,
        series,
        unit_line: Some(("floor: below is impossible", true)),
        hlines: Vec::new(),
        headings: ("Runs", ""),
    })
}

fn plot_err(e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("drawing a report plot failed: {e}"))
}

/// A value's place on a log axis: positive and finite, held within 1e-9 .. 1e9 so that the axis
/// spans a bounded number of decades whatever a file holds.
fn on_log_axis(v: Option<f64>) -> Option<f64> {
    v.filter(|v| v.is_finite() && *v > 0.0).map(|v| v.clamp(1e-9, 1e9))
}

/// The y range: whole decades around the data, so the axis has a labelled decade at each end.
/// Plots with a line at 1 (floor, speedup) instead start a little under their lowest point or
/// 0.7, whichever is lower, so what lies below 1 shows as a strip rather than a wasted decade.
fn y_range(fig: &Figure<'_>) -> (f64, f64) {
    let vals = fig
        .series
        .iter()
        .flat_map(|s| s.values.iter().copied().filter_map(on_log_axis))
        .chain(fig.hlines.iter().filter_map(|(v, _)| on_log_axis(Some(*v))))
        .chain(fig.unit_line.map(|_| 1.0));
    let (lo, hi) = vals.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !(lo.is_finite() && hi > 0.0) {
        return (0.1, 10.0);
    }
    // A little air so a marker near a decade line is not cut by the frame.
    let air = 1.04;
    let hi = 10f64.powf((hi * air).log10().ceil());
    let lo = if fig.unit_line.is_some() { (lo / 1.4).min(0.7) } else { 10f64.powf((lo / air).log10().floor()) };
    // Nudge the bounds out by a hair: plotters labels decades from ceil(log10(lo)), and rounding
    // in log10 would otherwise drop the bottom label.
    (lo * (1.0 - 1e-9), hi * (1.0 + 1e-9))
}

/// Tick label for a log axis value: `0.05`, `0.2`, `1`, `500`, `20000`.
fn log_tick(v: f64) -> String {
    if !(v.is_finite() && v > 0.0) {
        return String::new();
    }
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        let decimals = (-v.log10() - 1e-9).ceil().max(0.0) as usize;
        format!("{v:.decimals$}")
    }
}

/// Cuts a label that would run out of the legend panel.
fn clip(s: &str, max_chars: usize) -> String {
    if s.chars().count() <= max_chars {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max_chars - 1).collect();
        t.push('…');
        t
    }
}

/// Legend rows in pixels: a heading per section, two lines per series with a subtitle, and a
/// row per marker kind in use.
fn legend_height(fig: &Figure<'_>) -> u32 {
    let rows: u32 = fig.series.iter().map(|s| if s.subtitle.is_some() { 42 } else { 26 }).sum();
    rows.saturating_add(2 * 36).saturating_add(3 * 26)
}

fn draw(fig: &Figure<'_>) -> Result<String> {
    let n = fig.keys.len().max(1);
    let n32 = u32::try_from(n).unwrap_or(u32::MAX);
    let plot_w = if fig.sweep {
        SWEEP_W
    } else {
        let bars = if fig.kind == Kind::Bars {
            u32::try_from(fig.series.len()).unwrap_or(u32::MAX).saturating_mul(PER_BAR_W).saturating_add(24)
        } else {
            0
        };
        PER_SHAPE_W.max(bars).saturating_mul(n32).saturating_add(110).max(680)
    };
    let height = PLOT_H.max(legend_height(fig).saturating_add(130));
    let width = plot_w.saturating_add(LEGEND_W);

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        // The title is drawn by hand, centred by the SVG viewer (text-anchor middle): plotters'
        // own caption centres by a character-count estimate of the width, which drifts.
        let title = TextStyle::from((FONT, 24).into_font()).color(&TEXT).pos(Pos::new(HPos::Center, VPos::Top));
        root.draw(&Text::new(fig.title.as_str(), (width as i32 / 2, 14), title)).map_err(plot_err)?;
        let (main, legend) = root.margin(48, 0, 0, 0).split_horizontally(plot_w);
        draw_chart(fig, &root, &main)?;
        draw_legend(fig, &legend)?;
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

/// The x range: categories at 0..n with half a step of air, or log2 N with some air.
fn x_range(fig: &Figure<'_>) -> (f64, f64) {
    if !fig.sweep {
        return (-0.5, fig.keys.len().max(1) as f64 - 0.5);
    }
    let (lo, hi) = fig.keys.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), k| (lo.min(k.2), hi.max(k.2)));
    if !(lo.is_finite() && hi.is_finite()) {
        return (-0.5, 0.5);
    }
    let air = ((hi - lo) * 0.08).max(0.35);
    (lo - air, hi + air)
}

fn draw_chart<DB: DrawingBackend>(
    fig: &Figure<'_>,
    root: &DrawingArea<DB, Shift>,
    main: &DrawingArea<DB, Shift>,
) -> Result<()> {
    let (lo, hi) = y_range(fig);
    let (x0, x1) = x_range(fig);
    let mut chart = ChartBuilder::on(main)
        .margin_top(8)
        .margin_left(12)
        .margin_right(18)
        .margin_bottom(8)
        .x_label_area_size(if fig.x_desc.is_some() { 64 } else { 56 })
        .y_label_area_size(84)
        .build_cartesian_2d(x0..x1, (lo..hi).log_scale())
        .map_err(plot_err)?;

    // plotters labels the decades (its label count for a log axis is one per decade here);
    // the minor 2–9 ticks and their 2 and 5 labels are drawn below, by hand, because its own
    // minor ticks repeat the next decade's label.
    let decades = (hi / lo).log10().floor().clamp(1.0, 40.0) as usize;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_labels(decades + 1)
        .y_max_light_lines(0)
        .y_label_formatter(&|v| log_tick(*v))
        .y_desc(fig.y_desc)
        .bold_line_style(GRID_BOLD)
        .axis_style(SUBTEXT)
        .label_style((FONT, 16).into_font().color(&TEXT))
        .axis_desc_style((FONT, 17).into_font().color(&TEXT))
        .draw()
        .map_err(plot_err)?;

    if let Some((_, true)) = fig.unit_line {
        let below = Rectangle::new([(x0, lo), (x1, 1.0)], RGBColor(238, 238, 238).filled());
        chart.draw_series(std::iter::once(below)).map_err(plot_err)?;
    }

    // Minor grid at 2..9 × 10^e while there are few decades; with many, it would be a smear.
    if (hi / lo).log10() <= 3.5 {
        let tick_label =
            TextStyle::from((FONT, 14).into_font()).color(&SUBTEXT).pos(Pos::new(HPos::Right, VPos::Center));
        let first = lo.log10().floor() as i32;
        let last = hi.log10().ceil() as i32;
        for e in first..=last {
            for m in 2..=9 {
                let v = f64::from(m) * 10f64.powi(e);
                if v <= lo || v >= hi {
                    continue;
                }
                chart.draw_series(LineSeries::new([(x0, v), (x1, v)], GRID.stroke_width(1))).map_err(plot_err)?;
                let (px, py) = chart.backend_coord(&(x0, v));
                root.draw(&PathElement::new(vec![(px - 3, py), (px, py)], SUBTEXT)).map_err(plot_err)?;
                if m == 2 || m == 5 {
                    root.draw(&Text::new(log_tick(v), (px - 8, py), tick_label.clone())).map_err(plot_err)?;
                }
            }
        }
    }

    let note = TextStyle::from((FONT, 15).into_font()).color(&SUBTEXT).pos(Pos::new(HPos::Right, VPos::Bottom));
    for (v, label) in &fig.hlines {
        let Some(v) = on_log_axis(Some(*v)) else { continue };
        chart
            .draw_series(DashedLineSeries::new([(x0, v), (x1, v)], 9, 6, SUBTEXT.stroke_width(2)))
            .map_err(plot_err)?;
        let at = chart.backend_coord(&(x1, v));
        root.draw(&Text::new(clip(label, 60), (at.0 - 6, at.1 - 4), note.clone())).map_err(plot_err)?;
    }

    if let Some((label, _)) = fig.unit_line {
        chart.draw_series(LineSeries::new([(x0, 1.0), (x1, 1.0)], TEXT.stroke_width(2))).map_err(plot_err)?;
        // Under the line, where neither bars (which rise from it) nor the floor plot's points go.
        let at = chart.backend_coord(&(x1, 1.0));
        let style = TextStyle::from((FONT, 15).into_font()).color(&SUBTEXT).pos(Pos::new(HPos::Right, VPos::Top));
        root.draw(&Text::new(label, (at.0 - 6, at.1 + 5), style)).map_err(plot_err)?;
    }

    match fig.kind {
        Kind::Lines => draw_lines(fig, root, &mut chart)?,
        Kind::Bars => draw_bars(fig, &mut chart)?,
    }

    // Key labels under the axis: two lines per shape, or N under its position.
    let label = TextStyle::from((FONT, 16).into_font()).color(&TEXT).pos(Pos::new(HPos::Center, VPos::Top));
    let sub = TextStyle::from((FONT, 15).into_font()).color(&SUBTEXT).pos(Pos::new(HPos::Center, VPos::Top));
    let mut bottom = 0;
    for (l1, l2, x) in &fig.keys {
        let (px, py) = chart.backend_coord(&(*x, lo));
        bottom = py;
        root.draw(&PathElement::new(vec![(px, py), (px, py + 5)], SUBTEXT)).map_err(plot_err)?;
        root.draw(&Text::new(l1.as_str(), (px, py + 9), label.clone())).map_err(plot_err)?;
        if !l2.is_empty() {
            root.draw(&Text::new(l2.as_str(), (px, py + 28), sub.clone())).map_err(plot_err)?;
        }
    }
    if let Some(desc) = &fig.x_desc {
        let (left, _) = chart.backend_coord(&(x0, lo));
        let (right, _) = chart.backend_coord(&(x1, lo));
        let style = TextStyle::from((FONT, 17).into_font()).color(&TEXT).pos(Pos::new(HPos::Center, VPos::Top));
        root.draw(&Text::new(desc.as_str(), ((left + right) / 2, bottom + 34), style)).map_err(plot_err)?;
    }
    Ok(())
}

type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<plotters::coord::types::RangedCoordf64, LogCoord<f64>>>;

fn draw_lines<DB: DrawingBackend>(
    fig: &Figure<'_>,
    root: &DrawingArea<DB, Shift>,
    chart: &mut Chart<'_, DB>,
) -> Result<()> {
    // Anchors first so the runs are drawn on top of them.
    let mut order: Vec<&Series> = fig.series.iter().filter(|s| matches!(s.look, Look::Anchor(_))).collect();
    order.extend(fig.series.iter().filter(|s| !matches!(s.look, Look::Anchor(_))));
    for s in order {
        let color = s.look.color();
        let mut points: Vec<Option<(f64, f64, Mark)>> = s
            .values
            .iter()
            .zip(&fig.keys)
            .zip(&s.marks)
            .map(|((v, key), mark)| on_log_axis(*v).map(|v| (key.2, v, *mark)))
            .collect();
        let segments: Vec<Vec<(f64, f64)>> = if fig.sweep {
            // Against N every measured point joins the line, in N order.
            let mut all: Vec<(f64, f64, Mark)> = points.iter().flatten().copied().collect();
            all.sort_by(|a, b| a.0.total_cmp(&b.0));
            points = all.iter().copied().map(Some).collect();
            vec![all.iter().map(|p| (p.0, p.1)).collect()]
        } else {
            // On a shape axis, consecutive present points form one segment; a gap breaks it.
            points.split(Option::is_none).map(|seg| seg.iter().flatten().map(|p| (p.0, p.1)).collect()).collect()
        };
        for seg in segments.into_iter().filter(|seg| seg.len() >= 2) {
            match s.look {
                Look::Anchor(_) => {
                    chart.draw_series(DashedLineSeries::new(seg, 7, 5, color.stroke_width(2))).map_err(plot_err)?;
                }
                _ => {
                    chart.draw_series(LineSeries::new(seg, color.stroke_width(3))).map_err(plot_err)?;
                }
            }
        }
        for &(x, y, mark) in points.iter().flatten() {
            let at = chart.backend_coord(&(x, y));
            root.draw(&marker(s.look, mark, at)).map_err(plot_err)?;
        }
    }
    Ok(())
}

/// Bars from 1× to each value, the series side by side within a shape's slot.
fn draw_bars<DB: DrawingBackend>(fig: &Figure<'_>, chart: &mut Chart<'_, DB>) -> Result<()> {
    let count = fig.series.len().max(1) as f64;
    let slot = 0.8 / count;
    for (i, s) in fig.series.iter().enumerate() {
        let color = s.look.color();
        for (k, v) in s.values.iter().enumerate() {
            let Some(v) = on_log_axis(*v) else { continue };
            let left = k as f64 - 0.4 + slot * i as f64 + slot * 0.1;
            let right = left + slot * 0.8;
            let bar = Rectangle::new([(left, 1.0), (right, v)], color.filled());
            chart.draw_series(std::iter::once(bar)).map_err(plot_err)?;
        }
    }
    Ok(())
}

/// A marker in pixel coordinates: filled shapes with a white rim for runs (a dot, a square in
/// place, a triangle under a budget), a hollow shape per anchor (cycling so neighbours differ
/// even where colours are close), a square for a bar.
fn marker<'a, DB: DrawingBackend + 'a>(look: Look, mark: Mark, at: (i32, i32)) -> DynElement<'a, DB, (i32, i32)> {
    let c = look.color();
    match look {
        Look::Run(_) => match mark {
            Mark::Plain => {
                (EmptyElement::at(at) + Circle::new((0, 0), 6, WHITE.filled()) + Circle::new((0, 0), 4, c.filled()))
                    .into_dyn()
            }
            Mark::InPlace => (EmptyElement::at(at)
                + Rectangle::new([(-6, -6), (6, 6)], WHITE.filled())
                + Rectangle::new([(-4, -4), (4, 4)], c.filled()))
            .into_dyn(),
            Mark::Budget => (EmptyElement::at(at)
                + TriangleMarker::new((0, 0), 8, WHITE.filled())
                + TriangleMarker::new((0, 0), 6, c.filled()))
            .into_dyn(),
        },
        Look::Bar(_) => (EmptyElement::at(at) + Rectangle::new([(-6, -6), (6, 6)], c.filled())).into_dyn(),
        Look::Anchor(i) => match i % 4 {
            0 => (EmptyElement::at(at)
                + Circle::new((0, 0), 4, WHITE.filled())
                + Circle::new((0, 0), 4, c.stroke_width(2)))
            .into_dyn(),
            1 => (EmptyElement::at(at)
                + TriangleMarker::new((0, 0), 5, WHITE.filled())
                + TriangleMarker::new((0, 0), 5, c.stroke_width(2)))
            .into_dyn(),
            2 => (EmptyElement::at(at)
                + Rectangle::new([(-4, -4), (4, 4)], WHITE.filled())
                + Rectangle::new([(-4, -4), (4, 4)], c.stroke_width(2)))
            .into_dyn(),
            _ => (EmptyElement::at(at) + Cross::new((0, 0), 4, c.stroke_width(2))).into_dyn(),
        },
    }
}

fn draw_legend<DB: DrawingBackend>(fig: &Figure<'_>, area: &DrawingArea<DB, Shift>) -> Result<()> {
    let head = TextStyle::from((FONT, 17).into_font().style(FontStyle::Bold)).color(&TEXT);
    let main = TextStyle::from((FONT, 16).into_font()).color(&TEXT).pos(Pos::new(HPos::Left, VPos::Center));
    let sub = TextStyle::from((FONT, 15).into_font()).color(&SUBTEXT).pos(Pos::new(HPos::Left, VPos::Center));
    let (x0, x1) = (10, 48);
    let mut y = 20;
    let mut section = None;
    for s in &fig.series {
        let is_anchor = matches!(s.look, Look::Anchor(_));
        if section != Some(is_anchor) {
            if section.is_some() {
                y += 10;
            }
            let heading = if is_anchor { fig.headings.1 } else { fig.headings.0 };
            if !heading.is_empty() {
                area.draw(&Text::new(heading, (8, y), head.clone())).map_err(plot_err)?;
                y += 26;
            }
            section = Some(is_anchor);
        }
        let c = s.look.color();
        match s.look {
            Look::Run(_) => {
                area.draw(&PathElement::new(vec![(x0, y), (x1, y)], c.stroke_width(3))).map_err(plot_err)?;
            }
            Look::Anchor(_) => {
                area.draw(&DashedPathElement::new(vec![(x0, y), (x1, y)], 7, 5, c.stroke_width(2)))
                    .map_err(plot_err)?;
            }
            Look::Bar(_) => {}
        }
        area.draw(&marker(s.look, Mark::Plain, ((x0 + x1) / 2, y))).map_err(plot_err)?;
        area.draw(&Text::new(clip(&s.title, 40), (x1 + 10, y), main.clone())).map_err(plot_err)?;
        match &s.subtitle {
            Some(t) => {
                area.draw(&Text::new(clip(t, 42), (x1 + 10, y + 17), sub.clone())).map_err(plot_err)?;
                y += 42;
            }
            None => y += 26,
        }
    }
    // What the run markers other than dots mean, when the plot has them.
    let used = |m: Mark| fig.series.iter().any(|s| matches!(s.look, Look::Run(_)) && s.marks.contains(&m));
    let notes = [(Mark::InPlace, "ran in place (y over x)"), (Mark::Budget, "ran under a memory budget")];
    let mut first = true;
    for (mark, text) in notes {
        if !used(mark) {
            continue;
        }
        if first {
            y += 10;
            first = false;
        }
        area.draw(&marker(Look::Run(0), mark, ((x0 + x1) / 2, y))).map_err(plot_err)?;
        area.draw(&Text::new(text, (x1 + 10, y), main.clone())).map_err(plot_err)?;
        y += 26;
    }
    Ok(())
}
