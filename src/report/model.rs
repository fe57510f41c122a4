//! The report's model: runs and anchors lined up by suite, shape and column, with the
//! like-with-like comparisons between them (`Class`, `Pair`) and the geometric mean that sums
//! them up. Both renderers (`markdown`, `plot`) read it; `render` in the parent builds it. It
//! imports the schema and the anchors, never the parent, so the parent may call the renderers
//! without an import circle.

use super::anchors::Anchor;
use super::schema::{BenchRun, ShapeResult, CLOCK_HELD};
use crate::error::{Error, Result};

/// A run's formulation and I/O precision: two times are comparable only when these match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Class {
    pub formulation: String,
    pub precision: String,
}

impl Class {
    /// Spelled as the CLI spells them (`gpumode`, `bf16-io`) where the run's text is one of the
    /// known names, else as written.
    fn of_run(run: &BenchRun) -> Class {
        let formulation = run.formulation.parse::<crate::problem::Formulation>();
        let precision = run.precision.parse::<crate::problem::Precision>();
        Class {
            formulation: formulation.map(|f| f.as_str().to_string()).unwrap_or_else(|_| run.formulation.trim().into()),
            precision: precision.map(|p| p.as_str().to_string()).unwrap_or_else(|_| run.precision.trim().into()),
        }
    }

    fn of_anchor(a: &Anchor) -> Option<Class> {
        a.class().map(|(formulation, precision)| Class { formulation, precision })
    }

    /// `gpumode f32-io`.
    pub fn label(&self) -> String {
        format!("{} {}", self.formulation, self.precision)
    }
}

/// Runs and anchors lined up by suite and shape: what both the markdown and the plots read.
pub(crate) struct Model<'a> {
    pub runs: &'a [BenchRun],
    pub anchors: &'a [Anchor],
    /// The run that speedups between runs of its suite and class are taken against.
    pub baseline: usize,
    /// One per suite, in the order their first runs were given.
    pub suites: Vec<Suite<'a>>,
}

/// The runs of one suite, merged into columns.
pub(crate) struct Suite<'a> {
    pub name: String,
    /// Whether some run did not record its suite, so that its membership was inferred.
    pub inferred: bool,
    /// A file-name-safe form of the name, unique among the suites, for the plots.
    pub stem: String,
    pub runs: Vec<usize>,
    /// Every shape key of the suite's runs, in first-appearance order.
    pub keys: Vec<String>,
    /// The first result for each key (mask, distribution, N, B, C, H come from it).
    pub first: Vec<&'a ShapeResult>,
    pub columns: Vec<Column<'a>>,
    /// Anchors with a time for at least one of `keys`.
    pub anchors: Vec<usize>,
    /// Every shape has the same B and C and there are at least two: the suite sweeps N, and
    /// is plotted against it.
    pub sweep: bool,
}

/// One column of a suite's tables and one line of its plots: a run, or several runs of the
/// same configuration whose shapes do not overlap (the long suite's in-place sizes are run
/// separately from the others).
pub(crate) struct Column<'a> {
    pub runs: Vec<usize>,
    pub class: Class,
    /// `cells[k]`: the result for the suite's `keys[k]`.
    pub cells: Vec<Option<&'a ShapeResult>>,
    pub name: String,
}

impl Column<'_> {
    pub fn has(&self, k: usize) -> bool {
        self.cells[k].is_some()
    }

    pub fn median(&self, k: usize) -> Option<f64> {
        self.cells[k].map(|s| s.median_ms)
    }
}

/// What a run column is compared with in a speedup.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Against {
    Anchor(usize),
    /// Another column of the same suite and class (the class's baseline).
    Column(usize),
}

/// `(column, against)`: `against`'s time / the column's time, like with like only.
pub(crate) type Pair = (usize, Against);

/// What a run is, for merging: runs that agree on all of it (and share no shape) are one column.
fn identity(run: &BenchRun) -> impl PartialEq + '_ {
    let budgets: Vec<Option<u64>> = run.shapes.iter().map(|s| s.memory_budget_bytes).collect();
    (
        run.label.as_deref().map(str::trim),
        run.backend.as_str(),
        run.machine.device.as_str(),
        Class::of_run(run),
        run.timing.fresh_weights,
        // Device time alone (`--device-time`) and events around calls on an idle GPU differ by the
        // host's time before the launches: each is its own line.
        run.timing.clock.as_str(),
        // One budget for the whole run (or none): a budgeted run is its own line.
        budgets.first().copied().flatten(),
    )
}

/// A suite name as part of a file name: lower-case letters, digits and `-`, at most 40.
fn stem_of(name: &str) -> String {
    let mut s: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).take(40).collect();
    while s.contains("--") {
        s = s.replace("--", "-");
    }
    let s = s.trim_matches('-').to_string();
    if s.is_empty() {
        "suite".into()
    } else {
        s
    }
}

impl<'a> Model<'a> {
    /// Lines `runs` and `anchors` up; `baseline` as in `render`. Fails on no runs, an invalid
    /// run or anchor, two anchors of one name, or a baseline out of range.
    pub(super) fn new(runs: &'a [BenchRun], anchors: &'a [Anchor], baseline: Option<usize>) -> Result<Model<'a>> {
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

        let mut order: Vec<String> = Vec::new();
        let mut members: Vec<(Vec<usize>, bool)> = Vec::new();
        for (r, run) in runs.iter().enumerate() {
            let (name, inferred) = run.suite_name();
            match order.iter().position(|n| *n == name) {
                Some(i) => {
                    members[i].0.push(r);
                    members[i].1 |= inferred;
                }
                None => {
                    order.push(name);
                    members.push((vec![r], inferred));
                }
            }
        }
        let mut stems: Vec<String> = Vec::new();
        let mut suites = Vec::new();
        for (name, (members, inferred)) in order.into_iter().zip(members) {
            let base = stem_of(&name);
            let mut stem = base.clone();
            let mut i = 2;
            while stems.contains(&stem) {
                stem = format!("{base}-{i}");
                i += 1;
            }
            stems.push(stem.clone());
            suites.push(Suite::new(runs, anchors, name, inferred, stem, members));
        }
        Ok(Model { runs, anchors, baseline, suites })
    }

    /// `#1 cuda · gpumode f32-io`, or `#1 <label> · gpumode f32-io`.
    pub fn run_name(&self, r: usize) -> String {
        run_name(self.runs, &[r])
    }
}

/// `#6+#7 cuda · gpumode f32-io`: run numbers, label (else backend), formulation, precision; and
/// the device (`#10 cuda on H200 · …`) where runs of one backend ran on different devices, so
/// that an H100 column and an H200 column are never read as the same thing.
fn run_name(runs: &[BenchRun], rs: &[usize]) -> String {
    let nums: Vec<String> = rs.iter().map(|r| format!("#{}", r + 1)).collect();
    let run = &runs[rs[0]];
    let who = match &run.label {
        Some(l) if !l.trim().is_empty() => l.trim().to_string(),
        _ => run.backend.clone(),
    };
    let (backend, device) = (&run.backend, &run.machine.device);
    let on = if runs.iter().any(|o| &o.backend == backend && &o.machine.device != device) {
        // `NVIDIA H200` → `H200`: the vendor is the backend's.
        let short = device.strip_prefix(run.machine.vendor.as_str()).map_or(device.as_str(), str::trim_start);
        format!(" on {short}")
    } else {
        String::new()
    };
    format!("{} {who}{on} · {}", nums.join("+"), Class::of_run(run).label())
}

impl<'a> Suite<'a> {
    fn new(
        runs: &'a [BenchRun],
        anchors: &[Anchor],
        name: String,
        inferred: bool,
        stem: String,
        members: Vec<usize>,
    ) -> Suite<'a> {
        let mut keys: Vec<String> = Vec::new();
        let mut first: Vec<&ShapeResult> = Vec::new();
        for &r in &members {
            for s in &runs[r].shapes {
                let k = s.key();
                if !keys.contains(&k) {
                    keys.push(k);
                    first.push(s);
                }
            }
        }
        // Runs merge into the first column they fit: same configuration, no shape in common.
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for &r in &members {
            let fits = |g: &Vec<usize>| {
                identity(&runs[g[0]]) == identity(&runs[r])
                    && g.iter()
                        .all(|&o| runs[o].shapes.iter().all(|s| runs[r].shapes.iter().all(|t| s.key() != t.key())))
            };
            match groups.iter_mut().find(|g| fits(g)) {
                Some(g) => g.push(r),
                None => groups.push(vec![r]),
            }
        }
        let columns: Vec<Column> = groups
            .into_iter()
            .map(|rs| {
                let cells = keys
                    .iter()
                    .map(|k| rs.iter().find_map(|&r| runs[r].shapes.iter().find(|s| &s.key() == k)))
                    .collect();
                Column { class: Class::of_run(&runs[rs[0]]), name: run_name(runs, &rs), runs: rs, cells }
            })
            .collect();
        let suite_anchors =
            (0..anchors.len()).filter(|&a| keys.iter().any(|k| anchors[a].shapes.contains_key(k))).collect();
        let sweep = first.len() >= 2 && first.iter().all(|s| (s.batch, s.c) == (first[0].batch, first[0].c));
        Suite { name, inferred, stem, runs: members, keys, first, columns, anchors: suite_anchors, sweep }
    }

    /// The classes of the columns, in first-appearance order.
    pub fn classes(&self) -> Vec<Class> {
        let mut v: Vec<Class> = Vec::new();
        for c in &self.columns {
            if !v.contains(&c.class) {
                v.push(c.class.clone());
            }
        }
        v
    }

    /// The columns of `class`.
    pub fn class_columns(&self, class: &Class) -> Vec<usize> {
        (0..self.columns.len()).filter(|&c| self.columns[c].class == *class).collect()
    }

    /// Keys every one of `cols` has.
    pub fn common_of(&self, cols: &[usize]) -> Vec<usize> {
        (0..self.keys.len()).filter(|&k| cols.iter().all(|&c| self.columns[c].has(k))).collect()
    }

    /// Keys column `c` has.
    pub fn keys_of(&self, c: usize) -> Vec<usize> {
        self.common_of(&[c])
    }

    /// Whether anchor `a` may be compared with column `c`: the same formulation and I/O
    /// precision, and the same device where the anchor names one.
    pub fn comparable(&self, m: &Model<'_>, c: usize, a: usize) -> bool {
        let anchor = &m.anchors[a];
        let col = &self.columns[c];
        Class::of_anchor(anchor).as_ref() == Some(&col.class)
            && anchor.device.as_deref().is_none_or(|d| col.runs.iter().all(|&r| same_device(&m.runs[r], d)))
            // Anchors are events around each call: not comparable with the device time alone.
            && col.runs.iter().all(|&r| m.runs[r].timing.clock != CLOCK_HELD)
    }

    /// Anchor `a`'s time for the suite's key `k`.
    pub fn anchor_value(&self, m: &Model<'_>, a: usize, k: usize) -> Option<f64> {
        m.anchors[a].shapes.get(&self.keys[k]).copied()
    }

    /// Anchors of this suite comparable with at least one of `cols`.
    pub fn anchors_for(&self, m: &Model<'_>, cols: &[usize]) -> Vec<usize> {
        self.anchors.iter().copied().filter(|&a| cols.iter().any(|&c| self.comparable(m, c, a))).collect()
    }

    /// The column speedups within `class` are taken against: the one holding the report's
    /// baseline run if it is of this class, else the class's first.
    pub fn baseline_of(&self, m: &Model<'_>, class: &Class) -> Option<usize> {
        let cols = self.class_columns(class);
        cols.iter().copied().find(|&c| self.columns[c].runs.contains(&m.baseline)).or(cols.first().copied())
    }

    /// Every like-with-like comparison of the suite: each column against the baseline of its
    /// class (when it is not that baseline) and against every comparable anchor; only pairs
    /// with at least one shape in common.
    pub fn pairs(&self, m: &Model<'_>) -> Vec<Pair> {
        let mut v = Vec::new();
        for (c, col) in self.columns.iter().enumerate() {
            if let Some(b) = self.baseline_of(m, &col.class).filter(|&b| b != c) {
                if !self.common_of(&[b, c]).is_empty() {
                    v.push((c, Against::Column(b)));
                }
            }
            for &a in &self.anchors {
                if self.comparable(m, c, a) && self.keys_of(c).iter().any(|&k| self.anchor_value(m, a, k).is_some()) {
                    v.push((c, Against::Anchor(a)));
                }
            }
        }
        v
    }

    /// `against`'s time / column `c`'s time for key `k`.
    pub fn ratio(&self, m: &Model<'_>, (c, against): Pair, k: usize) -> Option<f64> {
        let other = match against {
            Against::Anchor(a) => self.anchor_value(m, a, k)?,
            Against::Column(b) => self.columns[b].median(k)?,
        };
        Some(other / self.columns[c].median(k)?)
    }

    /// The keys a pair's geomean is over: those both sides have.
    pub fn pair_keys(&self, m: &Model<'_>, pair: Pair) -> Vec<usize> {
        (0..self.keys.len()).filter(|&k| self.ratio(m, pair, k).is_some()).collect()
    }

    /// The name of `against`.
    pub fn against_name(&self, m: &Model<'_>, against: Against) -> String {
        match against {
            Against::Anchor(a) => m.anchors[a].name.clone(),
            Against::Column(b) => self.columns[b].name.clone(),
        }
    }

    /// Names a set of keys: `all 7 shapes {whole}` (`both shapes {whole}`) when it is all of
    /// `within`, `N = 2048, 4096` in a sweep, else the keys.
    pub fn describe(&self, set: &[usize], within: &[usize], whole: &str) -> String {
        if set.is_empty() {
            return "no shape".into();
        }
        if set == within && set.len() > 1 {
            let all = if set.len() == 2 { "both shapes".to_string() } else { format!("all {} shapes", set.len()) };
            return if whole.is_empty() { all } else { format!("{all} {whole}") };
        }
        if self.sweep {
            let ns: Vec<String> = set.iter().map(|&k| self.first[k].n.to_string()).collect();
            return format!("N = {}", ns.join(", "));
        }
        set.iter().map(|&k| format!("`{}`", self.keys[k])).collect::<Vec<_>>().join(", ")
    }
}

/// Whether `run` ran on the device an anchor names (case and surrounding space ignored).
fn same_device(run: &BenchRun, device: &str) -> bool {
    run.machine.device.trim().eq_ignore_ascii_case(device.trim())
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
}
