//! Shapes, formulation and direction: the one place the rules of a TriMul call live.
//!
//! The pair representation `x` is `[B, N, N, C]`, channel-last, row-major; the optional mask is
//! `[B, N, N]`; the output `y` has the shape of `x`. The hidden width is `H`.
//!
//! Two formulations (see `SPEC.md`):
//! - [`Formulation::GpuMode`]: `left = (z·Wlpᵀ) ⊙ mask ⊙ σ(z·Wlgᵀ)`, the same for `right`,
//!   `og = σ(z·Wogᵀ)` in the hidden width, `y = (LN_H(t) ⊙ og)·Woutᵀ`. No linear biases.
//! - [`Formulation::Af3`]: `a = σ(z·Wagᵀ+bag) ⊙ (z·Wapᵀ+bap) ⊙ mask` (and `b`),
//!   `y = σ(z·Wgᵀ+bg) ⊙ (LN_H(t)·Wzᵀ+bz)` with the gate in the output width `C`. Biases optional.
//!
//! Two directions for the contraction `t` (per batch `b` and hidden channel `h`):
//! - outgoing: `t[b,i,j,h] = Σ_k left[b,i,k,h]·right[b,j,k,h]`   (L·Rᵀ)
//! - incoming: `t[b,i,j,h] = Σ_k left[b,k,i,h]·right[b,k,j,h]`   (Lᵀ·R)

use crate::error::{Error, Result};
use crate::named::named_enum;

/// Precision of `x` and `y` as the caller holds them. Intermediates are chosen by each backend
/// (f32 on the CPU, f16 between GPU stages with f32 accumulation); the mask is always f32.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Precision {
    /// f32 `x` and `y`, as GPU MODE runs it.
    #[default]
    F32Io,
    /// bfloat16 `x` and `y`, as AF3, Boltz and OpenFold run the layer in mixed precision.
    Bf16Io,
    /// IEEE half `x` and `y`.
    F16Io,
}

impl Precision {
    /// Bytes of one element of `x` and `y`.
    pub fn io_bytes(self) -> usize {
        match self {
            Precision::F32Io => 4,
            Precision::Bf16Io | Precision::F16Io => 2,
        }
    }

    /// Rounds `v` to this precision (identity for f32).
    pub fn round(self, v: f32) -> f32 {
        match self {
            Precision::F32Io => v,
            Precision::Bf16Io => half::bf16::from_f32(v).to_f32(),
            Precision::F16Io => half::f16::from_f32(v).to_f32(),
        }
    }

    /// Decodes one 16-bit element of a half-precision mode.
    pub fn decode_half(self, bits: u16) -> f32 {
        match self {
            Precision::Bf16Io => half::bf16::from_bits(bits).to_f32(),
            _ => half::f16::from_bits(bits).to_f32(),
        }
    }

    /// Encodes `v` as one 16-bit element of a half-precision mode (round to nearest even).
    pub fn encode_half(self, v: f32) -> u16 {
        match self {
            Precision::Bf16Io => half::bf16::from_f32(v).to_bits(),
            _ => half::f16::from_f32(v).to_bits(),
        }
    }
}

named_enum!(Precision, "precision", [F32Io => "f32-io" | "f32", Bf16Io => "bf16-io" | "bf16", F16Io => "f16-io" | "f16" | "fp16"]);

/// Default LayerNorm epsilon of both LayerNorms in both formulations (PyTorch's and
/// cuEquivariance's default); a problem carries its own ([`Problem::with_eps`]).
pub const LN_EPS: f32 = 1e-5;

fn default_eps() -> f32 {
    LN_EPS
}

/// The error for a LayerNorm epsilon no computation can use: NaN, infinite or negative (a
/// negative one can make `var + eps` negative and its square root NaN).
pub fn check_eps(eps: f32) -> Result<()> {
    if eps.is_finite() && eps >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("LayerNorm eps = {eps}: expected a finite value >= 0")))
    }
}

/// Which of the two published formulations a layer computes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Formulation {
    /// lucidrains / GPU MODE `trimul`: five `[H, C]` projections, hidden-width output gate.
    GpuMode,
    /// AlphaFold3 Algorithm 12/13 (OpenFold, Boltz, cuEquivariance): output-width gate, optional biases.
    Af3,
}

named_enum!(Formulation, "formulation", [GpuMode => "gpumode" | "gpu-mode" | "gpu_mode", Af3 => "af3" | "alphafold3"]);

/// Which contraction: edges leaving `i` and `j` (outgoing) or arriving at them (incoming). Not
/// `#[non_exhaustive]`: a triangle update has these two directions, and callers' matches over
/// them should stay exhaustive.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Edges leaving `i` and `j`: `t[i, j] = Σ_k left[i, k]·right[j, k]`.
    #[default]
    Outgoing,
    /// Edges arriving at `i` and `j`: `t[i, j] = Σ_k left[k, i]·right[k, j]`.
    Incoming,
}

named_enum!(Direction, "direction", [Outgoing => "outgoing" | "out", Incoming => "incoming" | "in"]);

/// Layer configuration: what the weights determine.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Config {
    /// Pair channel width `C` (input and output).
    pub c: usize,
    /// Hidden width `H` of the projections and the contraction.
    pub h: usize,
    /// Which formulation the weights are for.
    pub formulation: Formulation,
}

/// Largest channel width we accept; far above any published model, and small enough that
/// per-row work on the GPU fits in one block.
pub const MAX_CHANNELS: usize = 4096;

impl Config {
    /// A validated configuration ([`Config::validate`]).
    pub fn new(formulation: Formulation, c: usize, h: usize) -> Result<Self> {
        let cfg = Config { c, h, formulation };
        cfg.validate()?;
        Ok(cfg)
    }

    /// C and H are each in `1..=MAX_CHANNELS`; the error names which is not.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [("C (pair channels)", self.c), ("H (hidden channels)", self.h)] {
            if v == 0 || v > MAX_CHANNELS {
                return Err(Error::Shape(format!("{name} = {v} is out of range 1..={MAX_CHANNELS}")));
            }
        }
        Ok(())
    }

    /// Width of the output gate: `H` for gpumode (applied before the output projection), `C`
    /// for af3 (applied after it).
    pub fn gate_width(&self) -> usize {
        match self.formulation {
            Formulation::GpuMode => self.h,
            Formulation::Af3 => self.c,
        }
    }

    /// Number of outputs of the fused input projection: left/right projections and gates (4H)
    /// plus the output gate.
    pub fn fused_proj_width(&self) -> usize {
        4 * self.h + self.gate_width()
    }
}

/// The batch and sequence extent of one forward call.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    /// Batch size `B`.
    pub batch: usize,
    /// Sequence length `N` (the pair map is `N × N`).
    pub n: usize,
}

impl Shape {
    /// B and N.
    pub fn new(batch: usize, n: usize) -> Self {
        Shape { batch, n }
    }

    /// Pair positions `M = B·N²`: the row count of every per-position matrix. Saturates instead
    /// of wrapping for a shape no problem accepts ([`Problem::validate`] refuses it).
    pub fn rows(&self) -> usize {
        self.batch.saturating_mul(self.n).saturating_mul(self.n)
    }
}

/// A fully specified, validated call: configuration, shape, direction, whether a mask is given,
/// whether `y` overwrites `x` (in-place mode), the element type of `x` and `y` and the LayerNorm
/// epsilon.
#[derive(Copy, Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Problem {
    /// Formulation, C and H.
    pub config: Config,
    /// B and N.
    pub shape: Shape,
    /// Which contraction.
    pub direction: Direction,
    /// Whether a mask is given.
    pub masked: bool,
    /// `y` is written over `x` once everything that needs `x` has read it (see
    /// [`Problem::in_place`]).
    #[serde(default)]
    pub in_place: bool,
    /// Element type of `x` and `y` (see [`Problem::with_io`]).
    #[serde(default)]
    pub io: Precision,
    /// Epsilon of both LayerNorms (LN_C and LN_H), added to the variance: [`LN_EPS`] unless
    /// [`Problem::with_eps`] says otherwise.
    #[serde(default = "default_eps")]
    pub eps: f32,
}

impl Problem {
    /// A validated problem ([`Problem::validate`]) with f32 I/O, out of place, the default epsilon.
    pub fn new(config: Config, shape: Shape, direction: Direction, masked: bool) -> Result<Self> {
        let p = Problem { config, shape, direction, masked, in_place: false, io: Precision::F32Io, eps: LN_EPS };
        p.validate()?;
        Ok(p)
    }

    /// What [`Problem::new`] checks, for a problem built or changed through its public fields
    /// (backends check it again before planning): a valid config, B and N at least 1, and every
    /// tensor's element count well inside `i64` (GPU index math) and `usize`, and a finite,
    /// non-negative epsilon.
    pub fn validate(&self) -> Result<()> {
        let (config, shape) = (self.config, self.shape);
        config.validate()?;
        check_eps(self.eps)?;
        if shape.batch == 0 {
            return Err(Error::Shape("batch size B must be at least 1".into()));
        }
        if shape.n == 0 {
            return Err(Error::Shape("sequence length N must be at least 1".into()));
        }
        // Every element count must fit comfortably in i64 (GPU index math) and usize.
        let elems = (shape.batch as u128) * (shape.n as u128) * (shape.n as u128) * (config.c.max(config.h) as u128);
        if elems > (i64::MAX as u128) / 8 {
            return Err(Error::Shape(format!(
                "B={} N={} C={} H={} has {elems} elements per tensor: too large",
                shape.batch, shape.n, config.c, config.h
            )));
        }
        Ok(())
    }

    /// The same call with `y` written over `x` (`on = true`) or into its own buffer.
    pub fn in_place(self, on: bool) -> Problem {
        Problem { in_place: on, ..self }
    }

    /// The same problem with `x` and `y` held in `io` precision.
    pub fn with_io(self, io: Precision) -> Problem {
        Problem { io, ..self }
    }

    /// The same problem with LayerNorm epsilon `eps` (checked by [`Problem::validate`]).
    pub fn with_eps(self, eps: f32) -> Problem {
        Problem { eps, ..self }
    }

    /// Bytes of the caller's tensors on the device: `x` and `y` in the I/O precision, the mask
    /// as f32 (`y` shares `x`'s memory in in-place mode).
    pub fn io_device_bytes(&self) -> u64 {
        let x = (self.x_len() * self.io.io_bytes()) as u64;
        let mask = if self.masked { self.mask_len() as u64 * 4 } else { 0 };
        x + mask + if self.in_place { 0 } else { x }
    }

    /// Elements of `x` and `y`: `B·N·N·C`.
    pub fn x_len(&self) -> usize {
        self.shape.rows().saturating_mul(self.config.c)
    }

    /// Elements of the mask: `B·N·N`.
    pub fn mask_len(&self) -> usize {
        self.shape.rows()
    }

    /// Checks host or device slice lengths against the problem, and that a mask is given exactly
    /// when the problem is masked; the message names the tensor.
    pub fn check_lengths(&self, x: usize, mask: Option<usize>, y: usize) -> Result<()> {
        self.validate()?;
        let Shape { batch: b, n } = self.shape;
        let c = self.config.c;
        if x != self.x_len() {
            return Err(Error::Shape(format!(
                "x has {x} elements, expected B·N·N·C = {b}·{n}·{n}·{c} = {}",
                self.x_len()
            )));
        }
        if let Some(m) = mask {
            if m != self.mask_len() {
                return Err(Error::Shape(format!(
                    "mask has {m} elements, expected B·N·N = {b}·{n}·{n} = {}",
                    self.mask_len()
                )));
            }
        }
        if y != self.x_len() {
            return Err(Error::Shape(format!(
                "y has {y} elements, expected B·N·N·C = {b}·{n}·{n}·{c} = {}",
                self.x_len()
            )));
        }
        if self.masked != mask.is_some() {
            return Err(Error::Shape(format!(
                "the problem says masked = {}, but a mask was {}given",
                self.masked,
                if mask.is_some() { "" } else { "not " }
            )));
        }
        Ok(())
    }

    /// Floating-point operations as counted by SPEC.md:
    /// `2·M·C·(4H + gate) + 2·B·H·N³ + 2·M·H·C` (the gpumode count is `2·M·C·5H + …`).
    pub fn flops(&self) -> f64 {
        let m = self.shape.rows() as f64;
        let (c, h) = (self.config.c as f64, self.config.h as f64);
        let n = self.shape.n as f64;
        let b = self.shape.batch as f64;
        let gate = self.config.gate_width() as f64;
        2.0 * m * c * (4.0 * h + gate) + 2.0 * b * h * n * n * n + 2.0 * m * h * c
    }

    /// Minimum bytes moved: `x` read once and `y` written once in the I/O precision (the
    /// mask, one f32 per position, is included when present).
    pub fn io_bytes(&self) -> f64 {
        let xb = (self.x_len() * self.io.io_bytes()) as f64;
        let mb = if self.masked { (self.mask_len() * 4) as f64 } else { 0.0 };
        2.0 * xb + mb
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_match_spec_table() {
        // SPEC.md: 256,2,128 -> 34.4 GFLOP; 1024,1,384 -> 893.4 GFLOP (gpumode).
        let cfg = Config::new(Formulation::GpuMode, 128, 128).unwrap();
        let p = Problem::new(cfg, Shape::new(2, 256), Direction::Outgoing, false).unwrap();
        assert!((p.flops() / 1e9 - 34.4).abs() < 0.05, "{}", p.flops());
        let cfg = Config::new(Formulation::GpuMode, 384, 128).unwrap();
        let p = Problem::new(cfg, Shape::new(1, 1024), Direction::Outgoing, false).unwrap();
        assert!((p.flops() / 1e9 - 893.4).abs() < 0.05, "{}", p.flops());
    }

    #[test]
    fn rejects_empty_and_oversized() {
        assert!(Config::new(Formulation::Af3, 0, 128).is_err());
        assert!(Config::new(Formulation::Af3, 128, MAX_CHANNELS + 1).is_err());
        let cfg = Config::new(Formulation::Af3, 128, 128).unwrap();
        assert!(Problem::new(cfg, Shape::new(0, 4), Direction::Outgoing, false).is_err());
        assert!(Problem::new(cfg, Shape::new(1, 0), Direction::Outgoing, false).is_err());
    }

    #[test]
    fn eps_is_checked() {
        let cfg = Config::new(Formulation::Af3, 8, 8).unwrap();
        let p = Problem::new(cfg, Shape::new(1, 4), Direction::Outgoing, false).unwrap();
        assert_eq!(p.eps, LN_EPS);
        assert!(p.with_eps(0.0).validate().is_ok() && p.with_eps(1e-3).validate().is_ok());
        for bad in [f32::NAN, f32::INFINITY, -1e-5] {
            let e = p.with_eps(bad).validate().unwrap_err().to_string();
            assert!(e.contains("LayerNorm eps"), "{e}");
        }
    }

    #[test]
    fn length_errors_name_the_tensor() {
        let cfg = Config::new(Formulation::GpuMode, 8, 4).unwrap();
        let p = Problem::new(cfg, Shape::new(1, 3), Direction::Outgoing, true).unwrap();
        let e = p.check_lengths(71, Some(9), 72).unwrap_err().to_string();
        assert!(e.contains("x has 71"), "{e}");
        let e = p.check_lengths(72, Some(8), 72).unwrap_err().to_string();
        assert!(e.contains("mask has 8"), "{e}");
        let e = p.check_lengths(72, None, 70).unwrap_err().to_string();
        assert!(e.contains("y has 70"), "{e}");
        let e = p.check_lengths(72, None, 72).unwrap_err().to_string();
        assert!(e.contains("masked = true, but a mask was not given"), "{e}");
        let unmasked = Problem { masked: false, ..p };
        let e = unmasked.check_lengths(72, Some(9), 72).unwrap_err().to_string();
        assert!(e.contains("masked = false, but a mask was given"), "{e}");
        assert!(unmasked.check_lengths(72, None, 72).is_ok() && p.check_lengths(72, Some(9), 72).is_ok());
    }
}
