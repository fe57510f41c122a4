//! The GPU MODE `trimul` cases (SPEC.md), their inputs, and the per-shape performance floor.
//!
//! - [`test_cases`]: the 18 correctness cases, hidden width `H = 128`.
//! - [`bench_cases`]: the 7 benchmark shapes, in SPEC.md order (ranked by the geometric mean of
//!   per-shape time).
//! - [`quick_test_cases`] / [`quick_bench_cases`]: subsets small enough for a 2-core CPU.
//!
//! Inputs follow SPEC.md: `x ~ N(0, 1)` or `x ~ Cauchy(0, 2)` elementwise, the mask (when the case
//! has one) is 0 or 1 with equal probability per element, weights come from
//! [`crate::Weights::random`]. Everything is a pure function of a seed ([`crate::rand::Rng`]), so a
//! failure can be replayed.
//!
//! The floor of one shape is `max(FLOPs / GEMM rate, f32 bytes in+out / bandwidth)` with
//! `FLOPs = 2·M·C·(4H + gate) + 2·B·H·N³ + 2·M·H·C`, `M = B·N²` ([`Problem::flops`]) and the bytes
//! of `x` read, `y` written and the mask read ([`Problem::io_bytes`]).
#![forbid(unsafe_code)]

use crate::error::Result;
use crate::named::named_enum;
use crate::problem::{Config, Direction, Formulation, Problem, Shape};
use crate::rand::Rng;

/// Hidden width of every GPU MODE case.
pub const GPU_MODE_H: usize = 128;

/// Scale of the Cauchy inputs (location 0).
pub const CAUCHY_SCALE: f64 = 2.0;

/// Distribution of the entries of `x`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Dist {
    /// Standard normal.
    Normal,
    /// Cauchy with location 0 and scale [`CAUCHY_SCALE`]: heavy tails on purpose, so LayerNorm
    /// statistics meet huge values.
    Cauchy,
}

named_enum!(Dist, "distribution", [Normal => "normal", Cauchy => "cauchy"]);

/// One shape of the suite with its input distribution. The formulation and direction are chosen
/// by the caller ([`Case::problem`]): GPU MODE runs gpumode outgoing, the same shapes serve both.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Case {
    /// Batch size B.
    pub batch: usize,
    /// Sequence length N.
    pub n: usize,
    /// Pair channels C.
    pub c: usize,
    /// Hidden channels H.
    pub h: usize,
    /// Whether a random 0/1 mask is given.
    pub masked: bool,
    /// Distribution of x.
    pub dist: Dist,
}

impl Case {
    /// A case with the GPU MODE hidden width `H = 128`. Arguments in the order of SPEC.md's tables.
    pub const fn new(n: usize, batch: usize, c: usize, masked: bool, dist: Dist) -> Case {
        Case { batch, n, c, h: GPU_MODE_H, masked, dist }
    }

    /// Stable name, e.g. `n256_b2_c128_mask_normal`; `_h<H>` is appended only when `H ≠ 128`.
    pub fn name(&self) -> String {
        let mask = if self.masked { "mask" } else { "nomask" };
        let mut s = format!("n{}_b{}_c{}_{mask}_{}", self.n, self.batch, self.c, self.dist);
        if self.h != GPU_MODE_H {
            s.push_str(&format!("_h{}", self.h));
        }
        s
    }

    /// B and N of the case.
    pub fn shape(&self) -> Shape {
        Shape::new(self.batch, self.n)
    }

    /// The layer configuration of the case in `formulation`.
    pub fn config(&self, formulation: Formulation) -> Result<Config> {
        Config::new(formulation, self.c, self.h)
    }

    /// The validated problem of this case for one formulation and direction.
    pub fn problem(&self, formulation: Formulation, direction: Direction) -> Result<Problem> {
        Problem::new(self.config(formulation)?, self.shape(), direction, self.masked)
    }
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

use Dist::{Cauchy, Normal};

/// The 18 GPU MODE correctness cases (SPEC.md: left column of the table, then the right one).
pub fn test_cases() -> Vec<Case> {
    vec![
        Case::new(32, 1, 128, false, Normal),
        Case::new(32, 1, 128, true, Normal),
        Case::new(64, 2, 256, false, Normal),
        Case::new(64, 2, 256, true, Normal),
        Case::new(128, 1, 768, false, Normal),
        Case::new(256, 1, 128, false, Normal),
        Case::new(256, 1, 128, true, Normal),
        Case::new(768, 2, 128, false, Normal),
        Case::new(1024, 1, 384, true, Normal),
        Case::new(1024, 1, 768, false, Normal),
        Case::new(1024, 1, 768, true, Normal),
        Case::new(32, 1, 128, false, Cauchy),
        Case::new(64, 2, 256, false, Cauchy),
        Case::new(128, 1, 768, false, Cauchy),
        Case::new(256, 1, 128, false, Cauchy),
        Case::new(768, 2, 128, false, Cauchy),
        Case::new(1024, 1, 384, true, Cauchy),
        Case::new(1024, 1, 768, true, Cauchy),
    ]
}

/// The 7 GPU MODE benchmark shapes, in SPEC.md order.
pub fn bench_cases() -> Vec<Case> {
    vec![
        Case::new(256, 2, 128, false, Normal),
        Case::new(768, 1, 128, false, Cauchy),
        Case::new(256, 2, 384, true, Normal),
        Case::new(512, 1, 128, false, Normal),
        Case::new(1024, 1, 128, false, Cauchy),
        Case::new(768, 1, 384, true, Normal),
        Case::new(1024, 1, 384, false, Normal),
    ]
}

/// Correctness cases that run in seconds on 2 CPU cores, drawn from [`test_cases`]: with and
/// without mask, normal and Cauchy, `B = 2`, `C = 128` and `256`.
pub fn quick_test_cases() -> Vec<Case> {
    vec![
        Case::new(32, 1, 128, false, Normal),
        Case::new(32, 1, 128, true, Normal),
        Case::new(64, 2, 256, true, Normal),
        Case::new(32, 1, 128, false, Cauchy),
        Case::new(64, 2, 256, false, Cauchy),
    ]
}

/// The `long` suite's sequence lengths: where users of AF3-style models run out of memory on one
/// GPU (each shape [`long_case`]).
pub const LONG_SUITE_N: [usize; 5] = [2048, 3072, 4096, 6144, 8192];

/// A shape of the `long` suite's form at sequence length `n`: B = 1, C = H = 128, no mask,
/// normal inputs.
pub fn long_case(n: usize) -> Case {
    Case::new(n, 1, 128, false, Normal)
}

/// The benchmark shapes a CPU can time in reasonable wall time: the three cheapest of
/// [`bench_cases`] (≤ 86 GFLOP each), in SPEC.md order, so their timings stay comparable with
/// full benchmark runs.
pub fn quick_bench_cases() -> Vec<Case> {
    vec![
        Case::new(256, 2, 128, false, Normal),
        Case::new(256, 2, 384, true, Normal),
        Case::new(512, 1, 128, false, Normal),
    ]
}

/// The case of [`test_cases`] or [`bench_cases`] with this [`Case::name`].
pub fn find_case(name: &str) -> Option<Case> {
    test_cases().into_iter().chain(bench_cases()).find(|c| c.name() == name)
}

/// Host inputs of one case.
#[derive(Clone, Debug, PartialEq)]
pub struct Inputs {
    /// `[B, N, N, C]`.
    pub x: Vec<f32>,
    /// `[B, N, N]` of 0/1 values, present when the case is masked.
    pub mask: Option<Vec<f32>>,
}

/// Fresh inputs for `case`, a pure function of `seed`: `x` first, then the mask, from one stream.
pub fn generate_inputs(case: &Case, seed: u64) -> Inputs {
    let rows = case.batch * case.n * case.n;
    let len = rows * case.c;
    let mut rng = Rng::new(seed);
    let x = if len <= PARALLEL_INPUT_LEN {
        match case.dist {
            Dist::Normal => rng.normal_vec(len, 1.0),
            Dist::Cauchy => rng.cauchy_vec(len, CAUCHY_SCALE),
        }
    } else {
        // The long-sequence shapes hold billions of values: one generator per block of
        // PARALLEL_INPUT_LEN, seeded from (seed, block), filled in parallel. Deterministic.
        use rayon::prelude::*;
        let mut x = vec![0.0f32; len];
        x.par_chunks_mut(PARALLEL_INPUT_LEN).enumerate().for_each(|(i, chunk)| {
            chunk.copy_from_slice(&input_block(case.dist, seed, i, chunk.len()));
        });
        x
    };
    let mask = case.masked.then(|| rng.mask_vec(rows));
    Inputs { x, mask }
}

/// Block `i` of a long case's x ([`PARALLEL_INPUT_LEN`] values but the last), from its own
/// generator seeded with `(seed, i)`.
fn input_block(dist: Dist, seed: u64, i: usize, len: usize) -> Vec<f32> {
    let mut r = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
    match dist {
        Dist::Normal => r.normal_vec(len, 1.0),
        Dist::Cauchy => r.cauchy_vec(len, CAUCHY_SCALE),
    }
}

/// The inputs of a long case as 16-bit I/O holds them, x rounded to `T` (`half::bf16` or
/// `half::f16`) straight from its generators: at N = 16384 (C = 128) x is 64 GiB this way,
/// where [`generate_inputs`] would hold 128 GiB of f32. The values are [`generate_inputs`]'s
/// rounded, for cases it generates in blocks (more than [`PARALLEL_INPUT_LEN`] values).
pub fn generate_inputs_half<T: HalfValue>(case: &Case, seed: u64) -> (Vec<T>, Option<Vec<f32>>) {
    use rayon::prelude::*;
    let rows = case.batch * case.n * case.n;
    let mut x = vec![T::from_f32(0.0); rows * case.c];
    x.par_chunks_mut(PARALLEL_INPUT_LEN).enumerate().for_each(|(i, chunk)| {
        let values = input_block(case.dist, seed, i, chunk.len());
        for (o, v) in chunk.iter_mut().zip(values) {
            *o = T::from_f32(v);
        }
    });
    let mask = case.masked.then(|| Rng::new(seed).mask_vec(rows));
    (x, mask)
}

/// The 16-bit value types [`generate_inputs_half`] makes.
pub trait HalfValue: Copy + Send + Sync + Into<f64> {
    /// `v` rounded to nearest even.
    fn from_f32(v: f32) -> Self;
}

impl HalfValue for half::bf16 {
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

impl HalfValue for half::f16 {
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

/// Inputs above this many values are generated in parallel blocks of this size (small ones keep
/// the single sequential stream, so their values do not depend on the machine).
const PARALLEL_INPUT_LEN: usize = 1 << 24;

/// The performance floor of one call in milliseconds:
/// `max(FLOPs / (gemm_tflops·10¹²), io_bytes / (bandwidth_gbs·10⁹))`.
pub fn floor_ms(problem: &Problem, gemm_tflops: f64, bandwidth_gbs: f64) -> f64 {
    let compute_s = problem.flops() / (gemm_tflops * 1e12);
    let memory_s = problem.io_bytes() / (bandwidth_gbs * 1e9);
    1e3 * compute_s.max(memory_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 16-bit generator gives the f32 one's values rounded (a long case: blocks).
    #[test]
    fn half_inputs_are_the_f32_ones_rounded() {
        let case = Case::new(1500, 1, 8, true, Dist::Cauchy);
        let want = generate_inputs(&case, 7);
        let (x, mask) = generate_inputs_half::<half::bf16>(&case, 7);
        assert!(x.len() > PARALLEL_INPUT_LEN);
        assert!(want.x.iter().zip(&x).all(|(w, h)| half::bf16::from_f32(*w).to_bits() == h.to_bits()));
        assert_eq!(mask, want.mask);
    }

    #[test]
    fn eighteen_test_cases_with_unique_names() {
        let cases = test_cases();
        assert_eq!(cases.len(), 18);
        let mut names: Vec<String> = cases.iter().map(Case::name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 18, "duplicate case names");
        assert!(cases.iter().all(|c| c.h == 128));
        assert_eq!(cases.iter().filter(|c| c.masked).count(), 7);
        assert_eq!(cases.iter().filter(|c| c.dist == Dist::Cauchy).count(), 7);
        assert_eq!(Case::new(256, 2, 128, true, Normal).name(), "n256_b2_c128_mask_normal");
        let mut odd = Case::new(33, 1, 40, false, Cauchy);
        odd.h = 24;
        assert_eq!(odd.name(), "n33_b1_c40_nomask_cauchy_h24");
        assert_eq!(find_case("n1024_b1_c768_mask_cauchy"), Some(Case::new(1024, 1, 768, true, Cauchy)));
        assert_eq!(find_case("n1024_b1_c768_mask_uniform"), None);
    }

    #[test]
    fn bench_shapes_match_spec_flops_bytes_and_floors() {
        // SPEC.md: (N, B, C, GFLOP, f32 in+out GB, H100 floor ms at 749 TFLOP/s and 2.96 TB/s).
        let spec = [
            (256, 2, 128, 34.4, 0.135, 0.046),
            (768, 1, 128, 231.9, 0.606, 0.309),
            (256, 2, 384, 85.9, 0.403, 0.136),
            (512, 1, 128, 85.9, 0.269, 0.115),
            (1024, 1, 128, 481.0, 1.078, 0.642),
            (768, 1, 384, 463.9, 1.814, 0.619),
            (1024, 1, 384, 893.4, 3.225, 1.192),
        ];
        let cases = bench_cases();
        assert_eq!(cases.len(), 7);
        for (case, (n, b, c, gflop, gb, floor)) in cases.iter().zip(spec) {
            assert_eq!((case.n, case.batch, case.c), (n, b, c));
            let p = case.problem(Formulation::GpuMode, Direction::Outgoing).unwrap();
            assert!((p.flops() / 1e9 - gflop).abs() < 0.1, "{case}: {} GFLOP, SPEC says {gflop}", p.flops() / 1e9);
            // SPEC's column counts the f32 mask on every shape (GPU MODE always passes one, all ones
            // when "none"); this library reads no mask when none is given.
            let gpu_mode_bytes = p.io_bytes() + if p.masked { 0.0 } else { 4.0 * p.mask_len() as f64 };
            assert!((gpu_mode_bytes / 1e9 - gb).abs() < 0.001, "{case}: {} GB, SPEC says {gb}", gpu_mode_bytes / 1e9);
            let f = floor_ms(&p, 749.0, 2960.0);
            assert!((f - floor).abs() < 0.001, "{case}: floor {f} ms, SPEC says {floor}");
        }
        let quick = quick_bench_cases();
        assert!(quick.contains(&Case::new(256, 2, 128, false, Normal)));
        assert!(quick.iter().all(|q| cases.contains(q)));
    }

    #[test]
    fn floor_takes_the_slower_bound() {
        let p = Case::new(256, 2, 128, false, Normal).problem(Formulation::GpuMode, Direction::Outgoing).unwrap();
        let compute_ms = p.flops() / 1e12 * 1e3;
        let memory_ms = p.io_bytes() / 1e9 * 1e3;
        // 1 TFLOP/s makes compute the bound, 1 GB/s makes memory the bound.
        assert_eq!(floor_ms(&p, 1.0, 1e12), compute_ms);
        assert_eq!(floor_ms(&p, 1e12, 1.0), memory_ms);
    }

    #[test]
    fn quick_test_cases_cover_the_axes() {
        let q = quick_test_cases();
        let all = test_cases();
        assert!(q.iter().all(|c| all.contains(c)));
        assert!(q.iter().any(|c| c.masked) && q.iter().any(|c| !c.masked));
        assert!(q.iter().any(|c| c.dist == Normal) && q.iter().any(|c| c.dist == Cauchy));
        assert!(q.iter().any(|c| c.batch == 2));
        assert!(q.iter().any(|c| c.c == 128) && q.iter().any(|c| c.c == 256));
        assert!(q.iter().all(|c| c.n <= 64));
    }

    #[test]
    fn inputs_are_seeded_and_shaped() {
        let case = Case::new(32, 2, 16, true, Cauchy);
        let a = generate_inputs(&case, 5);
        assert_eq!(a, generate_inputs(&case, 5));
        assert_ne!(a.x, generate_inputs(&case, 6).x);
        assert_eq!(a.x.len(), 2 * 32 * 32 * 16);
        let m = a.mask.as_ref().unwrap();
        assert_eq!(m.len(), 2 * 32 * 32);
        assert!(m.iter().all(|&v| v == 0.0 || v == 1.0));
        assert!(m.contains(&0.0) && m.contains(&1.0));
        // Cauchy(0, 2): about half the entries beyond ±2, some far beyond a normal's reach.
        let beyond = a.x.iter().filter(|v| v.abs() > 2.0).count() as f64 / a.x.len() as f64;
        assert!((0.45..0.55).contains(&beyond), "{beyond}");
        assert!(a.x.iter().any(|v| v.abs() > 1000.0));

        let normal = generate_inputs(&Case::new(64, 1, 32, false, Normal), 1);
        assert!(normal.mask.is_none());
        let mean = normal.x.iter().map(|&v| v as f64).sum::<f64>() / normal.x.len() as f64;
        let var = normal.x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / normal.x.len() as f64;
        assert!(mean.abs() < 0.02 && (var - 1.0).abs() < 0.03, "mean {mean} var {var}");
    }
}
