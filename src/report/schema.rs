//! The bench JSON schema, version [`SCHEMA_VERSION`], written by `trimul bench --json` and read
//! by `trimul report`.
//!
//! One file is one [`BenchRun`]: which code ran (tool version and commit), where (machine,
//! driver and library versions), how (backend, precision, formulation, timing method), the
//! ceilings measured in the same run, and one [`ShapeResult`] per benchmarked shape.
//!
//! Derived numbers follow SPEC.md: TFLOP/s = [`Problem::flops`] / median, GB/s =
//! [`Problem::io_bytes`] / median (`x` read + `y` written in the run's I/O precision, plus the
//! mask), and `floor = max(FLOPs / GEMM rate, io bytes / copy bandwidth)`.
//!
//! Versioning: readers check `schema_version` before anything else, so a file from a newer
//! trimul fails with a message that says so instead of a field error. Adding an optional field
//! keeps the version; renaming, removing or changing the meaning of a field bumps it. Readers
//! ignore fields they do not know, so an older trimul still reads a newer v1 file.
//!
//! Optional fields added to v1 after its first files were written (files without them read as
//! before, and the report says "not recorded"):
//! - [`BenchRun::suite`]: the bench suite (`gpumode`, `quick`, `long`). Without it the report
//!   infers the suite from the shapes ([`BenchRun::suite_name`]).
//! - [`BenchRun::seed`]: the seed every shape's inputs and weights were derived from.
//! - [`BenchRun::telemetry`]: which clock and power probe the run had (nvidia-smi on CUDA) and
//!   the kernel driver's version, or why there was none; with it, each shape's
//!   [`ShapeResult::telemetry`] holds SM clocks, power draw and limit, and the reasons the driver
//!   gave for holding the clocks down, read before, during and after its timed calls.
//!
//! Floats that may legitimately be non-finite (an error norm of an output that holds NaN) are
//! written as the strings `"NaN"`, `"inf"`, `"-inf"`, because JSON has no such numbers and
//! serde_json would otherwise write `null` and fail to read it back.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::backend::DeviceInfo;
use crate::error::{Error, Result};
use crate::problem::Problem;

/// Version of the bench JSON layout this build writes and reads.
pub const SCHEMA_VERSION: u32 = 1;

/// The commit this crate was built from (`git rev-parse --short HEAD` at build time, or
/// `TRIMUL_GIT_COMMIT` from the build environment); `None` outside a git checkout.
pub fn git_commit() -> Option<String> {
    option_env!("TRIMUL_GIT_COMMIT").map(str::to_string).filter(|s| !s.is_empty())
}

/// One bench invocation on one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchRun {
    /// Always [`SCHEMA_VERSION`] when written by this build.
    pub schema_version: u32,
    /// The tool that wrote the run.
    pub tool: ToolInfo,
    /// When the run started, RFC 3339 in UTC (`2026-11-22T14:03:07Z`); see [`format_utc`].
    pub created_utc: String,
    /// Optional short name for tables and legends (`"before fusion"`); the report falls back to
    /// the backend and device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// The machine and device the run was on.
    pub machine: MachineInfo,
    /// `cpu`, `cuda` or `hip`.
    pub backend: String,
    /// Precision mode, as [`crate::Precision::as_str`] spells it (`f32-io`).
    pub precision: String,
    /// `gpumode` or `af3`.
    pub formulation: String,
    /// The bench suite the shapes come from (`gpumode`, `quick`, `long`), also when `--n`
    /// picked some of them. Absent in older files; see [`BenchRun::suite_name`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suite: Option<String>,
    /// The run's seed (`--seed`, or the one drawn from the clock): every shape's inputs and
    /// weights derive from it, so `--seed` replays them. Absent in older files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// How the calls were timed.
    pub timing: TimingMethod,
    /// The ceilings measured in the same run (floors are computed from them).
    pub ceilings: Ceilings,
    /// The clock and power probe of this run, or why there was none. Absent in older files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<RunTelemetry>,
    /// One result per shape measured (or skipped).
    pub shapes: Vec<ShapeResult>,
}

/// What a run could learn about the device's clocks and power while it ran.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunTelemetry {
    /// The probe: `nvidia-smi`, or `none` where the backend has none.
    pub source: String,
    /// Whether the probe answered; when not, the shapes carry no readings and `reason` says why.
    pub available: bool,
    /// Why telemetry is unavailable, when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Which GPU was read (its UUID, as nvidia-smi prints it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// The kernel driver's version (`580.65.06`): the CUDA driver API version in
    /// [`MachineInfo::versions`] does not identify the driver build.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    /// How often the readings during the timed calls were taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_ms: Option<u32>,
}

impl RunTelemetry {
    /// A run without a probe, saying why.
    pub fn unavailable(source: impl Into<String>, reason: impl Into<String>) -> RunTelemetry {
        RunTelemetry {
            source: source.into(),
            available: false,
            reason: Some(reason.into()),
            gpu: None,
            driver_version: None,
            interval_ms: None,
        }
    }
}

/// One reading of a GPU's clocks and power. A field the tool could not report (`[N/A]`,
/// `[Not Supported]`) is absent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    /// Current SM clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_clock_mhz: Option<f64>,
    /// The highest SM clock the GPU can run at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sm_clock_mhz: Option<f64>,
    /// Board power draw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_w: Option<f64>,
    /// The power limit the driver holds the board to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_limit_w: Option<f64>,
    /// Why the clocks are held below their maximum, as nvidia-smi names the reasons
    /// (`sw_power_cap`, `gpu_idle`, `hw_thermal_slowdown`; unknown bits as hex); empty: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_event_reasons: Option<Vec<String>>,
}

/// The readings taken while a shape's warm-up and timed calls ran, summarised.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuSpan {
    /// Readings taken (0 when the calls ended before the first; `before` and `after` remain).
    pub samples: u32,
    /// Lowest SM clock seen (MHz).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_clock_mhz_min: Option<f64>,
    /// Highest SM clock seen (MHz).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_clock_mhz_max: Option<f64>,
    /// Highest power draw seen (W).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_w_max: Option<f64>,
    /// The power limit in force (W).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_limit_w: Option<f64>,
    /// Every reason any reading gave, in first-seen order.
    #[serde(default)]
    pub clock_event_reasons: Vec<String>,
}

impl GpuSpan {
    /// The summary of `samples` (lowest and highest clock, highest power, all reasons).
    pub fn from_samples(samples: &[GpuSample]) -> GpuSpan {
        let fold =
            |f: fn(&GpuSample) -> Option<f64>, pick: fn(f64, f64) -> f64| samples.iter().filter_map(f).reduce(pick);
        let mut reasons: Vec<String> = Vec::new();
        for r in samples.iter().filter_map(|s| s.clock_event_reasons.as_ref()).flatten() {
            if !reasons.contains(r) {
                reasons.push(r.clone());
            }
        }
        GpuSpan {
            samples: u32::try_from(samples.len()).unwrap_or(u32::MAX),
            sm_clock_mhz_min: fold(|s| s.sm_clock_mhz, f64::min),
            sm_clock_mhz_max: fold(|s| s.sm_clock_mhz, f64::max),
            power_w_max: fold(|s| s.power_w, f64::max),
            power_limit_w: fold(|s| s.power_limit_w, f64::min),
            clock_event_reasons: reasons,
        }
    }
}

/// Clocks and power around one shape's timing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ShapeTelemetry {
    /// Just before the warm-up calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before: Option<GpuSample>,
    /// Taken every [`RunTelemetry::interval_ms`] while the warm-up and timed calls ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub during: Option<GpuSpan>,
    /// Just after the last timed call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<GpuSample>,
}

/// Which build of trimul produced a run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolInfo {
    /// The tool's name (`trimul`).
    pub name: String,
    /// Its version.
    pub version: String,
    /// The commit it was built from, where known.
    pub git_commit: Option<String>,
}

impl ToolInfo {
    /// This build: crate name, version and [`git_commit`].
    pub fn current() -> ToolInfo {
        ToolInfo {
            name: env!("CARGO_PKG_NAME").to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            git_commit: git_commit(),
        }
    }
}

/// The device (or host CPU) a run measured, and the software stack under it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineInfo {
    /// `NVIDIA`, `AMD`, or the CPU vendor.
    pub vendor: String,
    /// Marketing name of the device or CPU.
    pub device: String,
    /// Normalised architecture: `sm_90`, `gfx942`, `x86_64`.
    pub arch: String,
    /// SMs, CUs or CPU threads used.
    pub compute_units: u32,
    /// Device memory (host memory for the CPU backend).
    pub memory_bytes: u64,
    /// Driver, runtime and library versions by name (`"CUDA driver"`, `"cuBLASLt"`, `"rocBLAS"`,
    /// `"gemm"`); a map so the JSON reads naturally and the report lists them in a stable order.
    #[serde(default)]
    pub versions: BTreeMap<String, String>,
    /// Host name or host CPU, where the bench chose to record it.
    #[serde(default)]
    pub host: Option<String>,
}

impl MachineInfo {
    /// The fields a backend reports, plus the host.
    pub fn from_device_info(info: &DeviceInfo, host: Option<String>) -> MachineInfo {
        MachineInfo {
            vendor: info.vendor.clone(),
            device: info.name.clone(),
            arch: info.arch.clone(),
            compute_units: info.compute_units,
            memory_bytes: info.memory_bytes,
            versions: info.versions.iter().cloned().collect(),
            host,
        }
    }
}

/// [`TimingMethod::clock`] of a GPU run whose calls were each enqueued with the stream held
/// (`trimul bench --device-time`): the device's work alone, no host time before the launches.
pub const CLOCK_HELD: &str = "device-events-held";

/// How the times were taken (the README's timing section explains why each matters).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimingMethod {
    /// Untimed calls before the first timed one.
    pub warmup: u32,
    /// Timed calls per shape (unless a shape says otherwise in [`ShapeResult::repeats`]).
    pub repeats: u32,
    /// Input buffer sets rotated between calls so the working set exceeds the last-level cache.
    pub buffer_sets: u32,
    /// `device-events` (GPU: events around each call), `device-events-held` (GPU, each call
    /// enqueued with the stream held: `trimul bench --device-time`) or `host` (CPU wall clock).
    pub clock: String,
    /// Whether weights were re-prepared inside every timed call, as the GPU MODE leaderboard does.
    pub fresh_weights: bool,
}

/// Ceilings measured in the same run, from which each shape's floor is derived.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    /// Achieved rate of a large GEMM in the precision mode's compute dtype.
    #[serde(with = "lenient_f64")]
    pub gemm_tflops: f64,
    /// What that GEMM was (`"bf16 8192³ cuBLASLt"`).
    pub gemm_desc: String,
    /// Device copy bandwidth counting read + write, in GB/s (1 GB = 1e9 bytes).
    #[serde(with = "lenient_f64")]
    pub copy_gbs: f64,
}

impl Ceilings {
    /// `max(FLOPs / GEMM rate, io bytes / copy bandwidth)` in ms. Infinite when a ceiling is
    /// zero (not measured), so the ratio to it reads as 0 rather than as a fake floor.
    pub fn floor_ms(&self, problem: &Problem) -> f64 {
        let compute = problem.flops() / (self.gemm_tflops * 1e12);
        let memory = problem.io_bytes() / (self.copy_gbs * 1e9);
        let floor = compute.max(memory) * 1e3;
        if floor.is_nan() {
            f64::INFINITY
        } else {
            floor
        }
    }

    fn validate(&self) -> Result<()> {
        for (name, v) in [("gemm_tflops", self.gemm_tflops), ("copy_gbs", self.copy_gbs)] {
            if v.is_nan() || v < 0.0 {
                return Err(Error::InvalidArgument(format!("ceilings.{name} = {v} is not a rate")));
            }
        }
        Ok(())
    }
}

/// Order statistics of the timed samples of one shape, in ms.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct SampleStats {
    /// Median.
    pub median: f64,
    /// 10th percentile.
    pub p10: f64,
    /// 90th percentile.
    pub p90: f64,
    /// Minimum.
    pub min: f64,
}

impl SampleStats {
    /// Percentiles by linear interpolation between order statistics (numpy's default), so the
    /// median of an even count is the mean of the two middle samples.
    pub fn from_samples(samples_ms: &[f64]) -> Result<SampleStats> {
        if samples_ms.is_empty() {
            return Err(Error::InvalidArgument("no timing samples".into()));
        }
        if let Some(bad) = samples_ms.iter().find(|v| !v.is_finite() || **v < 0.0) {
            return Err(Error::InvalidArgument(format!("timing sample {bad} ms is not a duration")));
        }
        let mut s = samples_ms.to_vec();
        s.sort_by(f64::total_cmp);
        let q = |p: f64| {
            let pos = p * (s.len() - 1) as f64;
            let lo = pos.floor() as usize;
            let hi = pos.ceil() as usize;
            s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
        };
        Ok(SampleStats { median: q(0.5), p10: q(0.1), p90: q(0.9), min: s[0] })
    }
}

/// One benchmarked shape of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShapeResult {
    /// Free-form name (`"bench-3"`); the report identifies shapes by [`ShapeResult::key`].
    pub name: String,
    /// Batch size B.
    pub batch: usize,
    /// Sequence length N.
    pub n: usize,
    /// Pair channels C.
    pub c: usize,
    /// Hidden channels H.
    pub h: usize,
    /// Whether the shape had a mask.
    pub masked: bool,
    /// Input distribution: `normal` or `cauchy`.
    pub dist: String,
    /// `outgoing` or `incoming`.
    pub direction: String,
    /// Timed calls behind the statistics.
    pub repeats: u32,
    /// Median milliseconds per call.
    #[serde(with = "lenient_f64")]
    pub median_ms: f64,
    /// 10th-percentile milliseconds.
    #[serde(with = "lenient_f64")]
    pub p10_ms: f64,
    /// 90th-percentile milliseconds.
    #[serde(with = "lenient_f64")]
    pub p90_ms: f64,
    /// Fastest call, milliseconds.
    #[serde(with = "lenient_f64")]
    pub min_ms: f64,
    /// [`Problem::flops`] / median.
    #[serde(with = "lenient_f64")]
    pub tflops: f64,
    /// [`Problem::io_bytes`] / median, 1 GB = 1e9 bytes.
    #[serde(with = "lenient_f64")]
    pub gbs: f64,
    /// [`Ceilings::floor_ms`] with this run's ceilings.
    #[serde(with = "lenient_f64")]
    pub floor_ms: f64,
    /// median / floor: 1 is the best any implementation could do on this device.
    #[serde(with = "lenient_f64")]
    pub floor_ratio: f64,
    /// Largest `|out − ref|` against the f64 reference on this run's data; `None`: not checked.
    #[serde(default, with = "lenient_opt_f64")]
    pub max_abs_err: Option<f64>,
    /// `‖out − ref‖ / ‖ref‖`; `None`: not checked.
    #[serde(default, with = "lenient_opt_f64")]
    pub rel_l2_err: Option<f64>,
    /// The GPU MODE rule (every element within `2e-2 + 2e-2·|ref|`, no new NaN); `None`: not
    /// checked. Optional because the reference for the largest shapes may be skipped, and a
    /// missing check must not read as a failure or a pass.
    #[serde(default)]
    pub passed: Option<bool>,
    /// High-water mark of device memory during the timed calls.
    #[serde(default)]
    pub peak_device_bytes: Option<u64>,
    /// Bytes of the backend's workspace for this shape.
    #[serde(default)]
    pub workspace_bytes: Option<u64>,
    /// The memory budget the forward ran under (`trimul bench --max-memory`); `None`: the
    /// device's free memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_budget_bytes: Option<u64>,
    /// How the forward was split to fit (hidden passes, row chunks), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec_plan: Option<crate::plan::ExecPlan>,
    /// `y` overwrote `x`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_place: bool,
    /// Clocks and power around the timed calls, where the run had a probe
    /// ([`BenchRun::telemetry`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<ShapeTelemetry>,
    /// `trimul bench --grad`: median milliseconds of one backward (all gradients for a random
    /// `dy`), timed as the forward is, after it; the forward's statistics above are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "lenient_opt_f64")]
    pub backward_median_ms: Option<f64>,
    /// `trimul bench --grad` on a GPU: the most device memory a backward allocated beyond what
    /// the run held before it (its intermediates; not the weights, x, dy and dx).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_peak_device_bytes: Option<u64>,
}

impl ShapeResult {
    /// A result from raw timings: statistics, throughput and floor are derived here so every
    /// writer computes them the same way. Correctness and memory start unset; fill them with
    /// [`ShapeResult::with_check`] and [`ShapeResult::with_memory`].
    pub fn from_samples(
        name: impl Into<String>,
        problem: &Problem,
        dist: impl Into<String>,
        samples_ms: &[f64],
        ceilings: &Ceilings,
    ) -> Result<ShapeResult> {
        let stats = SampleStats::from_samples(samples_ms)?;
        let repeats = u32::try_from(samples_ms.len())
            .map_err(|_| Error::InvalidArgument(format!("{} timing samples is too many", samples_ms.len())))?;
        let secs = stats.median * 1e-3;
        // A zero median (a clock too coarse for the shape) would give infinite throughput;
        // report 0 so the table shows something obviously wrong but finite.
        let per_sec = |work: f64| if secs > 0.0 { work / secs } else { 0.0 };
        let floor_ms = ceilings.floor_ms(problem);
        Ok(ShapeResult {
            name: name.into(),
            batch: problem.shape.batch,
            n: problem.shape.n,
            c: problem.config.c,
            h: problem.config.h,
            masked: problem.masked,
            dist: dist.into(),
            direction: problem.direction.as_str().to_string(),
            repeats,
            median_ms: stats.median,
            p10_ms: stats.p10,
            p90_ms: stats.p90,
            min_ms: stats.min,
            tflops: per_sec(problem.flops()) / 1e12,
            gbs: per_sec(problem.io_bytes()) / 1e9,
            floor_ms,
            floor_ratio: stats.median / floor_ms,
            max_abs_err: None,
            rel_l2_err: None,
            passed: None,
            peak_device_bytes: None,
            workspace_bytes: None,
            memory_budget_bytes: None,
            exec_plan: None,
            in_place: false,
            telemetry: None,
            backward_median_ms: None,
            backward_peak_device_bytes: None,
        })
    }

    /// Records the backward's median time and peak device memory (`trimul bench --grad`).
    pub fn with_backward(mut self, median_ms: Option<f64>, peak_device_bytes: Option<u64>) -> ShapeResult {
        self.backward_median_ms = median_ms;
        self.backward_peak_device_bytes = peak_device_bytes;
        self
    }

    /// Records the correctness check against the reference.
    pub fn with_check(mut self, max_abs_err: f64, rel_l2_err: f64, passed: bool) -> ShapeResult {
        self.max_abs_err = Some(max_abs_err);
        self.rel_l2_err = Some(rel_l2_err);
        self.passed = Some(passed);
        self
    }

    /// Records the memory budget, the plan the backend chose and whether `y` overwrote `x`.
    pub fn with_plan(
        mut self,
        budget: Option<u64>,
        plan: Option<crate::plan::ExecPlan>,
        in_place: bool,
    ) -> ShapeResult {
        self.memory_budget_bytes = budget;
        self.exec_plan = plan;
        self.in_place = in_place;
        self
    }

    /// Records the clocks and power read around the timed calls.
    pub fn with_telemetry(mut self, telemetry: Option<ShapeTelemetry>) -> ShapeResult {
        self.telemetry = telemetry;
        self
    }

    /// Records device memory use.
    pub fn with_memory(mut self, peak_device_bytes: Option<u64>, workspace_bytes: Option<u64>) -> ShapeResult {
        self.peak_device_bytes = peak_device_bytes;
        self.workspace_bytes = workspace_bytes;
        self
    }

    /// The identity of a shape across runs and anchor files: `n{N}_b{B}_c{C}`, as the GPU MODE
    /// benchmark names its shapes (H is 128 in all of them).
    pub fn key(&self) -> String {
        shape_key(self.n, self.batch, self.c)
    }

    fn validate(&self) -> Result<()> {
        let key = self.key();
        if self.batch == 0 || self.n == 0 || self.c == 0 || self.h == 0 {
            return Err(Error::InvalidArgument(format!("shape {key}: batch, n, c and h must be at least 1")));
        }
        for (field, v) in
            [("median_ms", self.median_ms), ("p10_ms", self.p10_ms), ("p90_ms", self.p90_ms), ("min_ms", self.min_ms)]
        {
            if !(0.0..=MAX_MS).contains(&v) {
                return Err(Error::InvalidArgument(format!(
                    "shape {key}: {field} = {} is not a duration (0 to {MAX_MS:e} ms)",
                    short(v)
                )));
            }
        }
        // Derived numbers the report prints beside the times. An unmeasured ceiling (0) makes the
        // floor infinite and its ratio 0, which the report shows as such.
        for (field, v) in
            [("floor_ms", self.floor_ms), ("floor_ratio", self.floor_ratio), ("tflops", self.tflops), ("gbs", self.gbs)]
        {
            let infinite_floor = field == "floor_ms" && v == f64::INFINITY;
            if !(0.0..=MAX_MS).contains(&v) && !infinite_floor {
                return Err(Error::InvalidArgument(format!(
                    "shape {key}: {field} = {} is out of range (0 to {MAX_MS:e})",
                    short(v)
                )));
            }
        }
        Ok(())
    }
}

/// The longest time a run or an anchor may record, in ms (about eleven days): beyond it a value is
/// a broken file, and the plots' log axes would need more decades than they can draw.
pub const MAX_MS: f64 = 1e9;

/// The shortest positive time an anchor may record, in ms (a picosecond).
pub const MIN_ANCHOR_MS: f64 = 1e-9;

/// A number for an error message: exponent notation where the plain form would run long.
pub(crate) fn short(v: f64) -> String {
    if v != 0.0 && (v.abs() >= 1e6 || v.abs() < 1e-4) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// `n{N}_b{B}_c{C}`: see [`ShapeResult::key`].
pub fn shape_key(n: usize, batch: usize, c: usize) -> String {
    format!("n{n}_b{batch}_c{c}")
}

impl BenchRun {
    /// Parses and validates a run; the caller adds where the text came from to the message.
    fn parse(text: &str) -> std::result::Result<BenchRun, String> {
        // Look at the version before the full structure: a newer file likely has fields this
        // build does not know, and "missing field" would hide the real problem.
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let object = value.as_object().ok_or_else(|| {
            format!("not a trimul bench run: the top level is {}, expected an object", json_kind(&value))
        })?;
        match object.get("schema_version") {
            None => return Err("not a trimul bench run: no schema_version field".into()),
            Some(v) => match v.as_u64() {
                Some(v) if v == u64::from(SCHEMA_VERSION) => {}
                Some(v) => {
                    return Err(format!(
                        "schema_version {v} is not supported (this trimul reads version {SCHEMA_VERSION})"
                    ))
                }
                None => return Err(format!("schema_version is {v}, expected a whole number")),
            },
        }
        // Parse the text again rather than the Value so field errors carry a line and column.
        let run: BenchRun = serde_json::from_str(text).map_err(|e| e.to_string())?;
        run.validate().map_err(|e| match e {
            Error::InvalidArgument(m) => m,
            other => other.to_string(),
        })?;
        Ok(run)
    }

    /// Parses a run held in memory. Errors are one line.
    pub fn from_json_str(text: &str) -> Result<BenchRun> {
        BenchRun::parse(text).map_err(|m| Error::InvalidArgument(format!("bench JSON: {m}")))
    }

    /// Reads and validates a run file; errors are one line and name the file.
    pub fn from_path(path: impl AsRef<Path>) -> Result<BenchRun> {
        let path = path.as_ref();
        let file_err = |reason: String| Error::File { path: path.display().to_string(), reason };
        // Bounded: a huge file or /dev/zero is refused, not read until memory runs out.
        let text = crate::io::read_text(path, crate::io::MAX_JSON_BYTES, "bench JSON file")?;
        BenchRun::parse(&text).map_err(file_err)
    }

    /// Pretty JSON with a trailing newline, as `trimul bench --json` writes it.
    pub fn to_json_string(&self) -> Result<String> {
        let mut s = serde_json::to_string_pretty(self)
            .map_err(|e| Error::InvalidArgument(format!("bench run does not serialise: {e}")))?;
        s.push('\n');
        Ok(s)
    }

    /// Writes [`BenchRun::to_json_string`] to `path`, atomically ([`crate::io::write_file`]): a
    /// failed write leaves the previous file whole.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        crate::io::write_file(path, self.to_json_string()?.as_bytes())
    }

    /// Checks what the report relies on: a supported version, sane ceilings and times, and
    /// each shape key at most once (the report's rows are keyed by it).
    pub fn validate(&self) -> Result<()> {
        if self.schema_version != SCHEMA_VERSION {
            return Err(Error::InvalidArgument(format!(
                "schema_version {} is not supported (this trimul reads version {SCHEMA_VERSION})",
                self.schema_version
            )));
        }
        self.ceilings.validate()?;
        let mut seen = std::collections::BTreeSet::new();
        for s in &self.shapes {
            s.validate()?;
            if !seen.insert(s.key()) {
                return Err(Error::InvalidArgument(format!(
                    "shape {} appears twice; a run holds each n/b/c at most once",
                    s.key()
                )));
            }
        }
        Ok(())
    }

    /// The suite the run belongs to, and whether that was inferred: [`BenchRun::suite`] when
    /// recorded, else from the shapes (see [`infer_suite`]).
    pub fn suite_name(&self) -> (String, bool) {
        match self.suite.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
            Some(s) => (s.to_string(), false),
            None => (infer_suite(&self.shapes).to_string(), true),
        }
    }

    /// The calendar date of [`BenchRun::created_utc`] (`2026-11-22`), or the whole string when it
    /// does not start with one.
    pub fn date(&self) -> &str {
        let s = self.created_utc.as_str();
        let b = s.as_bytes();
        let is_date = b.len() >= 10
            && b[..10].iter().enumerate().all(|(i, c)| if i == 4 || i == 7 { *c == b'-' } else { c.is_ascii_digit() });
        if is_date {
            &s[..10]
        } else {
            s
        }
    }
}

/// The suite of a run that did not record one, from its shapes: `long` when every shape is
/// B = 1, C = H = 128 with N ≥ 2048 (the long-sequence sweep), `quick` when the shapes are
/// exactly those of the quick suite, `gpumode` when they are some of the GPU MODE benchmark
/// shapes, else `custom`.
pub fn infer_suite(shapes: &[ShapeResult]) -> &'static str {
    let keys = |cases: Vec<crate::suite::Case>| -> std::collections::BTreeSet<String> {
        cases.iter().map(|c| shape_key(c.n, c.batch, c.c)).collect()
    };
    let have: std::collections::BTreeSet<String> = shapes.iter().map(ShapeResult::key).collect();
    if have.is_empty() {
        "custom"
    } else if shapes.iter().all(|s| s.batch == 1 && s.c == 128 && s.h == 128 && s.n >= 2048) {
        "long"
    } else if have == keys(crate::suite::quick_bench_cases()) {
        "quick"
    } else if have.is_subset(&keys(crate::suite::bench_cases())) {
        "gpumode"
    } else {
        "custom"
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Seconds since the Unix epoch as RFC 3339 UTC (`2026-11-22T14:03:07Z`), for
/// [`BenchRun::created_utc`]; written out here to avoid a date-time dependency for one line.
pub fn format_utc(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The current time as [`format_utc`] writes it.
pub fn now_utc() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format_utc(secs)
}

/// Proleptic Gregorian date of a day count since 1970-01-01, by counting 400-year eras (each
/// exactly 146 097 days) from 0000-03-01 so that leap days fall at the end of a year.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468; // days from 0000-03-01 to 1970-01-01
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of era, 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the March-based year
    let mp = (5 * doy + 2) / 153; // March = 0
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Serialises an `f64` as a JSON number, or as the strings `"NaN"`, `"inf"`, `"-inf"` (JSON has
/// no such numbers and serde_json would write `null`). Also for `serialize_with` outside the
/// schema (the CLI's `check --json`).
pub fn json_f64<S: serde::Serializer>(v: &f64, s: S) -> std::result::Result<S::Ok, S::Error> {
    if v.is_finite() {
        s.serialize_f64(*v)
    } else if v.is_nan() {
        s.serialize_str("NaN")
    } else if *v > 0.0 {
        s.serialize_str("inf")
    } else {
        s.serialize_str("-inf")
    }
}

/// Serde for an `f64` that may be NaN or infinite: numbers as numbers, the rest as strings.
mod lenient_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        super::json_f64(v, s)
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    pub(super) enum Repr {
        Num(f64),
        Text(String),
    }

    impl Repr {
        pub(super) fn value<E: serde::de::Error>(self) -> Result<f64, E> {
            match self {
                Repr::Num(v) => Ok(v),
                Repr::Text(t) => match t.as_str() {
                    "NaN" | "nan" => Ok(f64::NAN),
                    "inf" | "Infinity" => Ok(f64::INFINITY),
                    "-inf" | "-Infinity" => Ok(f64::NEG_INFINITY),
                    other => Err(E::custom(format!("{other:?} is not a number"))),
                },
            }
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Repr::deserialize(d)?.value()
    }
}

/// [`lenient_f64`] for optional values; `null` or absent is `None`.
mod lenient_opt_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => super::lenient_f64::serialize(v, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        Option::<super::lenient_f64::Repr>::deserialize(d)?.map(|r| r.value()).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Config, Direction, Formulation, Shape};

    fn h100_ceilings() -> Ceilings {
        Ceilings { gemm_tflops: 749.0, gemm_desc: "bf16 8192³".into(), copy_gbs: 2960.0 }
    }

    fn problem(n: usize, b: usize, c: usize, masked: bool) -> Problem {
        let cfg = Config::new(Formulation::GpuMode, c, 128).unwrap();
        Problem::new(cfg, Shape::new(b, n), Direction::Outgoing, masked).unwrap()
    }

    #[test]
    fn floors_match_spec_table() {
        // SPEC.md's floor column, derived from the same ceilings.
        let cases = [
            (256, 2, 128, false, 0.046),
            (768, 1, 128, false, 0.309),
            (256, 2, 384, true, 0.136),
            (1024, 1, 128, false, 0.642),
            (1024, 1, 384, false, 1.192),
        ];
        for (n, b, c, masked, want) in cases {
            let got = h100_ceilings().floor_ms(&problem(n, b, c, masked));
            assert!((got - want).abs() < 0.0015, "n{n}_b{b}_c{c}: floor {got} ms, SPEC says {want}");
        }
    }

    #[test]
    fn percentiles_interpolate() {
        let s = SampleStats::from_samples(&[5.0, 1.0, 4.0, 2.0, 3.0]).unwrap();
        assert_eq!((s.median, s.min), (3.0, 1.0));
        assert!((s.p10 - 1.4).abs() < 1e-12 && (s.p90 - 4.6).abs() < 1e-12, "{s:?}");
        let s = SampleStats::from_samples(&[4.0, 1.0]).unwrap();
        assert_eq!(s.median, 2.5);
        assert!(SampleStats::from_samples(&[]).is_err());
        assert!(SampleStats::from_samples(&[1.0, f64::NAN]).is_err());
        assert!(SampleStats::from_samples(&[-1.0]).is_err());
    }

    #[test]
    fn from_samples_derives_throughput_and_floor() {
        let p = problem(1024, 1, 384, false);
        let r = ShapeResult::from_samples("bench-7", &p, "normal", &[4.0, 4.2, 3.8], &h100_ceilings()).unwrap();
        assert_eq!(r.key(), "n1024_b1_c384");
        assert_eq!((r.median_ms, r.min_ms, r.repeats), (4.0, 3.8, 3));
        assert!((r.tflops - p.flops() / 4e-3 / 1e12).abs() < 1e-9);
        assert!((r.gbs - p.io_bytes() / 4e-3 / 1e9).abs() < 1e-9);
        assert!((r.floor_ratio - 4.0 / r.floor_ms).abs() < 1e-12);
        assert_eq!(r.passed, None);
        let r = r.with_check(1e-3, 5e-4, true);
        assert_eq!(r.passed, Some(true));
    }

    #[test]
    fn zero_ceiling_gives_infinite_floor_not_nan() {
        let c = Ceilings { gemm_tflops: 0.0, gemm_desc: String::new(), copy_gbs: 0.0 };
        assert_eq!(c.floor_ms(&problem(32, 1, 128, false)), f64::INFINITY);
    }

    #[test]
    fn utc_formatting() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(format_utc(1_709_251_199), "2024-02-29T23:59:59Z");
        assert_eq!(format_utc(4_107_542_400), "2100-03-01T00:00:00Z");
    }

    #[test]
    fn implausible_numbers_are_refused() {
        let p = problem(32, 1, 128, false);
        let ok = ShapeResult::from_samples("s", &p, "normal", &[1.0], &h100_ceilings()).unwrap();
        assert!(ok.validate().is_ok());
        for (what, r) in [
            ("median_ms", ShapeResult { median_ms: 1.7e308, ..ok.clone() }),
            ("floor_ms", ShapeResult { floor_ms: -1.0, ..ok.clone() }),
            ("floor_ratio", ShapeResult { floor_ratio: f64::NAN, ..ok.clone() }),
            ("tflops", ShapeResult { tflops: f64::INFINITY, ..ok.clone() }),
        ] {
            let e = r.validate().unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
        let zero = Ceilings { gemm_tflops: 0.0, gemm_desc: String::new(), copy_gbs: 0.0 };
        assert!(ShapeResult::from_samples("s", &p, "normal", &[1.0], &zero).unwrap().validate().is_ok());
        assert_eq!(short(1.7e308), "1.7e308");
        assert_eq!(short(-1.0), "-1");
    }

    #[test]
    fn non_finite_errors_round_trip() {
        let p = problem(32, 1, 128, false);
        let r = ShapeResult::from_samples("s", &p, "cauchy", &[1.0], &h100_ceilings()).unwrap().with_check(
            f64::NAN,
            f64::INFINITY,
            false,
        );
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains(r#""max_abs_err":"NaN""#) && json.contains(r#""rel_l2_err":"inf""#), "{json}");
        let back: ShapeResult = serde_json::from_str(&json).unwrap();
        assert!(back.max_abs_err.unwrap().is_nan());
        assert_eq!(back.rel_l2_err, Some(f64::INFINITY));
    }
}
