//! The CPU backward pass: every gradient of `L` given `dy`, in f32, recomputing the forward's
//! intermediates from `x` (the "recompute everything" mode of `docs/backward.md`, which derives
//! each line below).
//!
//! # Math (per row `r`, `⊙` elementwise, `Σ_r` over all `M = B·N²` rows)
//! ```text
//! A  x̂, ρ_x, z = LN_C(x);  P = z·Wcatᵀ + bcat;  left = pL⊙σ(qL)⊙m,  right = pR⊙σ(qR)⊙m
//! B  t = L·Rᵀ (outgoing) or Lᵀ·R (incoming), per (b, h)
//! C  t̂, ρ_t, u = LN_H(t)
//!    gpumode: o = σ(P_G), v = u⊙o, dv = dy·Wout, dWout = Σ_r dyᵀ·v, du = dv⊙o, dG = dv⊙u⊙o(1−o)
//!    af3:     g = σ(P_G), s = u·Wzᵀ + bz, ds = dy⊙g, dWz = Σ_r dsᵀ·u, dbz = Σ_r ds,
//!             du = ds·Wz, dG = dy⊙s⊙g(1−g)
//!    dγ_out = Σ_r du⊙t̂, dβ_out = Σ_r du, dt = ρ_t·(ĝ − mean(ĝ) − t̂·mean(ĝ⊙t̂)), ĝ = du⊙γ_out
//! D  outgoing dL = dT·R, dR = dTᵀ·L;  incoming dL = R·dTᵀ, dR = L·dT, per (b, h)
//! E  dp = dleft⊙σ(q)⊙m, dq = dleft⊙p⊙m⊙σ(q)(1−σ(q)) (left and right), D = [dpL dqL dpR dqR dG]
//!    dWcat = Σ_r Dᵀ·z, dbcat = Σ_r D, dz = D·Wcat
//!    dγ_in = Σ_r dz⊙x̂, dβ_in = Σ_r dz, dx = ρ_x·(ĝ − mean(ĝ) − x̂·mean(ĝ⊙x̂)), ĝ = dz⊙γ_in
//! ```
//!
//! # Layout and threading
//! Stages A, C and E run over blocks of [`ROWS`] consecutive rows in parallel, each with its own
//! scratch; B and D run one `N × N × N` GEMM per `(b, h)` in parallel. A row-block stage writes
//! position-major tensors (`left`, `right`, `dt`: `[M, H]`; the gate gradient `[M, G]`), so each
//! block owns one contiguous run; `left`, `right` and `dt` are then transposed to hidden-major
//! `[B, H, N²]`, the layout the `(b, h)` stages read and write (`t`, `dleft`, `dright`), so that
//! every GEMM operand is a unit-stride matrix. The row stages gather what they read of `t`,
//! `dleft` and `dright` per block. Memory: at most five `M·H` tensors at once (`left`, `right`, `t` or `dt`,
//! `dleft`, `dright`), `M·G` and `dx`, all f32, plus per-thread block scratch; the backward is not
//! chunked and does not follow the layer's memory budget.
//!
//! # Work
//! Besides the backward proper (`2F`, `docs/backward.md`), it recomputes the forward's
//! contraction and the left/right projections (stage A), the gate projection (C) and the four
//! projections again (E): LN_C runs three times and the `4H` part of the input projection twice.
//!
//! # Precision
//! GEMMs and storage are f32; LayerNorm statistics and the per-row means of the LayerNorm
//! backward are f64. A weight gradient sums over all `M` rows (a million at N = 1024): each
//! block's GEMM sums its 128 rows in f32, and the blocks are summed in f64.
#![forbid(unsafe_code)]

use rayon::prelude::*;

use super::elementwise::{sigmoid, simd, sum_f64, sum_sq_dev_f64};
use super::prepared::CpuPrepared;
use crate::backend::host_gemm::{matmul, MatMut, MatRef, Parallelism};
use crate::device_io::BackwardIo;
use crate::error::Result;
use crate::gradients::Gradients;
use crate::hostmem::try_reserve;
use crate::problem::{Direction, Formulation, Problem};
use crate::weights::{Linear, Norm};

/// Rows per block of the row-parallel stages (A, C, E): a block's `z`, `P` and gradients stay
/// inside a core's L2 at C = H = 128.
const ROWS: usize = 128;

/// The sizes every stage uses.
#[derive(Copy, Clone)]
struct Dims {
    c: usize,
    h: usize,
    /// Output gate width `G`.
    g: usize,
    /// Fused projection width `4H + G`.
    f: usize,
    n: usize,
    n2: usize,
    eps: f64,
    /// Row blocks a rayon task takes at least: about [`TASKS_PER_THREAD`] tasks per thread, so
    /// that the scratch and f64 sums each task makes and merges (about 2 MiB at C = H = 128) are
    /// made a few times per thread, not once per block.
    min_blocks: usize,
}

/// Tasks per thread in the row stages: more than one so rayon can balance uneven threads.
const TASKS_PER_THREAD: usize = 4;

/// Gradients of `L = Σ dy ⊙ y` for `x` (`[B,N,N,C]`), `mask` (`[B,N,N]`, none: all ones) and
/// `dy` (`[B,N,N,C]`); the caller has checked them against `problem`
/// (`backend::check_backward_io`).
pub(super) fn backward(prep: &CpuPrepared, problem: &Problem, io: BackwardIo<'_>) -> Result<Gradients> {
    let BackwardIo { x, mask, dy } = io;
    let config = problem.config;
    let n = problem.shape.n;
    let d = Dims {
        c: config.c,
        h: config.h,
        g: config.gate_width(),
        f: config.fused_proj_width(),
        n,
        n2: n * n,
        eps: f64::from(problem.eps),
        min_blocks: problem
            .shape
            .rows()
            .div_ceil(ROWS)
            .div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD)
            .max(1),
    };
    let m = problem.shape.rows();
    let mh = m * d.h;
    let mut left = zeros(mh, "backward: left")?;
    let mut right = zeros(mh, "backward: right")?;
    project_lr(prep, &d, x, mask, &mut left, &mut right)?;
    // Hidden-major for the GEMMs, one tensor at a time through one spare buffer.
    let mut spare = zeros(mh, "backward: t")?;
    hidden_major(&d, &left, &mut spare);
    std::mem::swap(&mut left, &mut spare);
    hidden_major(&d, &right, &mut spare);
    std::mem::swap(&mut right, &mut spare);
    let mut t = spare;
    contract(&d, problem.direction, &left, &right, &mut t)?;

    let mut dt_rows = zeros(mh, "backward: dt")?;
    let mut dgate = zeros(m * d.g, "backward: output gate gradient")?;
    let out_sums = output_backward(prep, &d, problem.config.formulation, x, dy, &t, &mut dt_rows, &mut dgate)?;
    // t is dead: dt, hidden-major, goes into its buffer.
    hidden_major(&d, &dt_rows, &mut t);
    drop(dt_rows);
    let dt = t;

    let (mut dleft, mut dright) = (zeros(mh, "backward: dleft")?, zeros(mh, "backward: dright")?);
    contract_backward(&d, problem.direction, &dt, &left, &right, &mut dleft, &mut dright)?;
    drop((dt, left, right));

    let mut dx = zeros(m * d.c, "backward: dx")?;
    let in_sums = input_backward(prep, &d, x, mask, &dleft, &dright, &dgate, &mut dx)?;
    Ok(assemble(prep, &d, dx, &in_sums, &out_sums))
}

/// `len` zeros, or [`crate::Error::OutOfMemory`] naming `what`. Written by all threads: these
/// tensors are tens of MiB, and one thread zeroing them (and taking their page faults) showed as
/// a serial share of the backward's time on 16 threads.
fn zeros(len: usize, what: &str) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    try_reserve(&mut v, len, what)?;
    v.par_extend(rayon::iter::repeat_n(0.0f32, len));
    Ok(v)
}

/// Scratch of the row stages, made once per rayon task and reused by its blocks (no allocation
/// per block).
struct Scratch {
    xhat: Vec<f32>,
    rho: Vec<f64>,
    z: Vec<f32>,
    p: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    prod: Vec<f32>,
    /// `[ROWS, H]`: a block's rows of t, then du.
    t: Vec<f32>,
    rho_t: Vec<f64>,
    /// `[ROWS, max(C, H)]` each: gpumode's v and dv, af3's s and ds.
    e1: Vec<f32>,
    e2: Vec<f32>,
    /// `[ROWS, 4H + G]`: the pre-activation gradients.
    dcat: Vec<f32>,
    /// `[ROWS, C]`.
    dz: Vec<f32>,
}

impl Scratch {
    fn new(d: &Dims) -> Scratch {
        let wide = d.f.max(d.c).max(d.h);
        Scratch {
            xhat: vec![0.0; ROWS * d.c],
            rho: vec![0.0; ROWS],
            z: vec![0.0; ROWS * d.c],
            p: vec![0.0; ROWS * d.f],
            a: vec![0.0; ROWS * wide],
            b: vec![0.0; ROWS * wide],
            prod: vec![0.0; d.f.max(d.c) * d.c.max(d.h)],
            t: vec![0.0; ROWS * d.h],
            rho_t: vec![0.0; ROWS],
            e1: vec![0.0; ROWS * d.c.max(d.h)],
            e2: vec![0.0; ROWS * d.c.max(d.h)],
            dcat: vec![0.0; ROWS * d.f],
            dz: vec![0.0; ROWS * d.c],
        }
    }
}

/// Sums over rows, accumulated in f64 across blocks.
#[derive(Clone)]
struct Sums(Vec<Vec<f64>>);

impl Sums {
    fn zeros(lens: &[usize]) -> Sums {
        Sums(lens.iter().map(|&l| vec![0.0; l]).collect())
    }

    fn merge(mut self, other: Sums) -> Sums {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
        }
        self
    }

    fn add(&mut self, i: usize, v: &[f32]) {
        for (a, &b) in self.0[i].iter_mut().zip(v) {
            *a += f64::from(b);
        }
    }

    /// Adds each row of `width` values of `v` into sum `i` (a bias gradient).
    fn add_rows(&mut self, i: usize, v: &[f32], width: usize) {
        for row in v.chunks_exact(width) {
            self.add(i, row);
        }
    }

    fn f32(&self, i: usize) -> Vec<f32> {
        self.0[i].iter().map(|&v| v as f32).collect()
    }
}

/// LN_C of a block's rows of `x`: `x̂` and `ρ` (kept for the backward) and `z = x̂⊙γ + β`.
fn norm_in(prep: &CpuPrepared, d: &Dims, xb: &[f32], s: &mut Scratch) {
    let rows = xb.len() / d.c;
    normalise(xb, d.c, d.eps, &mut s.xhat[..rows * d.c], &mut s.rho[..rows]);
    simd(
        #[inline(always)]
        || {
            for (zr, xr) in s.z[..rows * d.c].chunks_exact_mut(d.c).zip(s.xhat.chunks_exact(d.c)) {
                for (((z, &v), &w), &b) in zr.iter_mut().zip(xr).zip(&prep.norm_in_w).zip(&prep.norm_in_b) {
                    *z = v * w + b;
                }
            }
        },
    );
}

/// `v̂ = (v − μ)·ρ` per row of `width` values, statistics two-pass in f64.
fn normalise(v: &[f32], width: usize, eps: f64, hat: &mut [f32], rho: &mut [f64]) {
    simd(
        #[inline(always)]
        || {
            for ((vr, hr), r) in v.chunks_exact(width).zip(hat.chunks_exact_mut(width)).zip(rho.iter_mut()) {
                let mean = sum_f64(vr) / width as f64;
                let var = sum_sq_dev_f64(vr, mean) / width as f64;
                *r = 1.0 / (var + eps).sqrt();
                for (h, &x) in hr.iter_mut().zip(vr) {
                    *h = ((f64::from(x) - mean) * *r) as f32;
                }
            }
        },
    );
}

/// The LayerNorm backward of one block: `dv = ρ·(ĝ − mean(ĝ) − v̂·mean(ĝ⊙v̂))` with `ĝ = dout⊙γ`,
/// and the block's `Σ dout⊙v̂` and `Σ dout` into sums [`NORM_W`] and [`NORM_B`].
fn norm_backward(dout: &[f32], hat: &[f32], rho: &[f64], gamma: &[f32], dv: &mut [f32], sums: &mut Sums) {
    let width = gamma.len();
    simd(
        #[inline(always)]
        || {
            for (((dr, hr), &r), out) in
                dout.chunks_exact(width).zip(hat.chunks_exact(width)).zip(rho).zip(dv.chunks_exact_mut(width))
            {
                let (mut mg, mut mgh) = (0.0f64, 0.0f64);
                for ((&g, &h), &w) in dr.iter().zip(hr).zip(gamma) {
                    let gh = f64::from(g) * f64::from(w);
                    mg += gh;
                    mgh += gh * f64::from(h);
                }
                let (mg, mgh) = (mg / width as f64, mgh / width as f64);
                for (((o, &g), &h), &w) in out.iter_mut().zip(dr).zip(hr).zip(gamma) {
                    *o = (r * (f64::from(g) * f64::from(w) - mg - f64::from(h) * mgh)) as f32;
                }
                for ((a, &g), &h) in sums.0[NORM_W].iter_mut().zip(dr).zip(hr) {
                    *a += f64::from(g) * f64::from(h);
                }
                for (a, &g) in sums.0[NORM_B].iter_mut().zip(dr) {
                    *a += f64::from(g);
                }
            }
        },
    );
}

/// `out[rows, w1 − w0] = z·Wcat[w0..w1]ᵀ + bcat[w0..w1]`.
fn project(prep: &CpuPrepared, d: &Dims, z: &[f32], rows: usize, w0: usize, w1: usize, out: &mut [f32]) -> Result<()> {
    let width = w1 - w0;
    let dst = MatMut::new(&mut out[..rows * width], rows, width, width, 1)?;
    let lhs = MatRef::new(z, rows, d.c, d.c, 1)?;
    let rhs = MatRef::new(&prep.w_cat[w0 * d.c..w1 * d.c], d.c, width, 1, d.c)?;
    matmul(dst, lhs, rhs, Parallelism::None)?;
    simd(
        #[inline(always)]
        || {
            for row in out[..rows * width].chunks_exact_mut(width) {
                for (v, &b) in row.iter_mut().zip(&prep.b_cat[w0..w1]) {
                    *v += b;
                }
            }
        },
    );
    Ok(())
}

/// Stage A: `left` and `right`, position-major `[M, H]`.
fn project_lr(
    prep: &CpuPrepared,
    d: &Dims,
    x: &[f32],
    mask: Option<&[f32]>,
    left: &mut [f32],
    right: &mut [f32],
) -> Result<()> {
    let h = d.h;
    left.par_chunks_mut(ROWS * h)
        .zip(right.par_chunks_mut(ROWS * h))
        .enumerate()
        .with_min_len(d.min_blocks)
        .try_for_each_init(
            || Scratch::new(d),
            |s, (blk, (lb, rb))| {
                let rows = lb.len() / h;
                let r0 = blk * ROWS;
                norm_in(prep, d, &x[r0 * d.c..(r0 + rows) * d.c], s);
                project(prep, d, &s.z[..rows * d.c], rows, 0, 4 * h, &mut s.p)?;
                let mask = mask.map(|mk| &mk[r0..r0 + rows]);
                simd(
                    #[inline(always)]
                    || gate_left_right(&s.p[..rows * 4 * h], h, mask, lb, rb),
                );
                Ok(())
            },
        )
}

// The element-wise loops with a sigmoid. Every closure handed to `simd` is `#[inline(always)]`
// (as the forward's are): without it the closure was not inlined into pulp's AVX2+FMA function,
// and `exp_f32`'s `mul_add` became a call of the `fmaf` library function (a fifth of the
// backward's time under `perf`).

/// `left = pL⊙σ(qL)⊙m`, `right = pR⊙σ(qR)⊙m` for a block's rows of `P` (`[rows, 4H]`).
#[inline(always)]
fn gate_left_right(p: &[f32], h: usize, mask: Option<&[f32]>, left: &mut [f32], right: &mut [f32]) {
    for (r, ((pr, lr), rr)) in
        p.chunks_exact(4 * h).zip(left.chunks_exact_mut(h)).zip(right.chunks_exact_mut(h)).enumerate()
    {
        let m = mask.map_or(1.0, |mk| mk[r]);
        let (lp, rest) = pr.split_at(h);
        let (lg, rest) = rest.split_at(h);
        let (rp, rg) = rest.split_at(h);
        for ((((l, &a), &b), &c2), (r, &e)) in lr.iter_mut().zip(lp).zip(lg).zip(rp).zip(rr.iter_mut().zip(rg)) {
            *l = a * sigmoid(b) * m;
            *r = c2 * sigmoid(e) * m;
        }
    }
}

/// gpumode's `v = u⊙σ(q)`.
#[inline(always)]
fn gate_hidden(v: &mut [f32], u: &[f32], q: &[f32]) {
    for ((v, &u), &q) in v.iter_mut().zip(u).zip(q) {
        *v = u * sigmoid(q);
    }
}

/// gpumode's `du = dv⊙o` and gate pre-activation gradient `dv⊙u⊙o(1 − o)`, `o = σ(q)`.
#[inline(always)]
fn gpumode_gate_backward(du: &mut [f32], dv: &[f32], u: &[f32], q: &[f32], dg: &mut [f32]) {
    for ((((du, &dv), &u), &q), dg) in du.iter_mut().zip(dv).zip(u).zip(q).zip(dg.iter_mut()) {
        let o = sigmoid(q);
        *du = dv * o;
        *dg = dv * u * o * (1.0 - o);
    }
}

/// af3's `ds = dy⊙g` and gate pre-activation gradient `dy⊙s⊙g(1 − g)`, `g = σ(q)`, `s = sv + bz`
/// (rows of `C`).
#[inline(always)]
fn af3_gate_backward(ds: &mut [f32], dg: &mut [f32], sv: &[f32], dy: &[f32], q: &[f32], bz: &[f32]) {
    let c = bz.len();
    for ((((dsr, dgr), svr), dyr), qr) in ds
        .chunks_exact_mut(c)
        .zip(dg.chunks_exact_mut(c))
        .zip(sv.chunks_exact(c))
        .zip(dy.chunks_exact(c))
        .zip(q.chunks_exact(c))
    {
        for (((((ds, dg), &sv), &dy), &q), &b) in dsr.iter_mut().zip(dgr.iter_mut()).zip(svr).zip(dyr).zip(qr).zip(bz) {
            let gate = sigmoid(q);
            *ds = dy * gate;
            *dg = dy * (sv + b) * gate * (1.0 - gate);
        }
    }
}

/// The pre-activation gradients `[dpL dqL dpR dqR dG]` of a block (`[rows, 4H + G]`), from `P`'s
/// `[rows, 4H]`, `dleft` and `dright` (`[rows, H]`) and the gate's (`[rows, G]`).
#[inline(always)]
fn projection_backward(
    dcat: &mut [f32],
    p: &[f32],
    h: usize,
    mask: Option<&[f32]>,
    dl: &[f32],
    dr: &[f32],
    dgate: &[f32],
) {
    let f = dcat.len() / (p.len() / (4 * h)).max(1);
    let g = f - 4 * h;
    for (r, (((dc, pr), (dlr, drr)), dgr)) in dcat
        .chunks_exact_mut(f)
        .zip(p.chunks_exact(4 * h))
        .zip(dl.chunks_exact(h).zip(dr.chunks_exact(h)))
        .zip(dgate.chunks_exact(g))
        .enumerate()
    {
        let m = mask.map_or(1.0, |mk| mk[r]);
        let (dside, dgc) = dc.split_at_mut(4 * h);
        for (side, dsrc) in [(0, dlr), (1, drr)] {
            let (dv, dq) = dside[2 * side * h..2 * (side + 1) * h].split_at_mut(h);
            let (pv, pq) = pr[2 * side * h..2 * (side + 1) * h].split_at(h);
            for ((((dv, dq), &pv), &pq), &d) in dv.iter_mut().zip(dq.iter_mut()).zip(pv).zip(pq).zip(dsrc) {
                let sg = sigmoid(pq);
                let dm = d * m;
                *dv = dm * sg;
                *dq = dm * pv * sg * (1.0 - sg);
            }
        }
        dgc.copy_from_slice(dgr);
    }
}

/// A position-major `[M, H]` tensor into hidden-major `[B, H, N²]` `out`, in parallel over the
/// `(b, h)` slices, so that the GEMMs of stages B and D read unit-stride operands (through a
/// stride of `H`, packing an operand touches one cache line per element).
fn hidden_major(d: &Dims, pm: &[f32], out: &mut [f32]) {
    // A task per batch and group of `hb` channels: each position's `hb` values are one read of
    // consecutive memory (a cache line at hb = 16), not `hb` reads a row apart.
    let hb = [16, 8, 4, 2, 1].into_iter().find(|k| d.h % k == 0).unwrap_or(1);
    out.par_chunks_mut(hb * d.n2).enumerate().for_each(|(blk, o)| {
        let (b, h0) = (blk * hb / d.h, blk * hb % d.h);
        let src = &pm[b * d.n2 * d.h..(b + 1) * d.n2 * d.h];
        for (p, row) in src.chunks_exact(d.h).enumerate() {
            for (k, &v) in row[h0..h0 + hb].iter().enumerate() {
                o[k * d.n2 + p] = v;
            }
        }
    });
}

/// The `N × N` matrix of batch `b`, hidden channel `h` of a hidden-major `[B, H, N²]` tensor,
/// transposed when `transpose`.
fn channel<'a>(v: &'a [f32], d: &Dims, b: usize, h: usize, transpose: bool) -> Result<MatRef<'a>> {
    let (rs, cs) = if transpose { (1, d.n) } else { (d.n, 1) };
    MatRef::new(&v[(b * d.h + h) * d.n2..(b * d.h + h + 1) * d.n2], d.n, d.n, rs, cs)
}

/// Every `(b, h)` matrix of the hidden-major `[B, H, N²]` `out`, in parallel: `lhs·rhs` of the
/// two `N × N` operands `operands(b, h)` gives.
fn per_channel<'a>(
    d: &Dims,
    out: &mut [f32],
    operands: impl Fn(usize, usize) -> Result<(MatRef<'a>, MatRef<'a>)> + Send + Sync,
) -> Result<()> {
    out.par_chunks_mut(d.n2).enumerate().try_for_each(|(bh, o)| {
        let (b, h) = (bh / d.h, bh % d.h);
        let out = MatMut::new(o, d.n, d.n, d.n, 1)?;
        let (lhs, rhs) = operands(b, h)?;
        matmul(out, lhs, rhs, Parallelism::None)
    })
}

/// Stage B: `t`, hidden-major `[B, H, N²]`.
fn contract(d: &Dims, dir: Direction, left: &[f32], right: &[f32], t: &mut [f32]) -> Result<()> {
    let outgoing = dir == Direction::Outgoing;
    // Outgoing T = L·Rᵀ, incoming T = Lᵀ·R.
    per_channel(d, t, |b, h| Ok((channel(left, d, b, h, !outgoing)?, channel(right, d, b, h, outgoing)?)))
}

/// Stage D: `dleft` and `dright`, hidden-major `[B, H, N²]`.
fn contract_backward(
    d: &Dims,
    dir: Direction,
    dt: &[f32],
    left: &[f32],
    right: &[f32],
    dleft: &mut [f32],
    dright: &mut [f32],
) -> Result<()> {
    let outgoing = dir == Direction::Outgoing;
    // Outgoing dL = dT·R, dR = dTᵀ·L; incoming dL = R·dTᵀ, dR = L·dT.
    per_channel(d, dleft, |b, h| {
        Ok(if outgoing {
            (channel(dt, d, b, h, false)?, channel(right, d, b, h, false)?)
        } else {
            (channel(right, d, b, h, false)?, channel(dt, d, b, h, true)?)
        })
    })?;
    per_channel(d, dright, |b, h| {
        Ok(if outgoing {
            (channel(dt, d, b, h, true)?, channel(left, d, b, h, false)?)
        } else {
            (channel(left, d, b, h, false)?, channel(dt, d, b, h, false)?)
        })
    })
}

/// Rows `r0 .. r0 + rows` of a hidden-major `[B, H, N²]` tensor, position-major into `out`.
fn gather(v: &[f32], d: &Dims, r0: usize, rows: usize, out: &mut [f32]) {
    for (r, o) in out[..rows * d.h].chunks_exact_mut(d.h).enumerate() {
        let q = r0 + r;
        let (b, p) = (q / d.n2, q % d.n2);
        for (h, o) in o.iter_mut().enumerate() {
            *o = v[(b * d.h + h) * d.n2 + p];
        }
    }
}

/// The sums of a row stage, output (C) or input (E): its linear layer's weight and bias (Wout
/// `[C, H]` and bout `[C]`; Wcat `[4H + G, C]` and bcat `[4H + G]`), then its LayerNorm's weight
/// and bias (LN_H's `[H]`; LN_C's `[C]`).
const LIN_W: usize = 0;
const LIN_B: usize = 1;
const NORM_W: usize = 2;
const NORM_B: usize = 3;

/// Runs `block` on each row block of `blocks` in parallel (with the block's index), each rayon
/// task with its own scratch and sums, and adds up the tasks' sums (of lengths `lens`) in f64.
fn sum_blocks<T: Send>(
    d: &Dims,
    lens: &[usize],
    blocks: impl IndexedParallelIterator<Item = T>,
    block: impl Fn(&mut Scratch, &mut Sums, usize, T) -> Result<()> + Send + Sync,
) -> Result<Sums> {
    blocks
        .enumerate()
        .with_min_len(d.min_blocks)
        .try_fold(
            || (Scratch::new(d), Sums::zeros(lens)),
            |(mut s, mut sums), (blk, item)| -> Result<(Scratch, Sums)> {
                block(&mut s, &mut sums, blk, item)?;
                Ok((s, sums))
            },
        )
        .map(|r| r.map(|(_, sums)| sums))
        .try_reduce(|| Sums::zeros(lens), |a, b| Ok(a.merge(b)))
}

/// A linear layer's backward over one block of rows, given the output gradient `dout`
/// `[rows, O]`, the layer's input `inp` `[rows, I]` and its weight `w` `[O, I]` (`(o, i)`):
/// `doutᵀ·inp` (made in `prod`) into sum [`LIN_W`], and `din = dout·W`. The bias gradient, where
/// the layer has one, is the caller's ([`Sums::add_rows`]).
fn linear_backward(
    sums: &mut Sums,
    dout: &[f32],
    inp: &[f32],
    (o, i): (usize, usize),
    w: MatRef<'_>,
    prod: &mut [f32],
    din: &mut [f32],
) -> Result<()> {
    let rows = dout.len() / o;
    let prod = &mut prod[..o * i];
    matmul(
        MatMut::new(prod, o, i, i, 1)?,
        MatRef::new(dout, o, rows, 1, o)?,
        MatRef::new(inp, rows, i, i, 1)?,
        Parallelism::None,
    )?;
    sums.add(LIN_W, prod);
    matmul(MatMut::new(din, rows, i, i, 1)?, MatRef::new(dout, rows, o, o, 1)?, w, Parallelism::None)
}

/// Stage C: the output projection, gate and LN_H backward; writes `dt` (`[M, H]`) and the output
/// gate's pre-activation gradient (`[M, G]`).
#[allow(clippy::too_many_arguments)]
fn output_backward(
    prep: &CpuPrepared,
    d: &Dims,
    form: Formulation,
    x: &[f32],
    dy: &[f32],
    t: &[f32],
    dt: &mut [f32],
    dgate: &mut [f32],
) -> Result<Sums> {
    let (c, h, g) = (d.c, d.h, d.g);
    let blocks = dt.par_chunks_mut(ROWS * h).zip(dgate.par_chunks_mut(ROWS * g));
    sum_blocks(d, &[c * h, c, h, h], blocks, |s, sums, blk, (dtb, dgb)| {
        let rows = dtb.len() / h;
        let r0 = blk * ROWS;
        let dyb = &dy[r0 * c..(r0 + rows) * c];
        norm_in(prep, d, &x[r0 * c..(r0 + rows) * c], s);
        // The gate pre-activation P_G into s.p, [rows, G].
        project(prep, d, &s.z[..rows * c], rows, 4 * h, d.f, &mut s.p)?;
        // t̂ into s.a, its ρ into rho_t; u into s.b.
        let tb = &mut s.t[..rows * h];
        gather(t, d, r0, rows, tb);
        let rho_t = &mut s.rho_t[..rows];
        normalise(tb, h, d.eps, &mut s.a[..rows * h], rho_t);
        let that = &s.a[..rows * h];
        let u = &mut s.b[..rows * h];
        simd(
            #[inline(always)]
            || {
                for (ur, tr) in u.chunks_exact_mut(h).zip(that.chunks_exact(h)) {
                    for (((u, &v), &w), &b) in ur.iter_mut().zip(tr).zip(&prep.norm_out_w).zip(&prep.norm_out_b) {
                        *u = v * w + b;
                    }
                }
            },
        );
        let u = &s.b[..rows * h];
        // du into tb (t itself is no longer needed: t̂ and ρ_t are kept).
        let du = &mut s.t[..rows * h];
        let wout = MatRef::new(&prep.w_out_t, c, h, 1, c)?; // Wout [C, H]
        match form {
            Formulation::GpuMode => {
                // o = σ(P_G), v = u⊙o; dWout += dyᵀ·v, dv = dy·Wout.
                let v = &mut s.e1[..rows * h];
                simd(
                    #[inline(always)]
                    || gate_hidden(v, u, &s.p[..rows * h]),
                );
                let dv = &mut s.e2[..rows * h];
                linear_backward(sums, dyb, v, (c, h), wout, &mut s.prod, dv)?;
                simd(
                    #[inline(always)]
                    || gpumode_gate_backward(du, dv, u, &s.p[..rows * h], dgb),
                );
            }
            Formulation::Af3 => {
                // g = σ(P_G), s = u·Wzᵀ + bz; ds = dy⊙g; dWz += dsᵀ·u; dbz += Σ ds; du = ds·Wz.
                let sv = &mut s.e1[..rows * c];
                matmul(
                    MatMut::new(sv, rows, c, c, 1)?,
                    MatRef::new(u, rows, h, h, 1)?,
                    MatRef::new(&prep.w_out_t, h, c, c, 1)?,
                    Parallelism::None,
                )?;
                let ds = &mut s.e2[..rows * c];
                simd(
                    #[inline(always)]
                    || af3_gate_backward(ds, dgb, sv, dyb, &s.p[..rows * c], &prep.b_out),
                );
                linear_backward(sums, ds, u, (c, h), wout, &mut s.prod, du)?;
                sums.add_rows(LIN_B, ds, c);
            }
        }
        norm_backward(du, that, rho_t, &prep.norm_out_w, dtb, sums);
        Ok(())
    })
}

/// Stage E: the gated projections' and LN_C's backward; writes `dx`.
#[allow(clippy::too_many_arguments)]
fn input_backward(
    prep: &CpuPrepared,
    d: &Dims,
    x: &[f32],
    mask: Option<&[f32]>,
    dleft: &[f32],
    dright: &[f32],
    dgate: &[f32],
    dx: &mut [f32],
) -> Result<Sums> {
    let (c, h, g, f) = (d.c, d.h, d.g, d.f);
    sum_blocks(d, &[f * c, f, c, c], dx.par_chunks_mut(ROWS * c), |s, sums, blk, dxb| {
        let rows = dxb.len() / c;
        let r0 = blk * ROWS;
        norm_in(prep, d, &x[r0 * c..(r0 + rows) * c], s);
        project(prep, d, &s.z[..rows * c], rows, 0, 4 * h, &mut s.p)?;
        let (dl, dr) = (&mut s.a[..rows * h], &mut s.b[..rows * h]);
        gather(dleft, d, r0, rows, dl);
        gather(dright, d, r0, rows, dr);
        // D = [dpL dqL dpR dqR dG], [rows, F].
        let dcat = &mut s.dcat[..rows * f];
        let mask = mask.map(|mk| &mk[r0..r0 + rows]);
        let dgate = &dgate[r0 * g..(r0 + rows) * g];
        simd(
            #[inline(always)]
            || projection_backward(dcat, &s.p[..rows * 4 * h], h, mask, dl, dr, dgate),
        );
        // dWcat += Dᵀ·z; dbcat += Σ D; dz = D·Wcat.
        let dz = &mut s.dz[..rows * c];
        let wcat = MatRef::new(&prep.w_cat, f, c, c, 1)?;
        linear_backward(sums, dcat, &s.z[..rows * c], (f, c), wcat, &mut s.prod, dz)?;
        sums.add_rows(LIN_B, dcat, f);
        norm_backward(dz, &s.xhat[..rows * c], &s.rho[..rows], &prep.norm_in_w, dxb, sums);
        Ok(())
    })
}

/// The gradients in [`Gradients`]' layout, with a bias gradient exactly where the weights have
/// a bias.
fn assemble(prep: &CpuPrepared, d: &Dims, dx: Vec<f32>, input: &Sums, output: &Sums) -> Gradients {
    let (c, h) = (d.c, d.h);
    let w_cat = input.f32(LIN_W);
    let b_cat = input.f32(LIN_B);
    let fused = |i: usize, w0: usize, w1: usize| {
        let bias = prep.biases[i].then(|| b_cat[w0..w1].to_vec());
        Linear::new(w_cat[w0 * c..w1 * c].to_vec(), bias, w1 - w0, c)
    };
    Gradients {
        x: dx,
        norm_in: Norm { weight: input.f32(NORM_W), bias: input.f32(NORM_B) },
        left_proj: fused(0, 0, h),
        left_gate: fused(1, h, 2 * h),
        right_proj: fused(2, 2 * h, 3 * h),
        right_gate: fused(3, 3 * h, 4 * h),
        out_gate: fused(4, 4 * h, d.f),
        norm_out: Norm { weight: output.f32(NORM_W), bias: output.f32(NORM_B) },
        out_proj: Linear::new(output.f32(LIN_W), prep.biases[5].then(|| output.f32(LIN_B)), c, h),
    }
}

#[cfg(test)]
mod tests {
    //! The CPU backward against the f64 reference backward (`crate::reference::backward`, itself
    //! checked by finite differences), tensor by tensor, on fresh random inputs.
    use super::super::test_cases::{inputs, Case};
    use super::super::CpuBackend;
    use crate::backend::Backend;
    use crate::device_io::BackwardIo;
    use crate::problem::{Config, Direction, Formulation, Problem, Shape};
    use crate::reference;
    use crate::weights::Weights;

    /// The largest relative L2 error over every gradient tensor, with its name; checks that the
    /// two sides name the same tensors.
    fn worst(cs: &Case, seed: u64) -> (f64, String) {
        let (w, pr, x, mask, mut rng) = inputs(cs, seed);
        let dy = rng.normal_vec(pr.x_len(), 1.0);
        let be = CpuBackend::new();
        let prep = be.prepare(&w).unwrap();
        let got = be.backward(&prep, &pr, BackwardIo { x: &x, mask: mask.as_deref(), dy: &dy }).unwrap();
        got.check_against(&w, pr.x_len()).unwrap();
        let want = reference::backward(&w, &pr, &x, mask.as_deref(), &dy).unwrap();
        let (got, want) = (got.tensors(), want.tensors());
        let got_names: Vec<&String> = got.iter().map(|(n, _)| n).collect();
        let want_names: Vec<&String> = want.iter().map(|(n, _)| n).collect();
        assert_eq!(got_names, want_names);
        let mut worst = (0.0, String::new());
        for ((name, g), (_, r)) in got.iter().zip(&want) {
            let e = reference::compare(g, r, 0.0, f64::INFINITY).rel_l2;
            if e.is_nan() || e > worst.0 {
                worst = (e, name.clone());
            }
        }
        worst
    }

    /// f32 storage and GEMMs with f64 statistics and block sums: the measured worst over the
    /// cases below is 8e-7; 1e-4 leaves room for other CPUs' GEMM orderings. Each of these wrong
    /// terms failed both tests (checked by hand): the mask dropped from `dp`, a transposed `dT` in
    /// `dR`, `σ` for `σ'` in the gpumode gate, the LayerNorm backward without `mean(ĝ)`, no bias
    /// sums.
    const TOL: f64 = 1e-4;

    #[test]
    fn matches_the_f64_reference_everywhere() {
        let mut seed = 0;
        for f in [Formulation::GpuMode, Formulation::Af3] {
            for biases in [false, true] {
                if biases && f == Formulation::GpuMode {
                    continue;
                }
                for dir in [Direction::Outgoing, Direction::Incoming] {
                    for (masked, cauchy) in [(false, false), (true, false), (true, true)] {
                        seed += 1;
                        // C ≠ H so a swapped width fails; N not a multiple of anything.
                        let cs = Case { f, dir, b: 2, n: 7, c: 12, h: 8, masked, biases, cauchy };
                        let (e, name) = worst(&cs, seed);
                        eprintln!(
                            "{f:?} {dir:?} biases {biases} masked {masked} cauchy {cauchy}: worst {name} {e:.2e}"
                        );
                        assert!(
                            e < TOL,
                            "{f:?} {dir:?} biases {biases} masked {masked} cauchy {cauchy}: {name} off by {e:.2e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn several_row_blocks_and_wider_layers() {
        // 2·23² = 1058 rows: eight full blocks of 128 and a partial one, so the block sums and
        // the last block's bounds are exercised.
        for (f, dir) in [(Formulation::Af3, Direction::Incoming), (Formulation::GpuMode, Direction::Outgoing)] {
            let biases = f == Formulation::Af3;
            let cs = Case { f, dir, b: 2, n: 23, c: 32, h: 16, masked: true, biases, cauchy: false };
            let (e, name) = worst(&cs, 99);
            assert!(e < TOL, "{f:?} {dir:?}: {name} off by {e:.2e}");
        }
    }

    #[test]
    fn a_direct_call_checks_its_operands() {
        // Backend::backward is public: wrong lengths and a mask that does not match the problem
        // are errors naming the operand, never a panic.
        let cfg = Config::new(Formulation::Af3, 8, 4).unwrap();
        let w = Weights::random(cfg, true, 5).unwrap();
        let be = CpuBackend::new();
        let prep = be.prepare(&w).unwrap();
        let masked = Problem::new(cfg, Shape::new(1, 3), Direction::Outgoing, true).unwrap();
        let plain = Problem::new(cfg, Shape::new(1, 3), Direction::Outgoing, false).unwrap();
        let (x, dy, mask) = (vec![0.5f32; 72], vec![1.0f32; 72], vec![1.0f32; 9]);
        let err = |r: crate::error::Result<crate::gradients::Gradients>| r.unwrap_err().to_string();
        assert!(err(be.backward(&prep, &masked, BackwardIo { x: &x[1..], mask: Some(&mask), dy: &dy }))
            .contains("x has 71 elements"));
        assert!(err(be.backward(&prep, &masked, BackwardIo { x: &x, mask: Some(&mask), dy: &dy[..70] }))
            .contains("dy has 70 elements"));
        assert!(err(be.backward(&prep, &masked, BackwardIo { x: &x, mask: Some(&mask[1..]), dy: &dy }))
            .contains("the mask has 8 elements"));
        assert!(
            err(be.backward(&prep, &masked, BackwardIo { x: &x, mask: None, dy: &dy })).contains("no mask was given")
        );
        assert!(err(be.backward(&prep, &plain, BackwardIo { x: &x, mask: Some(&mask), dy: &dy }))
            .contains("unmasked problem"));
        let other = Weights::random(Config::new(Formulation::Af3, 8, 8).unwrap(), true, 5).unwrap();
        let wrong = Problem::new(other.config(), Shape::new(1, 3), Direction::Outgoing, false).unwrap();
        assert!(
            be.backward(&prep, &wrong, BackwardIo { x: &x, mask: None, dy: &dy }).is_err(),
            "weights prepared for another H"
        );
        assert!(be.backward(&prep, &masked, BackwardIo { x: &x, mask: Some(&mask), dy: &dy }).is_ok());
    }
}
