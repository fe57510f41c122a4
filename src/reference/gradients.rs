//! The backward pass in f64: the gradient of a scalar loss `L` with respect to `x` and every
//! weight and bias, given `dy = ∂L/∂y`.
//!
//! Written independently of the forward's code ([`super::forward`] builds `y` from lines and
//! blocks; this module recomputes the forward its own way, keeping every intermediate), so that
//! the finite-difference tests, which differentiate [`super::forward`]'s computation, check one
//! against the other. `docs/backward.md` derives each step; in short, per row `r = (b,i,j)`
//! (`⊙` elementwise, sums over `r` run over all `B·N²` rows):
//!
//! ```text
//! forward, kept                                  backward
//! x̂ = (x − μ)·ρ,  ρ = 1/√(var + eps)             dx   = ρ·(ĝ − mean(ĝ) − x̂·mean(ĝ⊙x̂)),  ĝ = dz⊙γ
//! z = x̂⊙γ + β                                    dγ   = Σ_r dz⊙x̂,   dβ = Σ_r dz
//! p = z·Wpᵀ + bp,  q = z·Wqᵀ + bq (value, gate)  dp   = dleft⊙σ(q)⊙m,  dq = dleft⊙p⊙m⊙σ(q)(1 − σ(q))
//! left = p⊙σ(q)⊙m  (right likewise)              dWp  = Σ_r dpᵀ·z,  dbp = Σ_r dp,  dz += dp·Wp + dq·Wq
//! outgoing T = L·Rᵀ   (per (b,h), N×N)           dL = dT·R,    dR = dTᵀ·L
//! incoming T = Lᵀ·R                              dL = R·dTᵀ,   dR = L·dT
//! t̂ = LN-normalised t,  u = t̂⊙γo + βo            dt   = ρt·(ĝ − mean(ĝ) − t̂·mean(ĝ⊙t̂)),  ĝ = du⊙γo
//! gpumode: o = σ(z·Wogᵀ), v = u⊙o, y = v·Woutᵀ   dv = dy·Wout, dWout = Σ_r dyᵀ·v, du = dv⊙o,
//!                                                dg = dv⊙u⊙o(1 − o), dWog = Σ_r dgᵀ·z, dz += dg·Wog
//! af3: g = σ(z·Wgᵀ + bg), s = u·Wzᵀ + bz, y = g⊙s ds = dy⊙g, dWz = Σ_r dsᵀ·u, dbz = Σ_r ds, du = ds·Wz,
//!                                                dg = dy⊙s⊙g(1 − g), dWg = Σ_r dgᵀ·z, dbg = Σ_r dg, dz += dg·Wg
//! ```
//!
//! The mask `m` is data, not a parameter: no gradient is returned for it. The contraction's
//! matrices are `L[p,q] = left[b,p,q,h]` for each batch `b` and hidden channel `h`, and one helper
//! ([`channel_matmul`]) forms every product above with the transposes written as in the table.
#![forbid(unsafe_code)]

use rayon::prelude::*;

use crate::problem::{Direction, Formulation, Problem, Shape};
use crate::weights::{Linear, Norm, Weights};

/// A linear layer's weight `[out, in]` (row-major) and optional bias `[out]` in f64: the
/// gradient of a [`Linear`], or (in the tests) its value at a point.
pub type Linear64 = Linear<f64>;

impl Linear64 {
    fn from_f32(l: &Linear) -> Linear64 {
        Linear64::new(widen(&l.weight), l.bias.as_deref().map(widen), l.out_features, l.in_features)
    }
}

/// A LayerNorm's scale and shift in f64: the gradient of a [`Norm`], or its value at a point.
pub type Norm64 = Norm<f64>;

impl Norm64 {
    fn from_f32(n: &Norm) -> Norm64 {
        Norm64 { weight: widen(&n.weight), bias: widen(&n.bias) }
    }
}

/// `∂L/∂x` and `∂L/∂θ` for every parameter `θ` in f64, named and shaped as in [`Weights`]; a
/// bias's gradient is present exactly when the weights have that bias.
///
/// The same layout holds a point `(x, weights)` of the forward's domain, which is how the tests
/// perturb the forward's inputs in f64.
pub type Gradients = crate::gradients::Gradients<f64>;

impl Gradients {
    /// The point `(x, weights)` in f64.
    pub(super) fn at(weights: &Weights, x: &[f32]) -> Gradients {
        Gradients {
            x: widen(x),
            norm_in: Norm64::from_f32(&weights.norm_in),
            left_proj: Linear64::from_f32(&weights.left_proj),
            left_gate: Linear64::from_f32(&weights.left_gate),
            right_proj: Linear64::from_f32(&weights.right_proj),
            right_gate: Linear64::from_f32(&weights.right_gate),
            out_gate: Linear64::from_f32(&weights.out_gate),
            norm_out: Norm64::from_f32(&weights.norm_out),
            out_proj: Linear64::from_f32(&weights.out_proj),
        }
    }
}

pub(super) fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&e| f64::from(e)).collect()
}

/// The backward at the point `p` (its `x` and weights) given `dy`, as `reference::backward`
/// computes it after its checks.
pub(super) fn backward_at(p: &Gradients, problem: &Problem, mask: Option<&[f32]>, dy: &[f64]) -> Gradients {
    let (c, h) = (problem.config.c, problem.config.h);
    let eps = f64::from(problem.eps);
    let shape = problem.shape;
    let rows = shape.rows();
    let m: Vec<f64> = (0..rows).map(|r| mask.map_or(1.0, |m| f64::from(m[r]))).collect();

    // The forward again, keeping what the backward needs.
    let (x_hat, x_rho) = normalise(&p.x, c, eps);
    let z = affine(&x_hat, &p.norm_in);
    let (lp, lq) = (linear(&z, &p.left_proj), linear(&z, &p.left_gate));
    let (rp, rq) = (linear(&z, &p.right_proj), linear(&z, &p.right_gate));
    let gate_pre = linear(&z, &p.out_gate);
    let left = gated(&lp, &lq, &m, h);
    let right = gated(&rp, &rq, &m, h);
    let t = match problem.direction {
        Direction::Outgoing => channel_matmul(&left, false, &right, true, shape, h),
        Direction::Incoming => channel_matmul(&left, true, &right, false, shape, h),
    };
    let (t_hat, t_rho) = normalise(&t, h, eps);
    let u = affine(&t_hat, &p.norm_out);

    // The output stage: ∂L/∂u and the output gate's and projection's gradients; dz collects
    // every path back to z (the output gate here, the four projections below).
    let mut dz = vec![0.0; rows * c];
    let mut du = vec![0.0; rows * h];
    let gate = gate_pre.iter().map(|&v| sigmoid(v)).collect::<Vec<f64>>();
    let (d_out_gate, d_out_proj) = match problem.config.formulation {
        Formulation::GpuMode => {
            // y = (u ⊙ o)·Woutᵀ with o = σ(z·Wogᵀ), all in the hidden width.
            let v: Vec<f64> = u.iter().zip(&gate).map(|(a, o)| a * o).collect();
            let mut dv = vec![0.0; rows * h];
            let d_out_proj = linear_backward(dy, &v, &p.out_proj, &mut dv);
            for k in 0..rows * h {
                du[k] = dv[k] * gate[k];
            }
            let dg: Vec<f64> = (0..rows * h).map(|k| dv[k] * u[k] * gate[k] * (1.0 - gate[k])).collect();
            (linear_backward(&dg, &z, &p.out_gate, &mut dz), d_out_proj)
        }
        Formulation::Af3 => {
            // y = g ⊙ s with g = σ(z·Wgᵀ + bg) and s = u·Wzᵀ + bz, all in the output width.
            let s = linear(&u, &p.out_proj);
            let ds: Vec<f64> = dy.iter().zip(&gate).map(|(d, g)| d * g).collect();
            let dg: Vec<f64> = (0..rows * c).map(|k| dy[k] * s[k] * gate[k] * (1.0 - gate[k])).collect();
            let d_out_proj = linear_backward(&ds, &u, &p.out_proj, &mut du);
            (linear_backward(&dg, &z, &p.out_gate, &mut dz), d_out_proj)
        }
    };

    // LN_H, then the contraction.
    let (dt, d_norm_out) = norm_backward(&du, &t_hat, &t_rho, &p.norm_out);
    let (dleft, dright) = match problem.direction {
        Direction::Outgoing => {
            (channel_matmul(&dt, false, &right, false, shape, h), channel_matmul(&dt, true, &left, false, shape, h))
        }
        Direction::Incoming => {
            (channel_matmul(&right, false, &dt, true, shape, h), channel_matmul(&left, false, &dt, false, shape, h))
        }
    };

    // The gated projections, then LN_C.
    let (dlp, dlq) = gated_backward(&dleft, &lp, &lq, &m, h);
    let (drp, drq) = gated_backward(&dright, &rp, &rq, &m, h);
    let d_left_proj = linear_backward(&dlp, &z, &p.left_proj, &mut dz);
    let d_left_gate = linear_backward(&dlq, &z, &p.left_gate, &mut dz);
    let d_right_proj = linear_backward(&drp, &z, &p.right_proj, &mut dz);
    let d_right_gate = linear_backward(&drq, &z, &p.right_gate, &mut dz);
    let (dx, d_norm_in) = norm_backward(&dz, &x_hat, &x_rho, &p.norm_in);

    Gradients {
        x: dx,
        norm_in: d_norm_in,
        left_proj: d_left_proj,
        left_gate: d_left_gate,
        right_proj: d_right_proj,
        right_gate: d_right_gate,
        out_gate: d_out_gate,
        norm_out: d_norm_out,
        out_proj: d_out_proj,
    }
}

fn sigmoid(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

/// Rows per task in the row-parallel loops; also the fixed split of the sums over rows, so
/// that the reference gives the same bits on every run and thread count.
const ROWS_PER_TASK: usize = 64;

/// LayerNorm's normalisation of each row of width `width`: `v̂ = (v − μ)·ρ` with the biased
/// variance and `ρ = 1/√(var + eps)`; returns `v̂` and `ρ` per row.
fn normalise(v: &[f64], width: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let mut hat = vec![0.0; v.len()];
    let rho: Vec<f64> = v
        .chunks_exact(width)
        .zip(hat.chunks_exact_mut(width))
        .map(|(vr, hr)| {
            let mean = vr.iter().sum::<f64>() / width as f64;
            let var = vr.iter().map(|e| (e - mean) * (e - mean)).sum::<f64>() / width as f64;
            let rho = 1.0 / (var + eps).sqrt();
            for (hk, vk) in hr.iter_mut().zip(vr) {
                *hk = (vk - mean) * rho;
            }
            rho
        })
        .collect();
    (hat, rho)
}

/// `v̂ ⊙ γ + β` per row.
fn affine(hat: &[f64], n: &Norm64) -> Vec<f64> {
    let width = n.weight.len();
    hat.iter().enumerate().map(|(k, v)| v * n.weight[k % width] + n.bias[k % width]).collect()
}

/// LayerNorm's backward for one row: with `ĝ = dout ⊙ γ`,
/// `dv = ρ·(ĝ − mean(ĝ) − v̂·mean(ĝ ⊙ v̂))`; and `dγ = Σ_rows dout ⊙ v̂`, `dβ = Σ_rows dout`.
fn norm_backward(dout: &[f64], hat: &[f64], rho: &[f64], n: &Norm64) -> (Vec<f64>, Norm64) {
    let width = n.weight.len();
    let mut dv = vec![0.0; dout.len()];
    for (((dr, hr), vr), &rho) in
        dout.chunks_exact(width).zip(hat.chunks_exact(width)).zip(dv.chunks_exact_mut(width)).zip(rho)
    {
        let g: Vec<f64> = dr.iter().zip(&n.weight).map(|(d, w)| d * w).collect();
        let mean_g = g.iter().sum::<f64>() / width as f64;
        let mean_gh = g.iter().zip(hr).map(|(a, b)| a * b).sum::<f64>() / width as f64;
        for k in 0..width {
            vr[k] = rho * (g[k] - mean_g - hr[k] * mean_gh);
        }
    }
    let mut grad = Norm64 { weight: vec![0.0; width], bias: vec![0.0; width] };
    for (dr, hr) in dout.chunks_exact(width).zip(hat.chunks_exact(width)) {
        for k in 0..width {
            grad.weight[k] += dr[k] * hr[k];
            grad.bias[k] += dr[k];
        }
    }
    (dv, grad)
}

/// `v·Wᵀ + b` for every row of `v` (`[rows, in] → [rows, out]`).
fn linear(v: &[f64], l: &Linear64) -> Vec<f64> {
    let (inp, out) = (l.in_features, l.out_features);
    let mut y = vec![0.0; v.len() / inp * out];
    y.par_chunks_mut(out).zip(v.par_chunks(inp)).for_each(|(yr, vr)| {
        for (o, yo) in yr.iter_mut().enumerate() {
            let w = &l.weight[o * inp..(o + 1) * inp];
            *yo = w.iter().zip(vr).map(|(a, b)| a * b).sum::<f64>() + l.bias.as_ref().map_or(0.0, |b| b[o]);
        }
    });
    y
}

/// The backward of `out = v·Wᵀ + b` given `dout` (`[rows, out]`) and the layer's input `v`
/// (`[rows, in]`): adds `dout·W` to `dv` and returns `dW = Σ_rows doutᵀ·v` and `db = Σ_rows dout`
/// (when the layer has a bias).
fn linear_backward(dout: &[f64], v: &[f64], l: &Linear64, dv: &mut [f64]) -> Linear64 {
    let (inp, out) = (l.in_features, l.out_features);
    dv.par_chunks_mut(inp).zip(dout.par_chunks(out)).for_each(|(dvr, dor)| {
        for (o, d) in dor.iter().enumerate() {
            for (dk, wk) in dvr.iter_mut().zip(&l.weight[o * inp..(o + 1) * inp]) {
                *dk += d * wk;
            }
        }
    });
    // dW in fixed blocks of rows, summed in order.
    let partial: Vec<(Vec<f64>, Vec<f64>)> = dout
        .par_chunks(ROWS_PER_TASK * out)
        .zip(v.par_chunks(ROWS_PER_TASK * inp))
        .map(|(db_rows, v_rows)| {
            let (mut dw, mut db) = (vec![0.0; out * inp], vec![0.0; out]);
            for (dor, vr) in db_rows.chunks_exact(out).zip(v_rows.chunks_exact(inp)) {
                for (o, &d) in dor.iter().enumerate() {
                    db[o] += d;
                    for (w, x) in dw[o * inp..(o + 1) * inp].iter_mut().zip(vr) {
                        *w += d * x;
                    }
                }
            }
            (dw, db)
        })
        .collect();
    let (mut weight, mut bias) = (vec![0.0; out * inp], vec![0.0; out]);
    for (dw, db) in &partial {
        weight.iter_mut().zip(dw).for_each(|(a, b)| *a += b);
        bias.iter_mut().zip(db).for_each(|(a, b)| *a += b);
    }
    Linear64 { weight, bias: l.bias.as_ref().map(|_| bias), out_features: out, in_features: inp }
}

/// `p ⊙ σ(q) ⊙ m` (`m` one value per row).
fn gated(p: &[f64], q: &[f64], m: &[f64], h: usize) -> Vec<f64> {
    (0..p.len()).map(|k| p[k] * sigmoid(q[k]) * m[k / h]).collect()
}

/// The backward of [`gated`]: `dp = d ⊙ σ(q) ⊙ m`, `dq = d ⊙ p ⊙ m ⊙ σ(q)(1 − σ(q))`.
fn gated_backward(d: &[f64], p: &[f64], q: &[f64], m: &[f64], h: usize) -> (Vec<f64>, Vec<f64>) {
    let s: Vec<f64> = q.iter().map(|&v| sigmoid(v)).collect();
    let dp = (0..d.len()).map(|k| d[k] * s[k] * m[k / h]).collect();
    let dq = (0..d.len()).map(|k| d[k] * p[k] * m[k / h] * s[k] * (1.0 - s[k])).collect();
    (dp, dq)
}

/// For every batch `b` and hidden channel `h`, the N×N product `op(A)·op(B)` of the matrices
/// `A[p,q] = a[b,p,q,h]` and `B[p,q] = bm[b,p,q,h]` (`[B,N,N,H]` each, as is the result), where
/// `op` transposes when `ta` / `tb` is set: `out[b,p,q,h] = Σ_k op(A)[p,k]·op(B)[k,q]`.
fn channel_matmul(a: &[f64], ta: bool, bm: &[f64], tb: bool, shape: Shape, h: usize) -> Vec<f64> {
    let n = shape.n;
    let at = |b: usize, p: usize, q: usize| ((b * n + p) * n + q) * h;
    let mut out = vec![0.0; shape.rows() * h];
    out.par_chunks_mut(h).enumerate().for_each(|(row, o)| {
        let (b, p, q) = (row / (n * n), (row / n) % n, row % n);
        for k in 0..n {
            let ia = if ta { at(b, k, p) } else { at(b, p, k) };
            let ib = if tb { at(b, q, k) } else { at(b, k, q) };
            for c in 0..h {
                o[c] += a[ia + c] * bm[ib + c];
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::super::{backward, contract, forward, forward_model, Lin, Ln, Model};
    use super::*;
    use crate::error::Error;
    use crate::problem::Config;
    use crate::rand::Rng;

    /// `y` of [`super::super::forward`]'s computation at the point `p` (x and weights in f64).
    fn forward_at_point(p: &Gradients, problem: &Problem, mask: Option<&[f32]>) -> Vec<f64> {
        let lin =
            |l: &Linear64| Lin { w: l.weight.clone(), b: l.bias.clone(), inp: l.in_features, out: l.out_features };
        let ln = |n: &Norm64| Ln { w: n.weight.clone(), b: n.bias.clone(), eps: f64::from(problem.eps) };
        let m = Model {
            problem: *problem,
            x: &p.x[..],
            mask,
            norm_in: ln(&p.norm_in),
            left_proj: lin(&p.left_proj),
            left_gate: lin(&p.left_gate),
            right_proj: lin(&p.right_proj),
            right_gate: lin(&p.right_gate),
            out_gate: lin(&p.out_gate),
            norm_out: ln(&p.norm_out),
            out_proj: lin(&p.out_proj),
        };
        forward_model(&m)
    }

    /// Mutable access to every tensor of a point, in the order of [`Gradients::tensors`].
    fn linear_mut(l: &mut Linear64) -> Vec<&mut Vec<f64>> {
        std::iter::once(&mut l.weight).chain(&mut l.bias).collect()
    }

    fn tensors_mut(p: &mut Gradients) -> Vec<&mut Vec<f64>> {
        let mut out = vec![&mut p.x, &mut p.norm_in.weight, &mut p.norm_in.bias];
        for l in [&mut p.left_proj, &mut p.left_gate, &mut p.right_proj, &mut p.right_gate, &mut p.out_gate] {
            out.extend(linear_mut(l));
        }
        out.extend([&mut p.norm_out.weight, &mut p.norm_out.bias]);
        out.extend(linear_mut(&mut p.out_proj));
        out
    }

    #[derive(Clone)]
    struct Case {
        weights: Weights,
        problem: Problem,
        x: Vec<f32>,
        mask: Option<Vec<f32>>,
        dy: Vec<f32>,
    }

    impl Case {
        fn mask(&self) -> Option<&[f32]> {
            self.mask.as_deref()
        }

        fn label(&self) -> String {
            let p = &self.problem;
            let biases = if self.weights.has_biases() { "+biases" } else { "" };
            format!(
                "{}{biases} {} masked={} B={} N={}",
                p.config.formulation, p.direction, p.masked, p.shape.batch, p.shape.n
            )
        }
    }

    /// Small shapes with C ≠ H (a swapped width would not line up) and af3's gate width C ≠ H.
    const C: usize = 6;
    const H: usize = 4;

    fn case(f: Formulation, biases: bool, d: Direction, masked: bool, cauchy: bool, shape: Shape, seed: u64) -> Case {
        let cfg = Config::new(f, C, H).unwrap();
        let weights = Weights::random(cfg, biases, seed).unwrap();
        let problem = Problem::new(cfg, shape, d, masked).unwrap();
        let mut rng = Rng::new(seed ^ 0xbac4);
        let x = if cauchy { rng.cauchy_vec(problem.x_len(), 2.0) } else { rng.normal_vec(problem.x_len(), 1.0) };
        let mask = masked.then(|| rng.mask_vec(problem.mask_len()));
        let dy = rng.normal_vec(problem.x_len(), 1.0);
        Case { weights, problem, x, mask, dy }
    }

    /// Every combination the backward distinguishes: both formulations (af3 with and without
    /// biases), both directions, with and without a mask; normal and Cauchy `x` alternate.
    fn cases(shape: Shape) -> Vec<Case> {
        let mut out = Vec::new();
        let forms = [(Formulation::GpuMode, false), (Formulation::Af3, false), (Formulation::Af3, true)];
        for (fi, (f, biases)) in forms.into_iter().enumerate() {
            for (di, d) in [Direction::Outgoing, Direction::Incoming].into_iter().enumerate() {
                for (mi, masked) in [false, true].into_iter().enumerate() {
                    let seed = (fi * 4 + di * 2 + mi) as u64 + 100;
                    out.push(case(f, biases, d, masked, (fi + di + mi) % 2 == 1, shape, seed));
                }
            }
        }
        out
    }

    /// `L(p) = Σ dy ⊙ y(p)`.
    fn loss(p: &Gradients, c: &Case, dy: &[f64]) -> f64 {
        forward_at_point(p, &c.problem, c.mask()).iter().zip(dy).map(|(a, b)| a * b).sum()
    }

    /// The central difference of `L` along `v` at `p`: `(L(p + εv) − L(p − εv)) / 2ε`.
    fn directional(p: &Gradients, v: &Gradients, eps: f64, c: &Case, dy: &[f64]) -> f64 {
        let shifted = |sign: f64| {
            let mut q = p.clone();
            for (t, d) in tensors_mut(&mut q).into_iter().zip(v.tensors()) {
                t.iter_mut().zip(d.1).for_each(|(a, b)| *a += sign * eps * b);
            }
            loss(&q, c, dy)
        };
        (shifted(1.0) - shifted(-1.0)) / (2.0 * eps)
    }

    /// Per tensor, the largest `|g − fd| / (|fd| + max|fd|)` over its elements, where `g` is the
    /// gradient under test and `fd` the central difference of `L` in that element with step
    /// `STEP·(1 + |θ|)` (one pair of forwards per element).
    fn worst_against_differences(c: &Case, grads: &Gradients) -> Vec<(String, f64)> {
        const STEP: f64 = 2e-6;
        let dy = widen(&c.dy);
        let mut p = Gradients::at(&c.weights, &c.x);
        let mut out = Vec::new();
        for (ti, (name, g)) in grads.tensors().into_iter().enumerate() {
            let fd: Vec<f64> = (0..g.len())
                .map(|e| {
                    let orig = tensors_mut(&mut p)[ti][e];
                    let step = STEP * (1.0 + orig.abs());
                    let mut at = |v: f64| {
                        tensors_mut(&mut p)[ti][e] = v;
                        loss(&p, c, &dy)
                    };
                    let d = (at(orig + step) - at(orig - step)) / (2.0 * step);
                    tensors_mut(&mut p)[ti][e] = orig;
                    d
                })
                .collect();
            let scale = fd.iter().fold(0.0f64, |a, v| a.max(v.abs()));
            let worst = g.iter().zip(&fd).map(|(a, b)| (a - b).abs() / (b.abs() + scale)).fold(0.0, f64::max);
            out.push((name, worst));
        }
        out
    }

    fn gradients(c: &Case) -> Gradients {
        backward(&c.weights, &c.problem, &c.x, c.mask(), &c.dy).unwrap()
    }

    /// Tolerance of [`worst_against_differences`], relative to the tensor's largest gradient.
    ///
    /// In f64 the central difference with step `s` errs by its truncation `s²·|∂³L|/6` plus the
    /// rounding of the loss, `≈ 1e-16·Σ|dy ⊙ y| / s`. Measured over the twelve cases at N = 4:
    /// with `s = 1e-4` the worst was 1.7e-6 and with 1e-5 3.8e-8 (truncation, falling as `s²`),
    /// with 1e-6 9.9e-9 (rounding, rising as `1/s`). `s = 2e-6` sits between: worst 4.3e-9 at
    /// N = 4 and 7.5e-9 at the N = 3 the test runs, so 1e-6 leaves a margin above 100. A wrong
    /// formula, transpose or missing factor is off by O(1) in some element
    /// (`the_checks_reject_wrong_gradients`).
    const DIFFERENCE_TOL: f64 = 1e-6;

    /// Tolerance of [`identity_error`]: the Richardson-extrapolated difference errs by `O(ε⁴)`
    /// truncation plus `O(1e-16·Σ|dy ⊙ y| / ε)` rounding; at `ε = 3e-5` the measured worst over the
    /// twelve cases was 1.4e-12 (with `ε = 1e-3` the truncation alone reached 6e-7 on one case,
    /// `1e-4` gave 6e-11), so 1e-9 leaves a margin of about 700.
    const IDENTITY_TOL: f64 = 1e-9;

    /// Every element of every gradient (x and all weights and biases) against central
    /// differences of the forward, in every case of [`cases`] (B = 2, N = 3, C = 6, H = 4).
    #[test]
    fn every_gradient_matches_central_differences() {
        for c in cases(Shape::new(2, 3)) {
            let grads = gradients(&c);
            let names: Vec<String> = grads.tensors().into_iter().map(|(n, _)| n).collect();
            assert_eq!(names.len(), if c.weights.has_biases() { 17 } else { 11 }, "{}", c.label());
            let worst = worst_against_differences(&c, &grads);
            let (name, err) = worst.iter().cloned().fold((String::new(), 0.0), |a, b| if b.1 > a.1 { b } else { a });
            eprintln!("{}: worst {err:.1e} ({name})", c.label());
            for (name, err) in worst {
                assert!(err < DIFFERENCE_TOL, "{}: {name} differs from central differences by {err:.2e}", c.label());
            }
        }
    }

    /// The sum over all tensors of `⟨g, v⟩`.
    fn inner(g: &Gradients, v: &Gradients) -> f64 {
        g.tensors()
            .into_iter()
            .zip(v.tensors())
            .map(|((_, a), (_, b))| a.iter().zip(b).map(|(p, q)| p * q).sum::<f64>())
            .sum()
    }

    /// A random direction with the layout of `p`.
    fn random_direction(p: &Gradients, seed: u64) -> Gradients {
        let mut rng = Rng::new(seed);
        let mut v = p.clone();
        for t in tensors_mut(&mut v) {
            t.iter_mut().for_each(|e| *e = rng.normal());
        }
        v
    }

    /// `|⟨dy, J·v⟩ − ⟨Jᵀ·dy, v⟩| / Σ|Jᵀ·dy ⊙ v|` for a random direction `v` in all inputs at once
    /// (x and every weight and bias): `⟨dy, J·v⟩` by Richardson-extrapolated central differences
    /// of `L` along `v`, `⟨Jᵀ·dy, v⟩` from the gradients `grads`. Two pairs of forwards check every
    /// gradient at once; an error in any tensor moves the inner product by O(1) of that tensor's
    /// share.
    fn identity_error(c: &Case, grads: &Gradients, seed: u64) -> f64 {
        let p = Gradients::at(&c.weights, &c.x);
        let v = random_direction(&p, seed);
        let dy = widen(&c.dy);
        let eps = 3e-5;
        let jv = (4.0 * directional(&p, &v, eps / 2.0, c, &dy) - directional(&p, &v, eps, c, &dy)) / 3.0;
        let scale: f64 = grads
            .tensors()
            .into_iter()
            .zip(v.tensors())
            .map(|((_, a), (_, b))| a.iter().zip(b).map(|(p, q)| (p * q).abs()).sum::<f64>())
            .sum();
        (jv - inner(grads, &v)).abs() / scale
    }

    #[test]
    fn inner_product_identity_holds_in_a_random_direction() {
        for (k, c) in cases(Shape::new(2, 5)).iter().enumerate() {
            let err = identity_error(c, &gradients(c), 7 + k as u64);
            eprintln!("{}: ⟨dy, J·v⟩ vs ⟨Jᵀ·dy, v⟩: {err:.1e}", c.label());
            assert!(err < IDENTITY_TOL, "{}: {err:.2e}", c.label());
        }
    }

    /// The checks above can fail: gradients with a wrong transpose or a missing factor are
    /// rejected by both. The contraction's gradient for the other direction is exactly the
    /// outgoing/incoming transpose mix-up; a transposed `[C, C]` gate gradient (af3) and a
    /// gradient of LN_H's shift scaled by 1 + 1e-3 are the other faults.
    #[test]
    fn the_checks_reject_wrong_gradients() {
        let c = case(Formulation::Af3, true, Direction::Outgoing, true, false, Shape::new(1, 4), 9);
        let good = gradients(&c);
        assert!(identity_error(&c, &good, 1) < IDENTITY_TOL);

        let flipped = Problem { direction: Direction::Incoming, ..c.problem };
        let wrong_direction = backward(&c.weights, &flipped, &c.x, c.mask(), &c.dy).unwrap();
        let mut transposed_gate = good.clone();
        let w = &mut transposed_gate.out_gate.weight;
        for i in 0..C {
            for j in 0..i {
                w.swap(i * C + j, j * C + i);
            }
        }
        let mut scaled_shift = good.clone();
        scaled_shift.norm_out.bias.iter_mut().for_each(|b| *b *= 1.0 + 1e-3);

        for (fault, wrong, tensor) in [
            ("the other direction's contraction", &wrong_direction, "x"),
            ("a transposed out_gate.weight", &transposed_gate, "out_gate.weight"),
            ("a scaled norm_out.bias", &scaled_shift, "norm_out.bias"),
        ] {
            let worst = worst_against_differences(&c, wrong);
            let err = worst.iter().find(|(n, _)| n == tensor).unwrap().1;
            assert!(err > DIFFERENCE_TOL, "{fault}: the difference check passes ({tensor} within {err:.1e})");
            let id = identity_error(&c, wrong, 1);
            eprintln!("{fault}: {tensor} off by {err:.1e} of its largest gradient, the identity by {id:.1e}");
            assert!(id > IDENTITY_TOL, "{fault}: the identity holds to {id:.1e}");
        }
    }

    /// The backward's own forward (kept for its intermediates) is the forward: its contraction
    /// helper forms SPEC.md's two contractions, checked against the forward's index-form one.
    #[test]
    fn channel_matmul_forms_both_contractions() {
        let shape = Shape::new(2, 5);
        let mut rng = Rng::new(3);
        let (l, r): (Vec<f64>, Vec<f64>) = (0..shape.rows() * 3).map(|_| (rng.normal(), rng.normal())).unzip();
        let out = channel_matmul(&l, false, &r, true, shape, 3);
        let inc = channel_matmul(&l, true, &r, false, shape, 3);
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12);
        assert!(close(&out, &contract(&l, &r, shape, 3, Direction::Outgoing)));
        assert!(close(&inc, &contract(&l, &r, shape, 3, Direction::Incoming)));
        assert!(!close(&out, &inc));
    }

    /// The linearity checks that need no differences: `dy = 0` gives zero gradients, and the
    /// gradients are linear in `dy`; an all-zero mask leaves the four projections without
    /// gradient (left = right = 0 whatever they are).
    #[test]
    fn zero_dy_zero_mask_and_linearity() {
        let c = case(Formulation::GpuMode, false, Direction::Incoming, true, true, Shape::new(2, 3), 5);
        let zero = Case { dy: vec![0.0; c.dy.len()], ..c.clone() };
        assert!(gradients(&zero).tensors().iter().all(|(_, t)| t.iter().all(|&v| v == 0.0)));

        let g = gradients(&c);
        let scaled = Case { dy: c.dy.iter().map(|v| -2.0 * v).collect(), ..c.clone() };
        for ((name, a), (_, b)) in g.tensors().into_iter().zip(gradients(&scaled).tensors()) {
            assert!(a.iter().zip(b).all(|(p, q)| (-2.0 * p - q).abs() <= 1e-12 * (1.0 + p.abs())), "{name}");
        }

        let c = case(Formulation::Af3, true, Direction::Outgoing, true, false, Shape::new(1, 3), 6);
        let unmasked = Case { mask: Some(vec![0.0; c.problem.mask_len()]), ..c };
        let g = gradients(&unmasked);
        for (name, l) in &g.linears()[..4] {
            assert!(l.weight.iter().chain(l.bias.iter().flatten()).all(|&v| v == 0.0), "{name}");
        }
        assert!(g.norm_out.weight.iter().all(|&v| v == 0.0), "t = 0 so t̂ = 0: no gradient for LN_H's scale");
        assert!(g.x.iter().any(|&v| v != 0.0), "the output gate still depends on x");
    }

    #[test]
    fn bad_inputs_are_errors() {
        let c = case(Formulation::GpuMode, false, Direction::Outgoing, true, false, Shape::new(1, 3), 1);
        let e = backward(&c.weights, &c.problem, &c.x, c.mask(), &c.dy[1..]).unwrap_err();
        assert!(matches!(&e, Error::Shape(m) if m.contains("dy has")), "{e}");
        assert!(matches!(backward(&c.weights, &c.problem, &c.x, None, &c.dy), Err(Error::Shape(_))));
        assert!(matches!(backward(&c.weights, &c.problem, &c.x[1..], c.mask(), &c.dy), Err(Error::Shape(_))));
        let other = Weights::random(Config::new(Formulation::Af3, C, H).unwrap(), false, 1).unwrap();
        assert!(matches!(backward(&other, &c.problem, &c.x, c.mask(), &c.dy), Err(Error::Weights(_))));
        // The f32 entry point is the point-wise one: forward at the f32 point agrees too.
        let p = Gradients::at(&c.weights, &c.x);
        let y = forward(&c.weights, &c.problem, &c.x, c.mask()).unwrap();
        assert_eq!(forward_at_point(&p, &c.problem, c.mask()), y);
    }
}
