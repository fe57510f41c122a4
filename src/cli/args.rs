//! The command line's arguments: the clap definitions of `trimul` and its commands, their
//! conversions to the library's types, and the two checks of them clap cannot make before a
//! command starts its work (an output path that can be written, a backend that opens).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use trimul::{BackendKind, Device, Direction, Formulation};

use super::exit::{CliError, CliResult};

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
    /// write the faster correct ones as a tuning table (TRIMUL_CUDA_TUNING reads it); with
    /// `--backend hip`, validate the HIP fast paths on this GPU again.
    Tune(TuneArgs),
}

#[derive(Args, Debug)]
pub struct TuneArgs {
    /// `cuda` (default): sweep and write a tuning table. `hip`: validate the MFMA kernels for
    /// each C and H of the suite's shapes on this AMD GPU, again (against the f64 reference, timed
    /// against the portable stages), and keep the verdicts that layers follow.
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// `gpumode`: the 7 GPU MODE shapes; `quick`: the 3 cheapest; `long`: B = 1, C = H = 128
    /// at N = 2048 … 8192, or at the sizes `--n` names.
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
    /// Merge the entries into this table file (replacing this GPU model's entries of the same
    /// shapes); default: print the table.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Seed of the inputs and weights (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Only the shapes with these sequence lengths (comma-separated); with `--suite long`, the
    /// long suite's form at exactly these sizes.
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
    /// Check the backward pass instead of the forward: every gradient (x and each weight and
    /// bias, for a random dy) against the f64 reference, on the suite's cases with N ≤ 256.
    #[arg(long)]
    pub grad: bool,
    /// Run each case sharded by rows across this many GPUs of this host (NCCL; CUDA only) and
    /// compare it with the f64 reference and with the one-GPU forward.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(2..=64))]
    pub gpus: Option<u32>,
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
    /// `long`: B=1, C=H=128, N from 2048 to 8192, or exactly the sizes `--n` names (shapes that
    /// do not fit are skipped).
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
    /// Time the device's work alone (CUDA): each timed call is enqueued while its stream is
    /// held, so the host's time to enqueue it is not counted, as in a model whose stream is kept
    /// busy. Without it, device events bracket each call made on an idle GPU, which counts the
    /// host's time before the first launch.
    #[arg(long)]
    pub device_time: bool,
    /// Seed of the inputs and weights (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Device memory a forward may hold: weights, x, mask, y and workspace (e.g. 24GB, 20GiB).
    /// Shapes whose fastest plan does not fit run in chunks; default: the device's free memory.
    /// With --gpus: per GPU, its rows of x, mask and y included.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes_arg)]
    pub max_memory: Option<u64>,
    /// Write y over x (one tensor instead of two on the device).
    #[arg(long)]
    pub in_place: bool,
    /// Only the shapes with these sequence lengths (comma-separated), e.g. `--n 4096,8192`; with
    /// `--suite long`, the long suite's form at exactly these sizes (e.g. `--n 1024,1536`).
    #[arg(long, value_name = "N,...", value_delimiter = ',')]
    pub n: Vec<usize>,
    /// Element type of x and y on the device: f32-io, or bf16-io / f16-io (CUDA; the fused
    /// kernels read and write them directly).
    #[arg(long, default_value = "f32-io", value_parser = parse_precision_arg)]
    pub precision: trimul::Precision,
    /// Also time the backward pass (every gradient for a random dy), after the forward, with
    /// the same calls, and report its peak memory on a GPU; CPU and CUDA backends (with
    /// --precision bf16-io or f16-io: x, dy and dx 16-bit on CUDA).
    #[arg(long)]
    pub grad: bool,
    /// Time the forward sharded by rows across this many GPUs of this host (NCCL; CUDA only)
    /// against the one-GPU forward, B = 1, C = H = 128, N from `--n` (default 1024, 2048, 4096);
    /// past N = 8192 against the sampled f64 reference instead (16-bit I/O).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(2..=64))]
    pub gpus: Option<u32>,
}

fn parse_precision_arg(s: &str) -> std::result::Result<trimul::Precision, String> {
    s.parse().map_err(|e: trimul::Error| e.to_string())
}

fn parse_bytes_arg(s: &str) -> std::result::Result<u64, String> {
    trimul::plan::parse_bytes(s).map_err(|e| e.to_string())
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

/// The most warm-up or timed calls `bench` and `tune` take per shape: more is no measurement
/// anyone waits for, and the bound keeps the sample buffers and the call counts small.
const MAX_CALLS: i64 = 100_000;

/// A file the command will write at its end, checked at its start with everything the write
/// will check (see `trimul::io::check_output`: the folder exists and takes a new file, the path
/// is not a folder, a read-only file or one whose owner or links a rename would lose), so a
/// path that cannot be written fails before minutes of work rather than after.
pub fn check_output_path(flag: &str, path: &std::path::Path) -> Result<(), CliError> {
    trimul::io::check_output(path).map_err(|e| CliError::usage(format!("{flag} {}", e)))
}

/// Opens the backend named on the command line, or the detected one.
pub fn open_device(backend: Option<BackendArg>) -> CliResult<Device> {
    Ok(Device::select(backend.map(BackendKind::from))?)
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
}
