//! What a backward pass returns: `∂L/∂x` and `∂L/∂θ` for every parameter `θ` of the layer,
//! given `dy = ∂L/∂y` (`docs/backward.md` derives them).
//!
//! The weight gradients have the shapes and names of [`Weights`]' tensors, held in the same
//! [`Norm`] and [`Linear`] types, so a caller can apply an update tensor by tensor; a bias
//! gradient is present exactly where the weights have that bias. Unlike [`Weights`], the values
//! are not checked: a NaN in `x` or `dy` gives NaN gradients, as IEEE arithmetic says.

use crate::error::{Error, Result};
use crate::weights::{named_linears, Linear, Norm, Weights};

/// The gradients of a scalar loss with respect to `x` and every weight and bias, in f32 (the
/// backends' result) or f64 (the reference's, `reference::Gradients`).
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients<T = f32> {
    /// `∂L/∂x`, `[B, N, N, C]` like `x`.
    pub x: Vec<T>,
    /// LN_C's weight and bias, `[C]` each.
    pub norm_in: Norm<T>,
    /// `[H, C]` (+ `[H]`).
    pub left_proj: Linear<T>,
    /// `[H, C]` (+ `[H]`).
    pub left_gate: Linear<T>,
    /// `[H, C]` (+ `[H]`).
    pub right_proj: Linear<T>,
    /// `[H, C]` (+ `[H]`).
    pub right_gate: Linear<T>,
    /// gpumode `[H, C]`; af3 `[C, C]` (+ `[C]`).
    pub out_gate: Linear<T>,
    /// LN_H's weight and bias, `[H]` each.
    pub norm_out: Norm<T>,
    /// `[C, H]` (+ `[C]`).
    pub out_proj: Linear<T>,
}

impl<T> Gradients<T> {
    /// Every tensor with its checkpoint-style name (`x`, `norm_in.weight`, `left_proj.bias`, …),
    /// in the order of the fields; absent biases are left out.
    pub fn tensors(&self) -> Vec<(String, &[T])> {
        let mut out = vec![("x".to_string(), &self.x[..])];
        out.extend(norm_parts("norm_in", &self.norm_in));
        for (name, l) in self.linears().into_iter().take(5) {
            out.extend(linear_parts(name, l));
        }
        out.extend(norm_parts("norm_out", &self.norm_out));
        out.extend(linear_parts("out_proj", &self.out_proj));
        out
    }

    /// The linear layers' gradients with their names, as [`Weights::linears`] orders them.
    pub fn linears(&self) -> [(&'static str, &Linear<T>); 6] {
        let Gradients { left_proj, left_gate, right_proj, right_gate, out_gate, out_proj, .. } = self;
        named_linears([left_proj, left_gate, right_proj, right_gate, out_gate, out_proj])
    }
}

/// The sixteen weight tensors' names, in the order the device entry points take them and
/// [`Gradients::tensors`] lists them after x, every bias in its place.
pub const WEIGHT_NAMES: [&str; 16] = [
    "norm_in.weight",
    "norm_in.bias",
    "left_proj.weight",
    "left_proj.bias",
    "left_gate.weight",
    "left_gate.bias",
    "right_proj.weight",
    "right_proj.bias",
    "right_gate.weight",
    "right_gate.bias",
    "out_gate.weight",
    "out_gate.bias",
    "norm_out.weight",
    "norm_out.bias",
    "out_proj.weight",
    "out_proj.bias",
];

impl Gradients {
    /// Checks that every gradient has the shape of its weight (and a bias gradient exactly
    /// where the weights have a bias) and that `x` has `x_len` values: what a backend must
    /// return. Names the first tensor that does not match.
    pub fn check_against(&self, weights: &Weights, x_len: usize) -> Result<()> {
        let bad = |what: String| Err(Error::Internal(format!("backward returned {what}")));
        if self.x.len() != x_len {
            return bad(format!("{} values for x, expected {x_len}", self.x.len()));
        }
        for (name, g, w) in
            [("norm_in", &self.norm_in, &weights.norm_in), ("norm_out", &self.norm_out, &weights.norm_out)]
        {
            if g.weight.len() != w.weight.len() || g.bias.len() != w.bias.len() {
                return bad(format!("a {name} gradient of the wrong width"));
            }
        }
        for ((name, g), (_, w)) in self.linears().into_iter().zip(weights.linears()) {
            let shape = (g.out_features, g.in_features, g.weight.len());
            if shape != (w.out_features, w.in_features, w.weight.len()) {
                return bad(format!("a {name}.weight gradient of shape {shape:?}"));
            }
            if g.bias.as_ref().map(Vec::len) != w.bias.as_ref().map(Vec::len) {
                return bad(format!("a {name}.bias gradient where the weights have none, or the reverse"));
            }
        }
        Ok(())
    }
}

fn norm_parts<'a, T>(name: &str, n: &'a Norm<T>) -> [(String, &'a [T]); 2] {
    [(format!("{name}.weight"), &n.weight[..]), (format!("{name}.bias"), &n.bias[..])]
}

fn linear_parts<'a, T>(name: &str, l: &'a Linear<T>) -> Vec<(String, &'a [T])> {
    let mut out = vec![(format!("{name}.weight"), &l.weight[..])];
    if let Some(b) = &l.bias {
        out.push((format!("{name}.bias"), &b[..]));
    }
    out
}
