//! Clock and power readings for `trimul bench`, from `nvidia-smi` run as a subprocess: the one
//! part of [`crate::report`] that looks at the machine rather than at data.
//!
//! A run opens the probe once ([`NvidiaSmi::open`]): that finds the GPU the CUDA backend uses
//! among those nvidia-smi lists (by UUID) and reads the kernel driver's version. Around each
//! shape's timing the bench takes one reading before, a stream of readings while the calls run
//! (`nvidia-smi --loop-ms`, in the background: [`NvidiaSmi::start`]) and one after. Clocks drop and
//! the power limit shows up in `clocks_event_reasons` only while the GPU is busy, so the
//! readings during the calls are the ones that tell whether a time was power-capped.
//!
//! Nothing here may fail a benchmark: a missing tool, an unknown field or a reading that does
//! not parse becomes an unavailable probe (with the reason) or an absent value.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::schema::{GpuSample, GpuSpan, RunTelemetry, ShapeTelemetry};

/// Longest a single nvidia-smi query may take before it is abandoned (a hung driver must not
/// hang the bench).
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

/// Interval of the readings during the timed calls.
pub const INTERVAL_MS: u32 = 100;

/// The fields of one reading, in order; the last is the clock-reason mask, whose name changed
/// (`clocks_throttle_reasons` before driver 530), so both are tried.
const FIELDS: &str = "clocks.sm,clocks.max.sm,power.draw,power.limit";
const REASON_FIELDS: [&str; 2] = ["clocks_event_reasons.active", "clocks_throttle_reasons.active"];

/// nvidia-smi's clock event reason bits, by the names of its `clocks_event_reasons.*` fields.
const REASON_BITS: [(u64, &str); 9] = [
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

/// An opened probe of one GPU.
#[derive(Clone, Debug)]
pub struct NvidiaSmi {
    program: PathBuf,
    /// The GPU's UUID, as `-i` takes it.
    gpu: String,
    query: String,
}

/// Readings being taken in the background; [`Sampler::stop`] ends them.
pub struct Sampler {
    child: Child,
    reader: std::thread::JoinHandle<Vec<String>>,
}

impl NvidiaSmi {
    /// Opens the probe through `nvidia-smi` on the PATH, for the GPU with `uuid` (`GPU-…`, as
    /// CUDA reports it) or, when that is unknown, the only GPU. The telemetry record says what
    /// was found; the probe is `None` when unavailable, and the record says why.
    pub fn open(uuid: Option<&str>) -> (Option<NvidiaSmi>, RunTelemetry) {
        NvidiaSmi::open_with("nvidia-smi", uuid)
    }

    /// [`NvidiaSmi::open`] with another program (a fake one in tests).
    pub fn open_with(program: impl Into<PathBuf>, uuid: Option<&str>) -> (Option<NvidiaSmi>, RunTelemetry) {
        let program = program.into();
        match NvidiaSmi::find(&program, uuid) {
            Ok((probe, driver)) => {
                let telemetry = RunTelemetry {
                    source: "nvidia-smi".into(),
                    available: true,
                    reason: None,
                    gpu: Some(probe.gpu.clone()),
                    driver_version: driver,
                    interval_ms: Some(INTERVAL_MS),
                };
                (Some(probe), telemetry)
            }
            Err(reason) => (None, RunTelemetry::unavailable("nvidia-smi", reason)),
        }
    }

    fn find(program: &PathBuf, uuid: Option<&str>) -> Result<(NvidiaSmi, Option<String>), String> {
        let list = run(program, &["--query-gpu=uuid,driver_version", "--format=csv,noheader"])?;
        let gpus: Vec<(String, String)> = list
            .lines()
            .filter_map(|l| {
                let mut f = l.split(',').map(str::trim);
                Some((f.next()?.to_string(), f.next().unwrap_or("").to_string()))
            })
            .filter(|(u, _)| !u.is_empty())
            .collect();
        let (gpu, driver) =
            match uuid {
                Some(want) => gpus.iter().find(|(u, _)| u.eq_ignore_ascii_case(want)).cloned().ok_or_else(|| {
                    format!("nvidia-smi does not list the CUDA device's GPU {want} (a MIG instance?)")
                })?,
                None if gpus.len() == 1 => gpus[0].clone(),
                None => return Err(format!("nvidia-smi lists {} GPUs and which one ran is unknown", gpus.len())),
            };
        let driver = Some(driver).filter(|d| !d.is_empty() && !d.starts_with('['));
        let mut last_err = String::new();
        for reasons in REASON_FIELDS {
            let probe = NvidiaSmi { program: program.clone(), gpu: gpu.clone(), query: format!("{FIELDS},{reasons}") };
            match run(program, &probe.args(None)) {
                Ok(text) if text.lines().any(|l| parse_sample(l).is_some()) => return Ok((probe, driver)),
                Ok(text) => last_err = format!("nvidia-smi's reading did not parse: {:?}", first_line(&text)),
                Err(e) => last_err = e,
            }
        }
        Err(last_err)
    }

    fn args(&self, interval_ms: Option<u32>) -> Vec<String> {
        let mut v = vec![
            "-i".to_string(),
            self.gpu.clone(),
            format!("--query-gpu={}", self.query),
            "--format=csv,noheader,nounits".to_string(),
        ];
        if let Some(ms) = interval_ms {
            v.push(format!("--loop-ms={ms}"));
        }
        v
    }

    /// One reading now; `None` when nvidia-smi fails or prints something else.
    pub fn sample(&self) -> Option<GpuSample> {
        let text = run(&self.program, &self.args(None)).ok()?;
        text.lines().find_map(parse_sample)
    }

    /// Starts readings every [`INTERVAL_MS`] in the background; `None` when nvidia-smi cannot
    /// be started (the shape then has no readings during its calls).
    pub fn start(&self) -> Option<Sampler> {
        let mut child = Command::new(&self.program)
            .args(self.args(Some(INTERVAL_MS)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let stdout = child.stdout.take()?;
        let reader = std::thread::spawn(move || BufReader::new(stdout).lines().map_while(|l| l.ok()).collect());
        Some(Sampler { child, reader })
    }

    /// Readings around one shape's timing: one before `timed` runs, readings during it, one
    /// after. `timed`'s result is passed through untouched.
    pub fn around<T>(probe: Option<&NvidiaSmi>, timed: impl FnOnce() -> T) -> (T, Option<ShapeTelemetry>) {
        let Some(p) = probe else { return (timed(), None) };
        let before = p.sample();
        let sampler = p.start();
        let value = timed();
        let during = sampler.map(Sampler::stop);
        let after = p.sample();
        (value, Some(ShapeTelemetry { before, during, after }))
    }
}

impl Sampler {
    /// Ends the readings (the nvidia-smi process this sampler started is killed by its handle)
    /// and summarises them.
    pub fn stop(mut self) -> GpuSpan {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let lines = self.reader.join().unwrap_or_default();
        let samples: Vec<GpuSample> = lines.iter().filter_map(|l| parse_sample(l)).collect();
        GpuSpan::from_samples(&samples)
    }
}

/// Runs `program args…` to completion within [`QUERY_TIMEOUT`]; its stdout, or why not.
fn run(program: &PathBuf, args: &[impl AsRef<std::ffi::OsStr>]) -> Result<String, String> {
    let name = program.display().to_string();
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => format!("{name} not found"),
            _ => format!("{name} could not be started: {e}"),
        })?;
    // The output is a few lines, far below a pipe's buffer, so waiting before reading cannot
    // deadlock.
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() < QUERY_TIMEOUT => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{name} did not answer within {} s", QUERY_TIMEOUT.as_secs()));
            }
            Err(e) => return Err(format!("{name}: {e}")),
        }
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut stdout);
    }
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    if status.success() {
        Ok(stdout)
    } else {
        let said = if stdout.trim().is_empty() { &stderr } else { &stdout };
        Err(format!("{name} failed ({status}): {}", first_line(said)))
    }
}

fn first_line(text: &str) -> &str {
    text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("no output")
}

/// One `clocks.sm, clocks.max.sm, power.draw, power.limit, reasons` line (`nounits`); values
/// nvidia-smi cannot give (`[N/A]`, `[Not Supported]`) are absent. `None` when the line is not
/// such a reading.
pub fn parse_sample(line: &str) -> Option<GpuSample> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    if fields.len() != 5 {
        return None;
    }
    let num = |s: &str| s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0);
    let reasons = reason_names(fields[4]);
    let sample = GpuSample {
        sm_clock_mhz: num(fields[0]),
        max_sm_clock_mhz: num(fields[1]),
        power_w: num(fields[2]),
        power_limit_w: num(fields[3]),
        clock_event_reasons: reasons,
    };
    // A line of nothing but unknowns is not a reading (an error message split at commas).
    let any = sample.sm_clock_mhz.is_some() || sample.power_w.is_some() || sample.clock_event_reasons.is_some();
    any.then_some(sample)
}

/// The names of the bits of a clock event reason mask (`0x0000000000000004` →
/// `["sw_power_cap"]`), unknown bits as hex; `None` when the text is not a mask.
pub fn reason_names(mask: &str) -> Option<Vec<String>> {
    let hex = mask.trim().strip_prefix("0x").or_else(|| mask.trim().strip_prefix("0X"))?;
    let bits = u64::from_str_radix(hex, 16).ok()?;
    let mut names: Vec<String> =
        REASON_BITS.iter().filter(|(bit, _)| bits & bit != 0).map(|(_, n)| n.to_string()).collect();
    let known = REASON_BITS.iter().fold(0u64, |a, (bit, _)| a | bit);
    if bits & !known != 0 {
        names.push(format!("{:#x}", bits & !known));
    }
    Some(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_parse() {
        // As nvidia-smi 580.159.04 printed it on an idle H200 for this query.
        let s = parse_sample("345, 1980, 76.74, 700.00, 0x0000000000000001").unwrap();
        assert_eq!((s.sm_clock_mhz, s.power_w, s.power_limit_w), (Some(345.0), Some(76.74), Some(700.0)));
        let s = parse_sample("1755, 1980, 699.12, 700.00, 0x0000000000000004").unwrap();
        assert_eq!((s.sm_clock_mhz, s.max_sm_clock_mhz), (Some(1755.0), Some(1980.0)));
        assert_eq!((s.power_w, s.power_limit_w), (Some(699.12), Some(700.0)));
        assert_eq!(s.clock_event_reasons, Some(vec!["sw_power_cap".to_string()]));
        let s = parse_sample("345, 1980, [N/A], [Not Supported], 0x0000000000000001").unwrap();
        assert_eq!((s.power_w, s.power_limit_w), (None, None));
        assert_eq!(s.clock_event_reasons, Some(vec!["gpu_idle".to_string()]));
        assert!(parse_sample("Field \"clocks_event_reasons.active\" is not a valid field to query.").is_none());
        assert!(parse_sample("[N/A], [N/A], [N/A], [N/A], [N/A]").is_none());
        assert!(parse_sample("").is_none());
    }

    #[test]
    fn reason_masks_name_their_bits() {
        assert_eq!(reason_names("0x0000000000000000"), Some(vec![]));
        assert_eq!(
            reason_names("0x0000000000000044"),
            Some(vec!["sw_power_cap".to_string(), "hw_thermal_slowdown".to_string()])
        );
        assert_eq!(reason_names("0x1000"), Some(vec!["0x1000".to_string()]));
        assert_eq!(reason_names("[N/A]"), None);
    }

    #[test]
    fn span_summarises() {
        let a = parse_sample("1980, 1980, 400, 700, 0x0").unwrap();
        let b = parse_sample("1365, 1980, 699, 700, 0x4").unwrap();
        let s = GpuSpan::from_samples(&[a, b]);
        assert_eq!(s.samples, 2);
        assert_eq!((s.sm_clock_mhz_min, s.sm_clock_mhz_max, s.power_w_max), (Some(1365.0), Some(1980.0), Some(699.0)));
        assert_eq!(s.clock_event_reasons, ["sw_power_cap"]);
        assert_eq!(GpuSpan::from_samples(&[]).samples, 0);
    }

    #[test]
    fn a_missing_tool_is_a_reason_not_an_error() {
        let (probe, t) = NvidiaSmi::open_with("/nonexistent/nvidia-smi", None);
        assert!(probe.is_none());
        assert!(!t.available);
        assert!(t.reason.unwrap().contains("not found"));
    }
}
