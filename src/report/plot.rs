//! SVG plots of a report, drawn with `plotters`' SVG backend (text is emitted as SVG `<text>`,
//! so no font files are needed and the output is the same on every machine).
//!
//! Both plots put the shapes on a categorical x axis in the report's order and time on a log
//! y axis, because the shapes span two to three orders of magnitude in work and a CPU run may
//! sit three more above a GPU one. Runs are solid lines with filled dots; anchors are dashed
//! lines with hollow markers. A run missing a shape leaves a gap in its line rather than
//! bridging it. The legend sits in its own panel to the right so it never hides data.

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::Model;
use crate::error::{Error, Result};

/// File name of the time-per-shape plot.
pub const TIME_SVG: &str = "time_per_shape.svg";
/// File name of the time-over-floor plot.
pub const FLOOR_SVG: &str = "floor_ratio.svg";

const FONT: &str = "sans-serif";
const LEGEND_W: u32 = 360;
const PLOT_H: u32 = 560;
/// Horizontal room per shape: enough for a two-line label such as `N=1024` / `B=1 C=384`.
const PER_SHAPE_W: u32 = 92;

/// Runs: strong, distinct colours (Tableau 10's first five, then more).
const RUN_COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];
/// Anchors: muted colours that stay behind the runs.
const ANCHOR_COLORS: [RGBColor; 8] = [
    RGBColor(127, 127, 127),
    RGBColor(166, 118, 29),
    RGBColor(188, 128, 189),
    RGBColor(102, 166, 30),
    RGBColor(77, 77, 77),
    RGBColor(158, 188, 218),
    RGBColor(0, 139, 139),
    RGBColor(117, 112, 179),
];
const GRID: RGBColor = RGBColor(232, 232, 232);
const GRID_BOLD: RGBColor = RGBColor(205, 205, 205);
const TEXT: RGBColor = RGBColor(40, 40, 40);
const SUBTEXT: RGBColor = RGBColor(110, 110, 110);

#[derive(Copy, Clone)]
enum Look {
    Run(usize),
    Anchor(usize),
}

impl Look {
    fn color(self) -> RGBColor {
        match self {
            Look::Run(i) => RUN_COLORS[i % RUN_COLORS.len()],
            Look::Anchor(i) => ANCHOR_COLORS[i % ANCHOR_COLORS.len()],
        }
    }
}

struct Series {
    title: String,
    subtitle: Option<String>,
    look: Look,
    /// One value per shape key; `None` (or a value that cannot sit on a log axis) is a gap.
    values: Vec<Option<f64>>,
}

struct Figure<'a> {
    title: &'a str,
    y_desc: &'a str,
    keys: Vec<(String, String)>,
    series: Vec<Series>,
    /// Draw the `y = 1` floor line and shade what lies below it.
    floor_line: bool,
}

/// Both plots of a report, as `(file name, SVG)`.
pub(crate) fn render_all(m: &Model<'_>) -> Result<Vec<(String, String)>> {
    Ok(vec![(TIME_SVG.to_string(), time_per_shape(m)?), (FLOOR_SVG.to_string(), floor_ratio(m)?)])
}

fn run_series(m: &Model<'_>, value: impl Fn(&super::ShapeResult) -> f64) -> Vec<Series> {
    (0..m.runs.len())
        .map(|r| {
            let run = &m.runs[r];
            Series {
                title: format!("{} · {}", m.run_name(r), run.precision),
                subtitle: Some(run.machine.device.clone()),
                look: Look::Run(r),
                values: (0..m.keys.len()).map(|k| m.cells[k][r].map(&value)).collect(),
            }
        })
        .collect()
}

/// Two label lines per shape: `N=768` and `B=1 C=128`.
fn key_labels(m: &Model<'_>) -> Vec<(String, String)> {
    (0..m.keys.len())
        .map(|k| match m.first(k) {
            Some(s) => (format!("N={}", s.n), format!("B={} C={}", s.batch, s.c)),
            None => (m.keys[k].clone(), String::new()),
        })
        .collect()
}

fn time_per_shape(m: &Model<'_>) -> Result<String> {
    let mut series = run_series(m, |s| s.median_ms);
    for (i, a) in m.anchors.iter().enumerate() {
        series.push(Series {
            title: a.name.clone(),
            subtitle: None,
            look: Look::Anchor(i),
            values: m.keys.iter().map(|k| a.shapes.get(k).copied()).collect(),
        });
    }
    draw(&Figure {
        title: "Median time per shape (lower is better)",
        y_desc: "median time per call (ms, log scale)",
        keys: key_labels(m),
        series,
        floor_line: false,
    })
}

fn floor_ratio(m: &Model<'_>) -> Result<String> {
    draw(&Figure {
        title: "Time over the device's floor (1 = as fast as the hardware allows)",
        y_desc: "median time / floor (log scale)",
        keys: key_labels(m),
        series: run_series(m, |s| s.floor_ratio),
        floor_line: true,
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
/// The floor plot instead starts a little under its lowest point or 0.7, whichever is lower, so
/// the impossible region below 1 shows as a strip rather than a wasted decade.
fn y_range(fig: &Figure<'_>) -> (f64, f64) {
    let vals = fig.series.iter().flat_map(|s| s.values.iter().copied().filter_map(on_log_axis));
    let (lo, hi) = vals.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !(lo.is_finite() && hi > 0.0) {
        return (0.1, 10.0);
    }
    // A little air so a marker near a decade line is not cut by the frame.
    let air = 1.04;
    let hi = if fig.floor_line { hi.max(1.0) } else { hi };
    let hi = 10f64.powf((hi * air).log10().ceil());
    let lo = if fig.floor_line { (lo / 1.4).min(0.7) } else { 10f64.powf((lo / air).log10().floor()) };
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

fn draw(fig: &Figure<'_>) -> Result<String> {
    let n = fig.keys.len().max(1);
    let plot_w = PER_SHAPE_W.saturating_mul(u32::try_from(n).unwrap_or(u32::MAX)).saturating_add(110).max(680);
    let legend_rows: u32 = fig.series.iter().map(|s| if s.subtitle.is_some() { 42 } else { 26 }).sum();
    let height = PLOT_H.max(legend_rows.saturating_add(130));
    let width = plot_w.saturating_add(LEGEND_W);

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        // The title is drawn by hand, centred by the SVG viewer (text-anchor middle): plotters'
        // own caption centres by a character-count estimate of the width, which drifts.
        let title = TextStyle::from((FONT, 24).into_font()).color(&TEXT).pos(Pos::new(HPos::Center, VPos::Top));
        root.draw(&Text::new(fig.title, (width as i32 / 2, 14), title)).map_err(plot_err)?;
        let (main, legend) = root.margin(48, 0, 0, 0).split_horizontally(plot_w);
        draw_chart(fig, &root, &main, n)?;
        draw_legend(fig, &legend)?;
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

fn draw_chart<DB: DrawingBackend>(
    fig: &Figure<'_>,
    root: &DrawingArea<DB, Shift>,
    main: &DrawingArea<DB, Shift>,
    n: usize,
) -> Result<()> {
    let (lo, hi) = y_range(fig);
    let (x0, x1) = (-0.5f64, n as f64 - 0.5);
    let mut chart = ChartBuilder::on(main)
        .margin_top(8)
        .margin_left(12)
        .margin_right(18)
        .margin_bottom(8)
        .x_label_area_size(56)
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

    if fig.floor_line {
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

    if fig.floor_line {
        chart.draw_series(LineSeries::new([(x0, 1.0), (x1, 1.0)], TEXT.stroke_width(2))).map_err(plot_err)?;
        let label_at = chart.backend_coord(&(x1, 1.0));
        let style = TextStyle::from((FONT, 15).into_font()).color(&SUBTEXT).pos(Pos::new(HPos::Right, VPos::Top));
        root.draw(&Text::new("floor: below is impossible", (label_at.0 - 6, label_at.1 + 5), style))
            .map_err(plot_err)?;
    }

    // Anchors first so the runs are drawn on top of them.
    let mut order: Vec<&Series> = fig.series.iter().filter(|s| matches!(s.look, Look::Anchor(_))).collect();
    order.extend(fig.series.iter().filter(|s| matches!(s.look, Look::Run(_))));
    for s in order {
        let color = s.look.color();
        let points: Vec<Option<(f64, f64)>> =
            s.values.iter().enumerate().map(|(k, v)| on_log_axis(*v).map(|v| (k as f64, v))).collect();
        // Consecutive present points form one segment; a missing shape breaks the line.
        for seg in points.split(Option::is_none) {
            let seg: Vec<(f64, f64)> = seg.iter().flatten().copied().collect();
            if seg.len() < 2 {
                continue;
            }
            match s.look {
                Look::Run(_) => {
                    chart.draw_series(LineSeries::new(seg, color.stroke_width(3))).map_err(plot_err)?;
                }
                Look::Anchor(_) => {
                    chart.draw_series(DashedLineSeries::new(seg, 7, 5, color.stroke_width(2))).map_err(plot_err)?;
                }
            }
        }
        for &(x, y) in points.iter().flatten() {
            let at = chart.backend_coord(&(x, y));
            root.draw(&marker(s.look, at)).map_err(plot_err)?;
        }
    }

    // Shape labels, two lines each, centred under their category.
    let label = TextStyle::from((FONT, 16).into_font()).color(&TEXT).pos(Pos::new(HPos::Center, VPos::Top));
    let sub = TextStyle::from((FONT, 15).into_font()).color(&SUBTEXT).pos(Pos::new(HPos::Center, VPos::Top));
    for (k, (l1, l2)) in fig.keys.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(k as f64, lo));
        root.draw(&PathElement::new(vec![(x, y), (x, y + 5)], SUBTEXT)).map_err(plot_err)?;
        root.draw(&Text::new(l1.as_str(), (x, y + 9), label.clone())).map_err(plot_err)?;
        root.draw(&Text::new(l2.as_str(), (x, y + 28), sub.clone())).map_err(plot_err)?;
    }
    Ok(())
}

/// A marker in pixel coordinates: filled dots with a white rim for runs, a hollow shape per
/// anchor (cycling so neighbours differ even where colours are close).
fn marker<'a, DB: DrawingBackend + 'a>(look: Look, at: (i32, i32)) -> DynElement<'a, DB, (i32, i32)> {
    let c = look.color();
    match look {
        Look::Run(_) => {
            (EmptyElement::at(at) + Circle::new((0, 0), 6, WHITE.filled()) + Circle::new((0, 0), 4, c.filled()))
                .into_dyn()
        }
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
    let mut y = 20;
    let mut section = None;
    for s in &fig.series {
        let is_run = matches!(s.look, Look::Run(_));
        if section != Some(is_run) {
            if section.is_some() {
                y += 10;
            }
            let heading = if is_run { "Runs" } else { "Anchors (copied, not measured here)" };
            area.draw(&Text::new(heading, (8, y), head.clone())).map_err(plot_err)?;
            y += 26;
            section = Some(is_run);
        }
        let c = s.look.color();
        let (x0, x1) = (10, 48);
        if is_run {
            area.draw(&PathElement::new(vec![(x0, y), (x1, y)], c.stroke_width(3))).map_err(plot_err)?;
        } else {
            area.draw(&DashedPathElement::new(vec![(x0, y), (x1, y)], 7, 5, c.stroke_width(2))).map_err(plot_err)?;
        }
        area.draw(&marker(s.look, ((x0 + x1) / 2, y))).map_err(plot_err)?;
        area.draw(&Text::new(clip(&s.title, 40), (x1 + 10, y), main.clone())).map_err(plot_err)?;
        match &s.subtitle {
            Some(t) => {
                area.draw(&Text::new(clip(t, 42), (x1 + 10, y + 17), sub.clone())).map_err(plot_err)?;
                y += 42;
            }
            None => y += 26,
        }
    }
    Ok(())
}
