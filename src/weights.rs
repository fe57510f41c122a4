//! Layer weights in one canonical form, whatever checkpoint they came from.
//!
//! Both formulations share a skeleton: an input LayerNorm over `C`, four `[H, C]` projections
//! (left/right value and gate; af3 calls them a/b), an output gate, an output LayerNorm over `H`
//! and an output projection `[C, H]`. They differ in the output gate (`[H, C]` applied before the
//! output projection for gpumode, `[C, C]` applied after it for af3) and in linear biases (never
//! for gpumode, optional for af3). Loading from safetensors, with the three naming schemes of
//! SPEC.md, lives in [`crate::io`].

use crate::error::{Error, Result};
use crate::problem::{Config, Formulation};

/// A linear layer `y = x·Wᵀ + b`, with `W` row-major `[out, in]`; in f32 unless said (the
/// gradients and the f64 reference use the same type).
#[derive(Clone, Debug, PartialEq)]
pub struct Linear<T = f32> {
    /// `[out, in]`, row-major.
    pub weight: Vec<T>,
    /// `[out]`, or none.
    pub bias: Option<Vec<T>>,
    /// Output features.
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
}

impl<T> Linear<T> {
    /// A linear layer from its weight (`[out, in]`, row-major) and optional bias.
    pub fn new(weight: Vec<T>, bias: Option<Vec<T>>, out_features: usize, in_features: usize) -> Self {
        Linear { weight, bias, out_features, in_features }
    }
}

impl Linear {
    fn check(&self, name: &str, out_features: usize, in_features: usize) -> Result<()> {
        if self.out_features != out_features || self.in_features != in_features {
            return Err(Error::Weights(format!(
                "{name}.weight is [{}, {}], expected [{out_features}, {in_features}]",
                self.out_features, self.in_features
            )));
        }
        if self.weight.len() != out_features * in_features {
            return Err(Error::Weights(format!(
                "{name}.weight holds {} values, expected {out_features}·{in_features} = {}",
                self.weight.len(),
                out_features * in_features
            )));
        }
        if let Some(b) = &self.bias {
            if b.len() != out_features {
                return Err(Error::Weights(format!("{name}.bias has {} values, expected {out_features}", b.len())));
            }
        }
        finite(&format!("{name}.weight"), &self.weight)?;
        self.bias.as_deref().map_or(Ok(()), |b| finite(&format!("{name}.bias"), b))
    }
}

/// A NaN or infinite parameter would turn every output into NaN without a word; refuse it.
fn finite(name: &str, v: &[f32]) -> Result<()> {
    match v.iter().position(|w| !w.is_finite()) {
        Some(i) => Err(Error::Weights(format!("{name}[{i}] is {}, not a finite number", v[i]))),
        None => Ok(()),
    }
}

/// LayerNorm affine parameters, in f32 unless said.
#[derive(Clone, Debug, PartialEq)]
pub struct Norm<T = f32> {
    /// Scale, one per channel.
    pub weight: Vec<T>,
    /// Shift, one per channel.
    pub bias: Vec<T>,
}

impl Norm {
    fn check(&self, name: &str, width: usize) -> Result<()> {
        if self.weight.len() != width {
            return Err(Error::Weights(format!("{name}.weight has {} values, expected {width}", self.weight.len())));
        }
        if self.bias.len() != width {
            return Err(Error::Weights(format!("{name}.bias has {} values, expected {width}", self.bias.len())));
        }
        finite(&format!("{name}.weight"), &self.weight)?;
        finite(&format!("{name}.bias"), &self.bias)
    }
}

/// All parameters of one TriMul layer, validated against its [`Config`].
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    config: Config,
    /// LN_C over the input, `[C]`.
    pub norm_in: Norm,
    /// gpumode `left_proj` / af3 `a_p`, `[H, C]`.
    pub left_proj: Linear,
    /// gpumode `left_gate` / af3 `a_g`, `[H, C]`.
    pub left_gate: Linear,
    /// gpumode `right_proj` / af3 `b_p`, `[H, C]`.
    pub right_proj: Linear,
    /// gpumode `right_gate` / af3 `b_g`, `[H, C]`.
    pub right_gate: Linear,
    /// gpumode `out_gate` `[H, C]` / af3 `g_out` (`linear_g`) `[C, C]`.
    pub out_gate: Linear,
    /// LN_H over the contraction, `[H]`.
    pub norm_out: Norm,
    /// gpumode `to_out` / af3 `p_out` (`linear_z`), `[C, H]`.
    pub out_proj: Linear,
}

/// Pairs the six linear layers of [`Weights`] or [`Gradients`](crate::Gradients), given in the
/// order of the fused projection and then `out_proj`, with their canonical names.
pub(crate) fn named_linears<T>(linears: [&Linear<T>; 6]) -> [(&'static str, &Linear<T>); 6] {
    let names = ["left_proj", "left_gate", "right_proj", "right_gate", "out_gate", "out_proj"];
    std::array::from_fn(|i| (names[i], linears[i]))
}

impl Weights {
    /// Assembles and validates weights; every mismatch names the tensor.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: Config,
        norm_in: Norm,
        left_proj: Linear,
        left_gate: Linear,
        right_proj: Linear,
        right_gate: Linear,
        out_gate: Linear,
        norm_out: Norm,
        out_proj: Linear,
    ) -> Result<Self> {
        let w = Weights { config, norm_in, left_proj, left_gate, right_proj, right_gate, out_gate, norm_out, out_proj };
        w.validate()?;
        Ok(w)
    }

    /// Formulation, C and H.
    pub fn config(&self) -> Config {
        self.config
    }

    /// The formulation the weights are for.
    pub fn formulation(&self) -> Formulation {
        self.config.formulation
    }

    /// True when any linear layer carries a bias (af3 only).
    pub fn has_biases(&self) -> bool {
        self.linears().iter().any(|(_, l)| l.bias.is_some())
    }

    /// The linear layers with their canonical names, in the order of the fused projection.
    pub fn linears(&self) -> [(&'static str, &Linear); 6] {
        let Weights { left_proj, left_gate, right_proj, right_gate, out_gate, out_proj, .. } = self;
        named_linears([left_proj, left_gate, right_proj, right_gate, out_gate, out_proj])
    }

    /// The five linear layers applied to `z`, in the order of the fused input projection:
    /// left value, left gate, right value, right gate, output gate.
    pub fn input_linears(&self) -> [&Linear; 5] {
        [&self.left_proj, &self.left_gate, &self.right_proj, &self.right_gate, &self.out_gate]
    }

    /// The fused input projection every backend prepares: the weights of
    /// [`Weights::input_linears`] one after another (`[P, C]`), and their biases the same way
    /// (`[P]`, zeros for a linear without one), `None` when no input linear has a bias.
    pub(crate) fn fused_input(&self) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let inputs = self.input_linears();
        let len = inputs.iter().map(|l| l.weight.len()).sum();
        let mut weight = Vec::new();
        crate::hostmem::try_reserve(&mut weight, len, "fused projection weights")?;
        for l in inputs {
            weight.extend_from_slice(&l.weight);
        }
        let bias = inputs
            .iter()
            .any(|l| l.bias.is_some())
            .then(|| inputs.iter().flat_map(|l| l.bias.clone().unwrap_or_else(|| vec![0.0; l.out_features])).collect());
        Ok((weight, bias))
    }

    /// Checks every tensor against the configuration: shapes, no biases in the gpumode form, finite values. The error names the tensor.
    pub fn validate(&self) -> Result<()> {
        let Config { c, h, formulation } = self.config;
        self.config.validate()?;
        self.norm_in.check("norm_in", c)?;
        self.left_proj.check("left_proj", h, c)?;
        self.left_gate.check("left_gate", h, c)?;
        self.right_proj.check("right_proj", h, c)?;
        self.right_gate.check("right_gate", h, c)?;
        self.out_gate.check("out_gate", self.config.gate_width(), c)?;
        self.norm_out.check("norm_out", h)?;
        self.out_proj.check("out_proj", c, h)?;
        if formulation == Formulation::GpuMode {
            if let Some((name, _)) = self.linears().iter().find(|(_, l)| l.bias.is_some()) {
                return Err(Error::Weights(format!(
                    "{name} has a bias, but the gpumode formulation has no linear biases"
                )));
            }
        }
        Ok(())
    }

    /// Random weights with the GPU MODE distributions: norms ~ N(0,1), projections and gates
    /// ~ N(0,1)/√H, the output projection ~ N(0,1)/√C. With `biases` (af3 only), biases ~ N(0,1)/√H.
    pub fn random(config: Config, biases: bool, seed: u64) -> Result<Self> {
        config.validate()?;
        if biases && config.formulation == Formulation::GpuMode {
            return Err(Error::InvalidArgument("the gpumode formulation has no linear biases".into()));
        }
        let Config { c, h, .. } = config;
        let mut rng = crate::rand::Rng::new(seed);
        let sh = 1.0 / (h as f32).sqrt();
        let sc = 1.0 / (c as f32).sqrt();
        let mut lin = |out: usize, inp: usize, scale: f32| {
            let weight = rng.normal_vec(out * inp, scale);
            let bias = biases.then(|| rng.normal_vec(out, sh));
            Linear::new(weight, bias, out, inp)
        };
        let left_proj = lin(h, c, sh);
        let left_gate = lin(h, c, sh);
        let right_proj = lin(h, c, sh);
        let right_gate = lin(h, c, sh);
        let out_gate = lin(config.gate_width(), c, sh);
        let out_proj = lin(c, h, sc);
        let norm_in = Norm { weight: rng.normal_vec(c, 1.0), bias: rng.normal_vec(c, 1.0) };
        let norm_out = Norm { weight: rng.normal_vec(h, 1.0), bias: rng.normal_vec(h, 1.0) };
        Weights::new(config, norm_in, left_proj, left_gate, right_proj, right_gate, out_gate, norm_out, out_proj)
    }

    /// Bytes of all parameters as f32.
    pub fn bytes(&self) -> usize {
        let lin: usize =
            self.linears().iter().map(|(_, l)| l.weight.len() + l.bias.as_ref().map_or(0, |b| b.len())).sum();
        4 * (lin + 2 * self.norm_in.weight.len() + 2 * self.norm_out.weight.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_weights_validate_and_reject_mismatch() {
        let cfg = Config::new(Formulation::Af3, 16, 8).unwrap();
        let w = Weights::random(cfg, true, 1).unwrap();
        assert!(w.has_biases());
        assert_eq!(w.out_gate.out_features, 16);
        let mut bad = w.clone();
        bad.left_gate = Linear::new(vec![0.5; 7 * 16], None, 7, 16);
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("left_gate.weight is [7, 16], expected [8, 16]"), "{e}");

        let g = Weights::random(Config::new(Formulation::GpuMode, 16, 8).unwrap(), false, 2).unwrap();
        assert_eq!(g.out_gate.out_features, 8);
        let mut bad = g.clone();
        bad.out_proj.bias = Some(vec![0.0; 16]);
        assert!(bad.validate().unwrap_err().to_string().contains("out_proj has a bias"));
        assert!(Weights::random(g.config(), true, 3).is_err());

        let mut nan = g.clone();
        nan.right_gate.weight[5] = f32::NAN;
        let e = nan.validate().unwrap_err().to_string();
        assert!(e.contains("right_gate.weight[5] is NaN"), "{e}");
        let mut inf = w;
        inf.norm_out.bias[0] = f32::INFINITY;
        let e = inf.validate().unwrap_err().to_string();
        assert!(e.contains("norm_out.bias[0] is inf"), "{e}");
    }
}
