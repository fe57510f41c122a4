//! The `trimul` command line: argument definitions (clap derive), the mapping of errors to exit
//! codes, and the output helpers every command shares.
//!
//! Conventions: results go to stdout, progress bars and log lines to stderr (bars only when
//! stderr is a terminal); `--json` switches `info` and `check` to one JSON document on stdout.
//! Exit codes: 0 success; 1 a check failed, the device or host memory failed while computing, a
//! `run` whose intermediates overflowed, or a failed write to stdout; 2 a usage or input error (bad
//! arguments, unreadable or inconsistent files, an output that cannot be written, a backend that
//! is not compiled in or cannot be opened); 141 stdout was closed by its reader (`| head`): the
//! command stops quietly. Errors are one line on stderr: `trimul: error: ...`.

mod bench;
mod check;
mod info;
mod report;
mod run;
mod tune;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use trimul::{BackendKind, Device, DeviceInfo, Direction, Formulation};

#[derive(Parser, Debug)]
#[command(
    name = "trimul",
    version,
    about = "Triangle multiplicative update (AlphaFold3-style TriMul) on CPU, CUDA and HIP",
    after_help = "Exit codes: 0 success, 1 a check failed or the device failed while computing, \
                  2 usage or input error, 141 stdout closed by its reader.\nWithout --backend, TRIMUL_BACKEND=cpu|cuda|hip picks the \
                  backend; otherwise the first usable of hip, cuda, cpu."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Show the compiled-in backends, the device each finds, and why the others are unusable.
    Info(InfoArgs),
    /// Run the GPU MODE test cases against the f64 reference (rtol = atol = 2e-2).
    Check(CheckArgs),
    /// Time the GPU MODE benchmark shapes (median of repeats after warm-up).
    Bench(BenchArgs),
    /// Apply one layer to an input file: y = TriMul(x, mask).
    Run(RunArgs),
    /// Merge bench JSON files into report.md and SVG plots.
    Report(ReportArgs),
    /// Sweep the CUDA backend's per-shape choices (contraction algorithm, output path) and
    /// write the faster correct ones as a tuning table (TRIMUL_CUDA_TUNING reads it).
    Tune(TuneArgs),
}

#[derive(Args, Debug)]
pub struct TuneArgs {
    /// `gpumode`: the 7 GPU MODE shapes; `quick`: the 3 cheapest.
    #[arg(long, value_enum, default_value_t = BenchSuite::Gpumode)]
    pub suite: BenchSuite,
    #[arg(long, value_enum, default_value_t = FormulationArg::Gpumode)]
    pub formulation: FormulationArg,
    #[arg(long, value_enum, default_value_t = DirectionArg::Outgoing)]
    pub direction: DirectionArg,
    /// cuBLASLt heuristic candidates to try for the contraction (ranks 0 .. N-1).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(1..=16))]
    pub candidates: u8,
    /// Also sweep the mma.sync build of the fused input kernel against the wgmma one (sm_90).
    #[arg(long)]
    pub sweep_input_kernel: bool,
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=MAX_CALLS))]
    pub warmup: u32,
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u32).range(1..=MAX_CALLS))]
    pub repeats: u32,
    /// Keep a choice only when it beats the built-in rules by more than this fraction.
    #[arg(long, default_value_t = 0.01)]
    pub min_gain: f64,
    /// Merge the entries into this table file (replacing entries of the same shapes); default:
    /// print the table.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Seed of the inputs and weights (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Only the shapes with these sequence lengths (comma-separated).
    #[arg(long, value_name = "N,...", value_delimiter = ',')]
    pub n: Vec<usize>,
}

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Backend to run on (default: detection, see TRIMUL_BACKEND).
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// `gpumode`: the 18 GPU MODE cases; `quick`: a small subset for CI and CPUs.
    #[arg(long, value_enum, default_value_t = CheckSuite::Gpumode)]
    pub suite: CheckSuite,
    /// Which formulation the random weights follow (af3 weights carry biases).
    #[arg(long, value_enum, default_value_t = FormulationArg::Gpumode)]
    pub formulation: FormulationArg,
    #[arg(long, value_enum, default_value_t = DirectionArg::Outgoing)]
    pub direction: DirectionArg,
    /// Seed of the inputs and weights (default: from the clock; printed, so a run can be replayed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Backend to run on (default: detection, see TRIMUL_BACKEND).
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// `gpumode`: the 7 GPU MODE shapes; `quick`: the 3 cheapest (default on the CPU);
    /// `long`: B=1, C=H=128, N from 2048 to 8192 (shapes that do not fit are skipped).
    #[arg(long, value_enum)]
    pub suite: Option<BenchSuite>,
    /// Write the results as a bench JSON file (schema v1, read by `trimul report`).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// A short name for this run in reports (e.g. "before fusion").
    #[arg(long)]
    pub label: Option<String>,
    #[arg(long, value_enum, default_value_t = FormulationArg::Gpumode)]
    pub formulation: FormulationArg,
    #[arg(long, value_enum, default_value_t = DirectionArg::Outgoing)]
    pub direction: DirectionArg,
    /// Timed calls per shape (default: 15 on a GPU, 5 on the CPU; at most 100000).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=MAX_CALLS))]
    pub repeats: Option<u32>,
    /// Untimed calls per shape before timing (default: 3 on a GPU, 1 on the CPU; at most 100000).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=MAX_CALLS))]
    pub warmup: Option<u32>,
    /// Prepare the weights inside every timed call, as the GPU MODE leaderboard does: on a GPU
    /// from f32 weight tensors already on the device (one kernel), on the CPU from host weights.
    #[arg(long)]
    pub fresh_weights: bool,
    /// Seed of the inputs and weights (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Device memory a forward may hold: weights, x, mask, y and workspace (e.g. 24GB, 20GiB).
    /// Shapes whose fastest plan does not fit run in chunks; default: the device's free memory.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes_arg)]
    pub max_memory: Option<u64>,
    /// Write y over x (one tensor instead of two on the device).
    #[arg(long)]
    pub in_place: bool,
    /// Only the shapes with these sequence lengths (comma-separated), e.g. `--n 4096,8192`.
    #[arg(long, value_name = "N,...", value_delimiter = ',')]
    pub n: Vec<usize>,
    /// Element type of x and y on the device: f32-io, or bf16-io / f16-io (CUDA; the fused
    /// kernels read and write them directly).
    #[arg(long, default_value = "f32-io", value_parser = parse_precision_arg)]
    pub precision: trimul::Precision,
}

fn parse_precision_arg(s: &str) -> std::result::Result<trimul::Precision, String> {
    s.parse().map_err(|e: trimul::Error| e.to_string())
}

fn parse_bytes_arg(s: &str) -> std::result::Result<u64, String> {
    trimul::memory::parse_bytes(s).map_err(|e| e.to_string())
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Layer weights (GPU MODE, packed af3, functional or OpenFold names; formulation inferred).
    #[arg(long, value_name = "W.safetensors")]
    pub weights: PathBuf,
    /// Input: tensor `x` [B,N,N,C] (or [N,N,C]) and optional `mask` [B,N,N].
    #[arg(long, value_name = "X.safetensors")]
    pub input: PathBuf,
    /// Output file; receives tensor `y` [B,N,N,C] f32.
    #[arg(long, value_name = "Y.safetensors")]
    pub output: PathBuf,
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    #[arg(long, value_enum, default_value_t = DirectionArg::Outgoing)]
    pub direction: DirectionArg,
    /// Read the weights under this name prefix (e.g. `pairformer.0.tri_mul_out.`).
    #[arg(long)]
    pub prefix: Option<String>,
    /// Device memory the forward may hold (e.g. 24GB); default: the device's free memory.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes_arg)]
    pub max_memory: Option<u64>,
    /// Compute y in the memory of x (halves the largest tensors on the device).
    #[arg(long)]
    pub in_place: bool,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Bench JSON files written by `trimul bench --json`, one run each.
    #[arg(required = true, value_name = "RUN.json")]
    pub runs: Vec<PathBuf>,
    /// Directory for report.md and the SVG plots (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Reference timings (JSON: name, unit "ms", formulation, precision, per-shape values),
    /// compared only with runs of the same formulation and I/O precision.
    #[arg(long, value_name = "FILE")]
    pub anchors: Option<PathBuf>,
    /// The run that speedups between runs of its suite, formulation and precision are measured
    /// against, numbered from 1 in the order given (default 1; other combinations use their
    /// first run).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..))]
    pub baseline: Option<u32>,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    Cpu,
    Cuda,
    Hip,
}

impl From<BackendArg> for BackendKind {
    fn from(b: BackendArg) -> BackendKind {
        match b {
            BackendArg::Cpu => BackendKind::Cpu,
            BackendArg::Cuda => BackendKind::Cuda,
            BackendArg::Hip => BackendKind::Hip,
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum FormulationArg {
    Gpumode,
    Af3,
}

impl From<FormulationArg> for Formulation {
    fn from(f: FormulationArg) -> Formulation {
        match f {
            FormulationArg::Gpumode => Formulation::GpuMode,
            FormulationArg::Af3 => Formulation::Af3,
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum DirectionArg {
    Outgoing,
    Incoming,
}

impl From<DirectionArg> for Direction {
    fn from(d: DirectionArg) -> Direction {
        match d {
            DirectionArg::Outgoing => Direction::Outgoing,
            DirectionArg::Incoming => Direction::Incoming,
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum CheckSuite {
    Gpumode,
    Quick,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchSuite {
    Gpumode,
    Quick,
    Long,
}

/// Starts rayon's worker threads now, while the process is small. Started lazily, at the first
/// parallel loop, they would be spawned after the inputs are loaded, and under an address-space
/// or memory limit that the inputs nearly fill, rayon panics when it cannot spawn them ("The
/// global thread pool has not been initialized"). If even now they cannot start, the error says
/// so (exit 1) instead.
fn start_worker_threads() -> Result<(), CliError> {
    rayon::ThreadPoolBuilder::new()
        .build_global()
        .or_else(|e| {
            // Already built (a second call), or too many threads for the limit: try one.
            if rayon::current_num_threads() >= 1 && e.to_string().contains("already") {
                return Ok(());
            }
            rayon::ThreadPoolBuilder::new().num_threads(1).build_global()
        })
        .map_err(|e| CliError {
            code: EXIT_FAILED,
            message: format!("cannot start worker threads (memory or thread limit?): {e}"),
        })
}

/// Parses the arguments, runs the command, and turns its outcome into an exit code.
pub fn main() -> ExitCode {
    // clap prints its own usage errors and exits with code 2, which is our usage code too.
    let cli = Cli::parse();
    let outcome = start_worker_threads().and_then(|()| match &cli.command {
        Command::Info(a) => info::run(a),
        Command::Check(a) => check::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Run(a) => run::run(a),
        Command::Report(a) => report::run(a),
        Command::Tune(a) => tune::run(a),
    });
    match outcome {
        Ok(code) => code,
        Err(e) => {
            if !e.message.is_empty() {
                // A closed or full stderr leaves nothing to report the error on; the code still says it.
                let _ = writeln!(std::io::stderr(), "trimul: error: {}", one_line(&e.message));
            }
            ExitCode::from(e.code)
        }
    }
}

/// A file the command will write at its end, checked at its start with everything the write
/// will check (see `trimul::io::check_output`: the folder exists and takes a new file, the path
/// is not a folder, a read-only file or one whose owner or links a rename would lose), so a
/// path that cannot be written fails before minutes of work rather than after.
pub fn check_output_path(flag: &str, path: &std::path::Path) -> Result<(), CliError> {
    trimul::io::check_output(path).map_err(|e| CliError::usage(format!("{flag} {}", e)))
}

/// The most warm-up or timed calls `bench` and `tune` take per shape: more is no measurement
/// anyone waits for, and the bound keeps the sample buffers and the call counts small.
const MAX_CALLS: i64 = 100_000;

/// Exit code of a failed check, or of a computation the device could not finish.
pub const EXIT_FAILED: u8 = 1;
/// Exit code of a usage or input error.
pub const EXIT_USAGE: u8 = 2;

/// An error on its way to the user: a one-line message and the exit code it earns.
#[derive(Debug)]
pub struct CliError {
    pub code: u8,
    pub message: String,
}

impl CliError {
    pub fn usage(message: impl Into<String>) -> CliError {
        CliError { code: EXIT_USAGE, message: message.into() }
    }
}

impl From<trimul::Error> for CliError {
    /// Failures of the device or its libraries while computing are "the run failed" (1);
    /// everything else (shapes, weights, files, a backend that is absent) is the caller's input (2).
    fn from(e: trimul::Error) -> CliError {
        use trimul::Error as E;
        let code = match e {
            E::Driver { .. } | E::Blas { .. } | E::NoKernels { .. } | E::OutOfMemory { .. } | E::NonFinite { .. } => {
                EXIT_FAILED
            }
            _ => EXIT_USAGE,
        };
        CliError { code, message: e.to_string() }
    }
}

pub type CliResult<T = ExitCode> = Result<T, CliError>;

/// Collapses a message onto one line (errors from files or drivers may carry newlines).
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Opens the backend named on the command line, or the detected one.
pub fn open_device(backend: Option<BackendArg>) -> CliResult<Device> {
    Ok(Device::select(backend.map(BackendKind::from))?)
}

/// A seed from the clock, for runs that were not given one.
pub fn clock_seed() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    // Mixed so that runs a second apart get unrelated seeds, and cut to 9 digits to stay easy
    // to retype.
    trimul::rand::Rng::new(nanos as u64).next_u64() % 1_000_000_000
}

/// Exit code when standard output is closed under us (`trimul check | head -1`: the reader is
/// gone). Nothing more is printed and the command stops where it was; 141 is what a shell
/// reports for a process killed by SIGPIPE, so `set -o pipefail` treats trimul like `grep` or
/// `yes`, and a script cannot mistake a run cut short for a complete one.
pub const EXIT_BROKEN_PIPE: u8 = 141;

/// Writes one line to stdout. A failed write (`> /dev/full`, a disk that filled) is an error
/// with exit code 1; a closed pipe ends the command quietly with [`EXIT_BROKEN_PIPE`].
pub fn emit(line: &str) -> CliResult<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).map_err(stdout_error)
}

/// The error a failed write to stdout earns: see [`emit`]. An empty message prints nothing.
fn stdout_error(e: std::io::Error) -> CliError {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        CliError { code: EXIT_BROKEN_PIPE, message: String::new() }
    } else {
        CliError { code: EXIT_FAILED, message: format!("cannot write to standard output: {e}") }
    }
}

/// A progress bar on stderr, hidden when stderr is not a terminal, through which the commands
/// print their results to stdout with the bar lifted out of the way.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar of `len` steps; the message shows what is running now.
    pub fn bar(len: u64) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(len), draw_target());
        if let Ok(style) = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {wide_msg}")
        {
            bar.set_style(style);
        }
        // Steady ticks keep the clock moving through single steps that take seconds (a
        // reference check of a large case, a slow CPU forward).
        bar.enable_steady_tick(Duration::from_millis(200));
        Progress { bar }
    }

    /// A spinner for work of unknown length.
    pub fn spinner() -> Progress {
        let bar = ProgressBar::with_draw_target(None, draw_target());
        if let Ok(style) = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_msg}") {
            bar.set_style(style);
        }
        bar.enable_steady_tick(Duration::from_millis(200));
        Progress { bar }
    }

    pub fn set_message(&self, msg: impl Into<String>) {
        self.bar.set_message(msg.into());
    }

    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    pub fn position(&self) -> u64 {
        self.bar.position()
    }

    /// A result line on stdout (see [`emit`] for its errors).
    pub fn out(&self, line: &str) -> CliResult<()> {
        self.bar.suspend(|| emit(line))
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // An early return through `?` must not leave a half-drawn bar above the error line.
        self.bar.finish_and_clear();
    }
}

fn draw_target() -> ProgressDrawTarget {
    if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

/// `AMD EPYC 7B13, x86_64, 2 threads, 7.8 GiB` or `NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79.1 GiB`.
pub fn device_summary(kind: BackendKind, info: &DeviceInfo) -> String {
    let units = match kind {
        BackendKind::Cpu => "threads",
        BackendKind::Cuda => "SMs",
        BackendKind::Hip => "CUs",
        _ => "compute units",
    };
    let mut parts = vec![info.name.clone()];
    if !info.arch.is_empty() {
        parts.push(info.arch.clone());
    }
    if info.compute_units > 0 {
        parts.push(format!("{} {units}", info.compute_units));
    }
    if info.memory_bytes > 0 {
        parts.push(fmt_bytes(info.memory_bytes));
    }
    parts.join(", ")
}

pub use trimul::report::{fmt_bytes, fmt_err, json_f64};

/// Pretty JSON of `value` on stdout.
pub fn emit_json<T: serde::Serialize>(value: &T) -> CliResult<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| CliError { code: EXIT_FAILED, message: format!("JSON output: {e}") })?;
    emit(&text)
}

/// Derives independent seeds for the parts of one run (inputs and weights of each case) from
/// the one seed the user sees.
pub struct SeedStream(trimul::rand::Rng);

impl SeedStream {
    pub fn new(seed: u64) -> SeedStream {
        SeedStream(trimul::rand::Rng::new(seed))
    }

    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_command_lines() {
        let cli = Cli::try_parse_from(["trimul", "check", "--backend", "cpu", "--suite", "quick", "--seed", "7"])
            .expect("check parses");
        match cli.command {
            Command::Check(a) => {
                assert_eq!((a.backend, a.suite, a.seed), (Some(BackendArg::Cpu), CheckSuite::Quick, Some(7)));
                assert_eq!((a.formulation, a.direction), (FormulationArg::Gpumode, DirectionArg::Outgoing));
            }
            other => panic!("parsed as {other:?}"),
        }
        let cli = Cli::try_parse_from([
            "trimul",
            "bench",
            "--suite",
            "long",
            "--formulation",
            "af3",
            "--direction",
            "incoming",
            "--repeats",
            "3",
            "--warmup",
            "0",
            "--fresh-weights",
            "--json",
            "out.json",
        ])
        .expect("bench parses");
        match cli.command {
            Command::Bench(a) => {
                assert_eq!(a.suite, Some(BenchSuite::Long));
                assert_eq!((a.repeats, a.warmup, a.fresh_weights), (Some(3), Some(0), true));
                assert_eq!(a.json.as_deref(), Some(std::path::Path::new("out.json")));
                assert_eq!(Formulation::from(a.formulation), Formulation::Af3);
                assert_eq!(Direction::from(a.direction), Direction::Incoming);
            }
            other => panic!("parsed as {other:?}"),
        }
        let cli = Cli::try_parse_from(["trimul", "tune", "--candidates", "3", "--n", "512,1024", "--out", "t.json"])
            .expect("tune parses");
        match cli.command {
            Command::Tune(a) => {
                assert_eq!((a.suite, a.candidates, a.n.as_slice()), (BenchSuite::Gpumode, 3, &[512, 1024][..]));
                assert_eq!((a.warmup, a.repeats, a.sweep_input_kernel), (3, 15, false));
                assert_eq!(a.out.as_deref(), Some(std::path::Path::new("t.json")));
            }
            other => panic!("parsed as {other:?}"),
        }
        assert!(Cli::try_parse_from(["trimul", "tune", "--candidates", "0"]).is_err());
        assert!(Cli::try_parse_from(["trimul", "bench", "--repeats", "0"]).is_err());
        assert!(Cli::try_parse_from(["trimul", "check", "--suite", "long"]).is_err());
        assert!(Cli::try_parse_from(["trimul", "report", "--out", "d"]).is_err(), "report needs a run");
        assert!(Cli::try_parse_from(["trimul", "run", "--weights", "w", "--input", "x"]).is_err());
    }

    #[test]
    fn exit_codes_follow_the_error_kind() {
        let nc = trimul::Error::NotCompiled { backend: BackendKind::Cuda, feature: "cuda" };
        assert_eq!(CliError::from(nc).code, EXIT_USAGE);
        let drv = trimul::Error::driver(BackendKind::Cuda, "cuLaunchKernel", "CUDA_ERROR_LAUNCH_FAILED");
        assert_eq!(CliError::from(drv).code, EXIT_FAILED);
        assert_eq!(CliError::from(trimul::Error::Shape("x".into())).code, EXIT_USAGE);
    }

    #[test]
    fn formatting() {
        assert_eq!(one_line("a\n  b\tc "), "a b c");
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
        assert_eq!(fmt_err(0.0), "0");
        assert_eq!(fmt_err(1.234e-4), "1.23e-4");
        assert_eq!(fmt_err(f64::INFINITY), "inf");
        #[derive(serde::Serialize)]
        struct V {
            #[serde(serialize_with = "json_f64")]
            a: f64,
            #[serde(serialize_with = "json_f64")]
            b: f64,
        }
        let s = serde_json::to_string(&V { a: 0.5, b: f64::NAN }).unwrap();
        assert_eq!(s, r#"{"a":0.5,"b":"NaN"}"#);
    }
}
