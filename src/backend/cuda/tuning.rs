//! Per-shape kernel choices, measured rather than guessed.
//!
//! The CUDA backend has a few choices its built-in rules make the same way for every shape: which
//! of cuBLASLt's heuristic candidates runs the contraction (the first, unless told otherwise),
//! whether the output stage is the fused kernel or LN_H + the cuBLASLt GEMM, and whether an H100
//! runs the wgmma or the mma.sync build of the fused input kernel. `trimul tune` times every
//! combination on the device at hand, checks each against the f64 reference, and writes a
//! [`TuningTable`] with an entry only where a combination was both correct and faster than the
//! built-in choice by more than the noise. The backend applies the table embedded for its
//! architecture (`tuned-<arch>.json` beside this file), or the file named by
//! `TRIMUL_CUDA_TUNING`; shapes without an entry keep the rules, so every GPU has a working path.
//!
//! An entry applies only on the GPU model that measured it (`device`, as the driver names it):
//! two chips of one architecture differ in what wins (an H200 has an H100's SMs and 1.4× its
//! memory bandwidth, and sweeps on the two keep different entries: `docs/perf/NOTES.md`), so a
//! choice measured on one is not claimed for the other. Entries without a device (tables written
//! before entries named one) apply on every GPU of their architecture.

use std::path::Path;

use crate::error::{Error, Result};
use crate::problem::{Direction, Formulation, Problem};

/// One shape's choices. The default is the built-in rules.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Tuning {
    /// Rank of the cuBLASLt heuristic candidate that runs the contraction (0: its first choice).
    #[serde(default)]
    pub contraction_rank: u8,
    /// The fused output kernel on or off where it takes the shape (`None`: the rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fused_output: Option<bool>,
    /// The wgmma build of the fused input kernel on or off on sm_90 (`None`: on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warpgroup_mma: Option<bool>,
}

impl Tuning {
    /// The built-in rule for the fused output kernel in f32 I/O, where it takes the shape: af3
    /// always, gpumode at C ≤ 128 (at C = 384 cuBLASLt's GEMM beats reloading Wout per 128-column
    /// chunk; `docs/perf/NOTES.md`). 16-bit y has no other output path.
    pub fn fused_output_rule(problem: &Problem) -> bool {
        problem.config.c <= 128 || problem.config.formulation == Formulation::Af3
    }

    /// Whether this choice runs what the built-in rules run for `problem` (f32 I/O): cuBLASLt's
    /// first candidate, the rule's output path and the wgmma input build, each given or left to
    /// the rule. A sweep need not time such a choice twice.
    pub fn is_the_rules_for(&self, problem: &Problem) -> bool {
        self.contraction_rank == 0
            && self.fused_output.is_none_or(|on| on == Tuning::fused_output_rule(problem))
            && self.warpgroup_mma.is_none_or(|on| on)
    }
}

impl std::fmt::Display for Tuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let onoff = |v: Option<bool>| match v {
            None => "rule",
            Some(true) => "on",
            Some(false) => "off",
        };
        write!(
            f,
            "contraction candidate {}, fused output {}, wgmma input {}",
            self.contraction_rank,
            onoff(self.fused_output),
            onoff(self.warpgroup_mma)
        )
    }
}

/// A measured choice for one shape on one architecture.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TuningEntry {
    /// `sm_90`, as [`crate::DeviceInfo::arch`] spells it.
    pub arch: String,
    /// The GPU model that measured the entry, as [`crate::DeviceInfo::name`] spells it
    /// (`NVIDIA H100 80GB HBM3`); empty: any GPU of `arch`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub device: String,
    /// Formulation of the tuned shape.
    pub formulation: Formulation,
    /// Direction of the tuned shape.
    pub direction: Direction,
    /// Batch size B.
    pub batch: usize,
    /// Sequence length N.
    pub n: usize,
    /// Pair channels C.
    pub c: usize,
    /// Hidden channels H.
    pub h: usize,
    /// The choices measured fastest for this shape.
    pub choice: Tuning,
    /// Median ms of the choice and of the built-in rules, in the run that made the entry.
    pub ms: f64,
    /// Milliseconds with the built-in rules (for comparison).
    pub default_ms: f64,
}

impl TuningEntry {
    /// Whether the entry was measured for this GPU model and architecture.
    pub fn is_for(&self, arch: &str, device: &str) -> bool {
        self.arch == arch && (self.device.is_empty() || self.device == device)
    }

    fn shape(&self) -> (Formulation, Direction, usize, usize, usize, usize) {
        (self.formulation, self.direction, self.batch, self.n, self.c, self.h)
    }

    fn is_for_problem(&self, problem: &Problem) -> bool {
        let (config, shape) = (&problem.config, &problem.shape);
        self.shape() == (config.formulation, problem.direction, shape.batch, shape.n, config.c, config.h)
    }
}

/// The entries `trimul tune` wrote, with where they came from.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TuningTable {
    /// The device and tool version that measured the entries.
    #[serde(default)]
    pub measured_on: String,
    /// One entry per tuned shape.
    #[serde(default)]
    pub entries: Vec<TuningEntry>,
}

/// The tables shipped with the crate, per architecture.
const EMBEDDED: &[(&str, &str)] = &[("sm_90", include_str!("tuned-sm_90.json"))];

impl TuningTable {
    /// The table shipped for `arch` (empty when there is none).
    pub fn embedded(arch: &str) -> Result<TuningTable> {
        match EMBEDDED.iter().find(|(a, _)| *a == arch) {
            Some((_, text)) => Self::parse(text, &format!("the embedded tuning table for {arch}")),
            None => Ok(TuningTable::default()),
        }
    }

    /// Reads a table written by `trimul tune --out` (size-capped; errors name the file).
    pub fn from_file(path: &Path) -> Result<TuningTable> {
        // Bounded: TRIMUL_CUDA_TUNING=/dev/zero must not read until memory runs out.
        let text = crate::io::read_text(path, crate::io::MAX_JSON_BYTES, "tuning table")
            .map_err(|e| Error::InvalidArgument(format!("tuning table {e}")))?;
        Self::parse(&text, &format!("tuning table {}", path.display()))
    }

    fn parse(text: &str, what: &str) -> Result<TuningTable> {
        serde_json::from_str(text).map_err(|e| Error::InvalidArgument(format!("{what}: {e}")))
    }

    /// The measured choice for `problem` on GPU model `device` of architecture `arch`, if the
    /// table has one. An entry of this very GPU model wins over one without a device (an older
    /// table's).
    pub fn lookup(&self, arch: &str, device: &str, problem: &Problem) -> Option<Tuning> {
        let applies = |e: &&TuningEntry| e.is_for(arch, device) && e.is_for_problem(problem);
        let mut found = self.entries.iter().filter(applies);
        let first = found.next()?;
        Some(if first.device == device { first } else { found.find(|e| e.device == device).unwrap_or(first) }.choice)
    }

    /// Records a sweep's result for one shape on `measured`'s GPU model: replaces that model's
    /// entry for the shape, if any, with `measured` when `keep` (the choice won), or with nothing
    /// (the rules won). Other models' entries, and entries without a device, stay; where one of
    /// those would still apply to this model, a rules-won result is kept as an entry choosing the
    /// rules (`Tuning::default()`), which then wins over it.
    pub fn record(&mut self, mut measured: TuningEntry, keep: bool) {
        let (arch, shape) = (measured.arch.clone(), measured.shape());
        self.entries.retain(|e| !(e.arch == arch && e.device == measured.device && e.shape() == shape));
        let shadowed = self.entries.iter().any(|e| e.is_for(&arch, &measured.device) && e.shape() == shape);
        if !keep && shadowed {
            (measured.choice, measured.ms) = (Tuning::default(), measured.default_ms);
        }
        if keep || shadowed {
            self.entries.push(measured);
        }
    }

    /// The GPU models whose entries the table holds, as `NVIDIA H200 (sm_90)` (`any sm_90 GPU`
    /// for entries without a device), in order of first appearance.
    pub fn devices(&self) -> Vec<String> {
        let mut seen: Vec<String> = Vec::new();
        for e in &self.entries {
            let d =
                if e.device.is_empty() { format!("any {} GPU", e.arch) } else { format!("{} ({})", e.device, e.arch) };
            if !seen.contains(&d) {
                seen.push(d);
            }
        }
        seen
    }

    /// How many shapes the table tunes on GPU model `device` of architecture `arch` (a shape with
    /// both this model's entry and a device-less one counts once).
    pub fn entries_for(&self, arch: &str, device: &str) -> usize {
        let mut shapes: Vec<_> = self.entries.iter().filter(|e| e.is_for(arch, device)).map(|e| e.shape()).collect();
        shapes.sort_by_key(|&(f, d, b, n, c, h)| (f.as_str(), d.as_str(), b, n, c, h));
        shapes.dedup();
        shapes.len()
    }

    /// The table as the JSON `from_file` reads.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Config, Shape};

    #[test]
    fn embedded_tables_parse_and_name_their_arch() {
        for (arch, _) in EMBEDDED {
            let t = TuningTable::embedded(arch).unwrap();
            assert!(t.entries.iter().all(|e| e.arch == *arch), "{arch}: {t:?}");
            // Shipped entries name the GPU model that measured them (see the module docs).
            assert!(t.entries.iter().all(|e| !e.device.is_empty()), "{arch}: an entry without its GPU model");
            assert!(t.entries.iter().all(|e| e.ms < e.default_ms), "{arch}: an entry that did not win");
        }
        assert!(TuningTable::embedded("sm_75").unwrap().entries.is_empty());
    }

    /// The choices that run what the rules run, per formulation and width.
    #[test]
    fn the_rules_and_their_twins() {
        let problem =
            |f, c| Problem::new(Config::new(f, c, 128).unwrap(), Shape::new(1, 64), Direction::Outgoing, false);
        let (af3, narrow, wide) = (
            problem(Formulation::Af3, 384).unwrap(),
            problem(Formulation::GpuMode, 128).unwrap(),
            problem(Formulation::GpuMode, 384).unwrap(),
        );
        assert!(Tuning::fused_output_rule(&af3) && Tuning::fused_output_rule(&narrow));
        assert!(!Tuning::fused_output_rule(&wide));
        let t = |rank, fused_output, warpgroup_mma| Tuning { contraction_rank: rank, fused_output, warpgroup_mma };
        for p in [&af3, &narrow, &wide] {
            assert!(Tuning::default().is_the_rules_for(p));
            let rule = Tuning::fused_output_rule(p);
            assert!(t(0, Some(rule), None).is_the_rules_for(p) && t(0, Some(rule), Some(true)).is_the_rules_for(p));
            assert!(!t(0, Some(!rule), None).is_the_rules_for(p));
            assert!(!t(1, None, None).is_the_rules_for(p) && !t(0, None, Some(false)).is_the_rules_for(p));
        }
    }

    #[test]
    fn lookup_matches_the_whole_shape_only() {
        let cfg = Config::new(Formulation::GpuMode, 128, 128).unwrap();
        let p = Problem::new(cfg, Shape::new(1, 1024), Direction::Outgoing, false).unwrap();
        let choice = Tuning { contraction_rank: 2, ..Tuning::default() };
        let entry = TuningEntry {
            arch: "sm_90".into(),
            device: "NVIDIA H100 80GB HBM3".into(),
            formulation: Formulation::GpuMode,
            direction: Direction::Outgoing,
            batch: 1,
            n: 1024,
            c: 128,
            h: 128,
            choice,
            ms: 1.0,
            default_ms: 1.1,
        };
        let (h100, h200) = ("NVIDIA H100 80GB HBM3", "NVIDIA H200");
        let table = TuningTable { measured_on: "test".into(), entries: vec![entry.clone()] };
        assert_eq!(table.lookup("sm_90", h100, &p), Some(choice));
        assert_eq!(table.lookup("sm_80", h100, &p), None);
        // Same architecture, another GPU model: the entry was not measured there.
        assert_eq!(table.lookup("sm_90", h200, &p), None);
        assert_eq!((table.entries_for("sm_90", h100), table.entries_for("sm_90", h200)), (1, 0));
        let other = Problem::new(cfg, Shape::new(1, 768), Direction::Outgoing, false).unwrap();
        assert_eq!(table.lookup("sm_90", h100, &other), None);
        let incoming = Problem::new(cfg, Shape::new(1, 1024), Direction::Incoming, false).unwrap();
        assert_eq!(table.lookup("sm_90", h100, &incoming), None);
        let back: TuningTable = serde_json::from_str(&table.to_json()).unwrap();
        assert_eq!(back, table);

        // A sweep on another model adds its own entry and leaves the H100's; a sweep where the
        // rules won removes only that model's entry for the shape.
        let mut merged = table.clone();
        let h200_choice = Tuning { contraction_rank: 6, ..Tuning::default() };
        merged.record(TuningEntry { device: h200.into(), choice: h200_choice, ..entry.clone() }, true);
        assert_eq!(merged.lookup("sm_90", h100, &p), Some(choice));
        assert_eq!(merged.lookup("sm_90", h200, &p), Some(h200_choice));
        assert_eq!(merged.devices(), ["NVIDIA H100 80GB HBM3 (sm_90)", "NVIDIA H200 (sm_90)"]);
        merged.record(TuningEntry { device: h200.into(), ..entry.clone() }, false);
        assert_eq!((merged.lookup("sm_90", h100, &p), merged.lookup("sm_90", h200, &p)), (Some(choice), None));
        assert_eq!(merged.entries.len(), 1);

        // A table written before entries named their GPU (no `device` key): every GPU of the arch.
        let mut json: serde_json::Value = serde_json::from_str(&table.to_json()).unwrap();
        json["entries"][0].as_object_mut().unwrap().remove("device");
        let old: TuningTable = serde_json::from_value(json).unwrap();
        assert_eq!(old.lookup("sm_90", h200, &p), Some(choice));
        assert_eq!(old.lookup("sm_80", h200, &p), None);
        // ...until this model has its own entry, which wins wherever it stands in the table; a
        // sweep on this model leaves the device-less entry, which other models still use.
        let mut both = old.clone();
        both.record(TuningEntry { device: h200.into(), choice: h200_choice, ..entry.clone() }, true);
        assert_eq!(both.lookup("sm_90", h200, &p), Some(h200_choice));
        assert_eq!(both.lookup("sm_90", h100, &p), Some(choice));
        both.entries.reverse();
        assert_eq!(both.lookup("sm_90", h200, &p), Some(h200_choice));
        assert_eq!(both.devices(), ["NVIDIA H200 (sm_90)", "any sm_90 GPU"]);
        assert_eq!(both.entries_for("sm_90", h200), 1, "one shape, two entries applying");
        // A later sweep on the H200 where the rules won: the device-less entry would apply again,
        // so the H200 keeps an entry choosing the rules.
        both.record(TuningEntry { device: h200.into(), ..entry.clone() }, false);
        assert_eq!(both.lookup("sm_90", h200, &p), Some(Tuning::default()));
        assert_eq!(both.lookup("sm_90", h100, &p), Some(choice));
        assert_eq!(both.entries.len(), 2);
    }
}
