//! The CPU backend: f32 throughout, multi-threaded with `rayon`, every matrix product through
//! the `gemm` crate.
//!
//! # Math (SPEC.md notation)
//! ```text
//! z = LN_C(x)                                              mean/variance accumulated in f64
//! P = z·Wcatᵀ (+ bcat)                                     one GEMM, Wcat = [Wlp; Wlg; Wrp; Wrg; Wog]
//! gpumode: left = lp ⊙ mask ⊙ σ(lg), right = rp ⊙ mask ⊙ σ(rg), og = σ(ogp)        (og width H)
//! af3:     a = σ(ag+bag) ⊙ (ap+bap) ⊙ mask, b likewise,      g = σ(z·Wgᵀ+bg)     (g width C)
//! t[b,·,·,h] = L·Rᵀ (outgoing) or Lᵀ·R (incoming), one GEMM per (b, h)
//! gpumode: y = (LN_H(t) ⊙ og)·Woutᵀ
//! af3:     y = g ⊙ (LN_H(t)·Wzᵀ + bz)
//! ```
//! A missing mask is all ones; NaN and ±inf in `x` flow through as IEEE arithmetic says.
//!
//! # Data layout (workspace)
//! With `M = B·N²` positions `m = b·N² + i·N + j`:
//! - `left`, `right`, `t`: `[B, H, N²]`, hidden channel outside, so each `(b, h)` slice is an
//!   `N × N` row-major matrix and the contraction is one GEMM per slice with no copies;
//! - the output gate, already passed through σ: gpumode `[B, H, N²]` (it multiplies `LN_H(t)`,
//!   which the output stage holds hidden-major), af3 `[M, C]` (it multiplies `y`, position-major);
//! - `scratch`: one chunk per sub-block (below), reused by the projection and the output stage.
//!
//! # Blocking and threading
//! Positions are processed in *super-blocks* of `subs · rows` consecutive positions (flat over
//! `M`, so `N = 1` with a large `B` still makes full blocks), each split into `subs` sub-blocks of
//! `rows` positions, one per rayon task and one scratch chunk each. Only a super-block's worth of
//! `P` ever exists, so memory beyond the four `[B, ·, N²]` tensors stays a few MiB.
//! 1. Projection, per super-block. Pass A, parallel over sub-blocks: LN_C of the rows into `z`,
//!    then `P = z·Wcatᵀ` as one single-threaded GEMM written hidden-major (`P[w][q]`, so every
//!    output column is contiguous over positions); af3 also applies σ to its gate here and
//!    transposes it into the `[M, C]` gate. Pass B, parallel over `(b, h)`: bias, σ, mask and
//!    product, reading contiguous runs of `P` and writing contiguous runs of `left`/`right`/`og`.
//!    (Two passes because a sub-block's outputs are `H` separate runs of the `[B, H, N²]` tensors,
//!    which safe Rust cannot hand to one task; the extra read of `P` hits the cache.)
//! 2. Contraction: one `N × N × N` GEMM per `(b, h)`, parallel over the `B·H` slices with a
//!    single-threaded GEMM each (no synchronisation inside); when there are too few slices to
//!    keep every thread busy, the slices run one after another with a multi-threaded GEMM.
//! 3. Output, per super-block, parallel over sub-blocks: gather `t` for the sub-block's positions
//!    hidden-major (`u[h][q]`, contiguous runs), LN_H with statistics vectorised across positions,
//!    the gpumode gate, then one GEMM `u·Woutᵀ` written straight into the rows of `y`; af3 adds
//!    `bz` and multiplies its gate row by row.
//!
//! Sigmoid uses a branch-free polynomial `exp` (below) so that the element-wise loops vectorise;
//! `libm`'s scalar `expf` would cost as much as the GEMMs.

#![forbid(unsafe_code)]

use rayon::prelude::*;

use super::host_gemm::{matmul, MatMut, MatRef, Parallelism};
use super::{Backend, DeviceInfo, MemoryInfo};
use crate::error::{BackendKind, Error, Result};
use crate::problem::{Config, Direction, Formulation, Problem, Shape, LN_EPS};
use crate::weights::Weights;

/// Positions per sub-block: the row count of one projection GEMM and one output GEMM.
/// 128 rows keep a sub-block's `z` and `P` (≈ 0.4 MiB at C = H = 128) inside a core's L2.
const SUB_ROWS: usize = 128;

/// Sub-blocks per thread in one super-block: more than one so rayon can balance uneven threads
/// (this backend often shares its cores), few enough that the barrier per super-block is cheap.
const SUBS_PER_THREAD: usize = 4;

/// When a problem has fewer `(b, h)` slices than this many per thread, the contraction runs the
/// slices in turn with a multi-threaded GEMM instead of one slice per task.
const SLICES_PER_THREAD: usize = 2;

/// The CPU backend. Stateless: threads come from rayon's current pool.
#[derive(Clone, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

/// Weights laid out for the CPU GEMMs.
#[derive(Clone, Debug)]
pub struct CpuPrepared {
    config: Config,
    norm_in_w: Vec<f32>,
    norm_in_b: Vec<f32>,
    /// `Wcatᵀ`, `[C, 4H + G]` row-major: columns are left value, left gate, right value, right
    /// gate (H each) and the output gate (G).
    w_cat_t: Vec<f32>,
    /// Fused projection biases `[4H + G]`; zeros where a layer has none.
    b_cat: Vec<f32>,
    norm_out_w: Vec<f32>,
    norm_out_b: Vec<f32>,
    /// `Woutᵀ`, `[H, C]` row-major.
    w_out_t: Vec<f32>,
    /// Output projection bias `[C]` (af3 `bz`); zeros when absent.
    b_out: Vec<f32>,
}

/// How positions are blocked for one problem and thread count.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Plan {
    /// Positions per sub-block.
    rows: usize,
    /// Sub-blocks per super-block.
    subs: usize,
    /// f32 elements of one sub-block's scratch chunk.
    chunk: usize,
}

impl Plan {
    fn new(config: &Config, shape: &Shape, threads: usize) -> Plan {
        let m = shape.rows();
        let rows = SUB_ROWS.min(m).max(1);
        let subs = (threads.max(1) * SUBS_PER_THREAD).min(m.div_ceil(rows)).max(1);
        // Projection: z [rows, C] + P [4H+G, rows]. Output: u [H, rows]. Problem::new bounds every
        // tensor far below usize::MAX, and these are a tiny fraction of one.
        let proj = rows * config.c + config.fused_proj_width() * rows;
        let out = config.h * rows;
        Plan { rows, subs, chunk: proj.max(out) }
    }

    fn super_rows(&self) -> usize {
        self.rows * self.subs
    }
}

/// Every intermediate of one problem shape (see the module docs for the layouts).
#[derive(Debug)]
pub struct CpuWorkspace {
    config: Config,
    shape: Shape,
    plan: Plan,
    left: Vec<f32>,
    right: Vec<f32>,
    t: Vec<f32>,
    gate: Vec<f32>,
    scratch: Vec<f32>,
}

/// Element counts of the workspace tensors: left, right, t, gate, scratch.
fn workspace_lens(config: &Config, shape: &Shape, plan: &Plan) -> [u128; 5] {
    let hidden = shape.rows() as u128 * config.h as u128;
    let gate = shape.rows() as u128 * config.gate_width() as u128;
    let scratch = plan.subs as u128 * plan.chunk as u128;
    [hidden, hidden, hidden, gate, scratch]
}

fn workspace_bytes_of(config: &Config, shape: &Shape, plan: &Plan) -> u128 {
    workspace_lens(config, shape, plan).iter().sum::<u128>() * 4
}

/// A zeroed f32 vector, or `OutOfMemory` if the allocator refuses.
fn try_zeroed(len: u128, what: &str, available: u64) -> Result<Vec<f32>> {
    let oom = || Error::OutOfMemory {
        backend: BackendKind::Cpu,
        what: what.to_string(),
        needed: u64::try_from(len.saturating_mul(4)).unwrap_or(u64::MAX),
        available,
    };
    let len = usize::try_from(len).map_err(|_| oom())?;
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| oom())?;
    v.resize(len, 0.0);
    Ok(v)
}

/// Fields of `/proc/meminfo` in bytes, when readable.
fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        kib.checked_mul(1024)
    })
}

/// The first value of `key` in `/proc/cpuinfo`, when readable.
fn cpuinfo(key: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key && !v.trim().is_empty()).then(|| v.trim().to_string())
    })
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type Prepared = CpuPrepared;
    type Workspace = CpuWorkspace;

    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn info(&self) -> DeviceInfo {
        let vendor = match cpuinfo("vendor_id").as_deref() {
            Some("AuthenticAMD") => "AMD".to_string(),
            Some("GenuineIntel") => "Intel".to_string(),
            Some(other) => other.to_string(),
            None => cpuinfo("CPU implementer").unwrap_or_else(|| "unknown".to_string()),
        };
        let name = cpuinfo("model name")
            .or_else(|| cpuinfo("Model"))
            .unwrap_or_else(|| format!("{} CPU", std::env::consts::ARCH));
        DeviceInfo {
            vendor,
            name,
            arch: std::env::consts::ARCH.to_string(),
            compute_units: u32::try_from(rayon::current_num_threads()).unwrap_or(u32::MAX),
            memory_bytes: meminfo("MemTotal").unwrap_or(0),
            versions: vec![("gemm crate".into(), "0.19".into()), ("rayon crate".into(), "1".into())],
        }
    }

    fn prepare(&self, weights: &Weights) -> Result<CpuPrepared> {
        weights.validate()?;
        let config = weights.config();
        let Config { c, h, .. } = config;
        let w = config.fused_proj_width();
        let parts =
            [&weights.left_proj, &weights.left_gate, &weights.right_proj, &weights.right_gate, &weights.out_gate];
        let mut w_cat_t = vec![0.0f32; c * w];
        let mut b_cat = vec![0.0f32; w];
        let mut col0 = 0;
        for lin in parts {
            // lin.weight is [out, C] row-major; column col0 + o of Wcatᵀ is its row o.
            for o in 0..lin.out_features {
                for (k, &v) in lin.weight[o * c..(o + 1) * c].iter().enumerate() {
                    w_cat_t[k * w + col0 + o] = v;
                }
            }
            if let Some(b) = &lin.bias {
                b_cat[col0..col0 + lin.out_features].copy_from_slice(b);
            }
            col0 += lin.out_features;
        }
        let mut w_out_t = vec![0.0f32; h * c];
        for (o, row) in weights.out_proj.weight.chunks_exact(h).enumerate() {
            for (k, &v) in row.iter().enumerate() {
                w_out_t[k * c + o] = v;
            }
        }
        Ok(CpuPrepared {
            config,
            norm_in_w: weights.norm_in.weight.clone(),
            norm_in_b: weights.norm_in.bias.clone(),
            w_cat_t,
            b_cat,
            norm_out_w: weights.norm_out.weight.clone(),
            norm_out_b: weights.norm_out.bias.clone(),
            w_out_t,
            b_out: weights.out_proj.bias.clone().unwrap_or_else(|| vec![0.0; c]),
        })
    }

    fn workspace(&self, prepared: &CpuPrepared, problem: &Problem) -> Result<CpuWorkspace> {
        check_config(prepared, problem)?;
        let (config, shape) = (problem.config, problem.shape);
        let plan = Plan::new(&config, &shape, rayon::current_num_threads());
        let needed = workspace_bytes_of(&config, &shape, &plan);
        let available = meminfo("MemAvailable");
        if let Some(avail) = available {
            if needed > avail as u128 {
                return Err(Error::OutOfMemory {
                    backend: BackendKind::Cpu,
                    what: format!("CPU workspace for B={} N={} C={} H={}", shape.batch, shape.n, config.c, config.h),
                    needed: u64::try_from(needed).unwrap_or(u64::MAX),
                    available: avail,
                });
            }
        }
        let avail = available.unwrap_or(0);
        let [l, r, t, g, s] = workspace_lens(&config, &shape, &plan);
        Ok(CpuWorkspace {
            config,
            shape,
            plan,
            left: try_zeroed(l, "left projection [B,H,N,N]", avail)?,
            right: try_zeroed(r, "right projection [B,H,N,N]", avail)?,
            t: try_zeroed(t, "contraction [B,H,N,N]", avail)?,
            gate: try_zeroed(g, "output gate", avail)?,
            scratch: try_zeroed(s, "block scratch", avail)?,
        })
    }

    fn workspace_fits(&self, workspace: &CpuWorkspace, problem: &Problem) -> bool {
        workspace.config == problem.config && workspace.shape == problem.shape
    }

    fn workspace_bytes(&self, _prepared: &CpuPrepared, problem: &Problem) -> u64 {
        let plan = Plan::new(&problem.config, &problem.shape, rayon::current_num_threads());
        u64::try_from(workspace_bytes_of(&problem.config, &problem.shape, &plan)).unwrap_or(u64::MAX)
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        try_zeroed(len as u128, "buffer", meminfo("MemAvailable").unwrap_or(0))
    }

    fn buffer_len(buffer: &Vec<f32>) -> usize {
        buffer.len()
    }

    fn upload(&self, src: &[f32], dst: &mut Vec<f32>) -> Result<()> {
        copy_checked(src, dst)
    }

    fn download(&self, src: &Vec<f32>, dst: &mut [f32]) -> Result<()> {
        copy_checked(src, dst)
    }

    fn forward(
        &self,
        prepared: &CpuPrepared,
        workspace: &mut CpuWorkspace,
        problem: &Problem,
        x: &Vec<f32>,
        mask: Option<&Vec<f32>>,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        self.forward_host(prepared, workspace, problem, x, mask.map(Vec::as_slice), y)
    }

    fn forward_host(
        &self,
        prepared: &CpuPrepared,
        workspace: &mut CpuWorkspace,
        problem: &Problem,
        x: &[f32],
        mask: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<()> {
        check_config(prepared, problem)?;
        problem.check_lengths(x.len(), mask.map(<[f32]>::len), y.len())?;
        if problem.masked != mask.is_some() {
            return Err(Error::InvalidArgument(format!(
                "problem says masked = {}, but a mask was {}given",
                problem.masked,
                if mask.is_some() { "" } else { "not " }
            )));
        }
        if !self.workspace_fits(workspace, problem) {
            return Err(Error::InvalidArgument(format!(
                "workspace was made for B={} N={} and {:?}, not for this problem",
                workspace.shape.batch, workspace.shape.n, workspace.config
            )));
        }
        project(prepared, workspace, x, mask)?;
        contract(workspace, problem.direction)?;
        output(prepared, workspace, y)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn memory_info(&self) -> Result<Option<MemoryInfo>> {
        Ok(match (meminfo("MemAvailable"), meminfo("MemTotal")) {
            (Some(free), Some(total)) => Some(MemoryInfo { free, total }),
            _ => None,
        })
    }
}

fn check_config(prepared: &CpuPrepared, problem: &Problem) -> Result<()> {
    if prepared.config != problem.config {
        return Err(Error::InvalidArgument(format!(
            "weights were prepared for {:?}, the problem is {:?}",
            prepared.config, problem.config
        )));
    }
    Ok(())
}

fn copy_checked(src: &[f32], dst: &mut [f32]) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::Shape(format!("copy of {} elements into a buffer of {}", src.len(), dst.len())));
    }
    dst.copy_from_slice(src);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Element-wise kernels. Plain loops over slices, written so LLVM vectorises them.

/// `eˣ` in f32 without branches, so loops that call it vectorise (`libm`'s `expf` is a scalar
/// call). Range reduction `x = n·ln2 + r` with `|r| ≤ ln2/2` (ln2 split in two so `n·LN2_HI` is
/// exact), a degree-7 Taylor polynomial for `eʳ` (truncation below 6e-9 relative), and `2ⁿ`
/// built from its exponent bits. Relative error about 2 ulp. NaN stays NaN: `clamp` keeps NaN
/// and every later step propagates it. Inputs are clamped to [-87, 88] so `2ⁿ` stays a normal
/// number: the result saturates at e⁸⁸ ≈ 1.7e38 and e⁻⁸⁷ ≈ 1.6e-38, which moves σ by < 1e-37.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // 355/512: 9 significant bits
    const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 − LN2_HI
                                         // 1.5·2²³: adding it rounds to an integer and leaves that integer in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2_E + SHIFTER;
    let n = shifted - SHIFTER;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let n_int = shifted.to_bits() as i32 - SHIFTER.to_bits() as i32;
    p * f32::from_bits(((n_int + 127) << 23) as u32)
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// `dst = σ(gate + bg) ⊙ (val + bv) ⊙ mask`.
fn gated(dst: &mut [f32], val: &[f32], gate: &[f32], bv: f32, bg: f32, mask: Option<&[f32]>) {
    match mask {
        Some(mask) => {
            for (((d, &v), &g), &m) in dst.iter_mut().zip(val).zip(gate).zip(mask) {
                *d = sigmoid(g + bg) * (v + bv) * m;
            }
        }
        None => {
            for ((d, &v), &g) in dst.iter_mut().zip(val).zip(gate) {
                *d = sigmoid(g + bg) * (v + bv);
            }
        }
    }
}

/// Sum of a slice in f64, with eight independent accumulators so the loop vectorises.
fn sum_f64(v: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = v.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&a| a as f64).sum();
    for ch in chunks {
        for (a, &b) in acc.iter_mut().zip(ch) {
            *a += b as f64;
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// `Σ (v − mean)²` in f64 (the second pass of a two-pass variance: no cancellation).
fn sum_sq_dev_f64(v: &[f32], mean: f64) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = v.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&a| (a as f64 - mean) * (a as f64 - mean)).sum();
    for ch in chunks {
        for (a, &b) in acc.iter_mut().zip(ch) {
            let d = b as f64 - mean;
            *a += d * d;
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// LayerNorm of each row of `x` (rows of `w.len()` values) into `out`. Mean and variance are
/// two-pass in f64: Cauchy inputs put values of 1e4 next to values of 1e-2 in one row, where a
/// one-pass f32 `E[x²] − E[x]²` loses every digit.
fn layer_norm_rows(x: &[f32], out: &mut [f32], w: &[f32], b: &[f32]) {
    let width = w.len();
    for (xr, zr) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mean = sum_f64(xr) / width as f64;
        let var = sum_sq_dev_f64(xr, mean) / width as f64;
        let rstd = 1.0 / (var + LN_EPS as f64).sqrt();
        for (((z, &v), &wi), &bi) in zr.iter_mut().zip(xr).zip(w).zip(b) {
            *z = ((v as f64 - mean) * rstd) as f32 * wi + bi;
        }
    }
}

/// Calls `f(b, p, off, len)` for each maximal run of positions `m0 + off .. m0 + off + len`
/// inside `[lo, hi)` that stays within one batch `b` (starting at in-batch position `p`) and one
/// sub-block of `rows` positions counted from `m0`.
fn for_runs(m0: usize, lo: usize, hi: usize, np: usize, rows: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    let mut m = lo;
    while m < hi {
        let (b, p) = (m / np, m % np);
        let off = m - m0;
        let len = (rows - off % rows).min(np - p).min(hi - m);
        f(b, p, off, len);
        m += len;
    }
}

// ---------------------------------------------------------------------------------------------
// Stage 1: LN_C, fused projection, gates.

fn project(prep: &CpuPrepared, ws: &mut CpuWorkspace, x: &[f32], mask: Option<&[f32]>) -> Result<()> {
    let Config { c, h, formulation } = prep.config;
    let w = prep.config.fused_proj_width();
    let np = ws.shape.n * ws.shape.n;
    let m_total = ws.shape.rows();
    let Plan { rows, chunk, .. } = ws.plan;
    let CpuWorkspace { left, right, gate, scratch, plan, .. } = ws;
    let super_rows = plan.super_rows();

    for m0 in (0..m_total).step_by(super_rows) {
        let m1 = (m0 + super_rows).min(m_total);
        let subs = (m1 - m0).div_ceil(rows);
        let scratch = &mut scratch[..subs * chunk];
        let xs = &x[m0 * c..m1 * c];

        // Pass A: per sub-block, LN_C and one GEMM P = z·Wcatᵀ, stored P[w][q] (column stride
        // `rows`) so each of the 4H+G outputs is a contiguous run over the sub-block's positions.
        let pass_a = |sc: &mut [f32], xb: &[f32]| -> Result<()> {
            let q = xb.len() / c;
            let (z, p) = sc.split_at_mut(rows * c);
            layer_norm_rows(xb, &mut z[..q * c], &prep.norm_in_w, &prep.norm_in_b);
            matmul(
                MatMut::new(&mut p[..w * rows], q, w, 1, rows)?,
                MatRef::new(&z[..q * c], q, c, c, 1)?,
                MatRef::new(&prep.w_cat_t, c, w, w, 1)?,
                Parallelism::None,
            )
        };
        match formulation {
            Formulation::GpuMode => {
                scratch.par_chunks_mut(chunk).zip(xs.par_chunks(rows * c)).try_for_each(|(sc, xb)| pass_a(sc, xb))?
            }
            Formulation::Af3 => {
                // The af3 gate multiplies y, which is position-major: apply σ to the gate rows of
                // P while they are in this core's cache and transpose them into gate [M, C].
                let gs = &mut gate[m0 * c..m1 * c];
                scratch
                    .par_chunks_mut(chunk)
                    .zip(xs.par_chunks(rows * c))
                    .zip(gs.par_chunks_mut(rows * c))
                    .try_for_each(|((sc, xb), gb)| {
                        pass_a(sc, xb)?;
                        let q = xb.len() / c;
                        let p = &mut sc[rows * c..];
                        for (o, bias) in prep.b_cat[4 * h..].iter().enumerate() {
                            for v in &mut p[(4 * h + o) * rows..][..q] {
                                *v = sigmoid(*v + bias);
                            }
                        }
                        for (qi, grow) in gb.chunks_exact_mut(c).enumerate() {
                            for (o, g) in grow.iter_mut().enumerate() {
                                *g = p[(4 * h + o) * rows + qi];
                            }
                        }
                        Ok::<(), Error>(())
                    })?
            }
        }

        // Pass B: per (b, h), the runs of left/right (and the gpumode gate) inside this
        // super-block, from the contiguous runs of P.
        let scratch = &*scratch;
        let (b0, b1) = (m0 / np, (m1 - 1) / np + 1);
        let p_run = |sub: usize, col: usize, off: usize, len: usize| -> &[f32] {
            &scratch[sub * chunk + rows * c + col * rows + off % rows..][..len]
        };
        let range = b0 * h * np..b1 * h * np;
        let lr = || {
            left[range.clone()].par_chunks_mut(np).zip(right[range.clone()].par_chunks_mut(np)).enumerate().for_each(
                |(e, (lrow, rrow))| {
                    let (b, hh) = (b0 + e / h, e % h);
                    let lo = m0.max(b * np);
                    let hi = m1.min((b + 1) * np);
                    for_runs(m0, lo, hi, np, rows, |_, p, off, len| {
                        let sub = off / rows;
                        let mk = mask.map(|m| &m[b * np + p..][..len]);
                        let bc = &prep.b_cat;
                        gated(
                            &mut lrow[p..p + len],
                            p_run(sub, hh, off, len),
                            p_run(sub, h + hh, off, len),
                            bc[hh],
                            bc[h + hh],
                            mk,
                        );
                        gated(
                            &mut rrow[p..p + len],
                            p_run(sub, 2 * h + hh, off, len),
                            p_run(sub, 3 * h + hh, off, len),
                            bc[2 * h + hh],
                            bc[3 * h + hh],
                            mk,
                        );
                    });
                },
            )
        };
        let og = || {
            if formulation != Formulation::GpuMode {
                return;
            }
            gate[range.clone()].par_chunks_mut(np).enumerate().for_each(|(e, grow)| {
                let (b, hh) = (b0 + e / h, e % h);
                let lo = m0.max(b * np);
                let hi = m1.min((b + 1) * np);
                let bias = prep.b_cat[4 * h + hh];
                for_runs(m0, lo, hi, np, rows, |_, p, off, len| {
                    for (d, &v) in grow[p..p + len].iter_mut().zip(p_run(off / rows, 4 * h + hh, off, len)) {
                        *d = sigmoid(v + bias);
                    }
                });
            })
        };
        rayon::join(lr, og);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Stage 2: the triangle contraction, one GEMM per (b, h).

fn contract(ws: &mut CpuWorkspace, direction: Direction) -> Result<()> {
    let n = ws.shape.n;
    let np = n * n;
    let slices = ws.shape.batch * ws.config.h;
    let threads = rayon::current_num_threads();
    // outgoing t = L·Rᵀ: rhs(k, j) = R[j][k]; incoming t = Lᵀ·R: lhs(i, k) = L[k][i].
    let one = |t: &mut [f32], l: &[f32], r: &[f32], par: Parallelism| -> Result<()> {
        let (lhs, rhs) = match direction {
            Direction::Outgoing => (MatRef::new(l, n, n, n, 1)?, MatRef::new(r, n, n, 1, n)?),
            Direction::Incoming => (MatRef::new(l, n, n, 1, n)?, MatRef::new(r, n, n, n, 1)?),
        };
        matmul(MatMut::new(t, n, n, n, 1)?, lhs, rhs, par)
    };
    let CpuWorkspace { left, right, t, .. } = ws;
    if slices >= threads * SLICES_PER_THREAD {
        t.par_chunks_mut(np)
            .zip(left.par_chunks(np))
            .zip(right.par_chunks(np))
            .try_for_each(|((t, l), r)| one(t, l, r, Parallelism::None))
    } else {
        t.chunks_mut(np)
            .zip(left.chunks(np))
            .zip(right.chunks(np))
            .try_for_each(|((t, l), r)| one(t, l, r, Parallelism::Rayon(threads)))
    }
}

// ---------------------------------------------------------------------------------------------
// Stage 3: LN_H, output gate, output projection.

fn output(prep: &CpuPrepared, ws: &mut CpuWorkspace, y: &mut [f32]) -> Result<()> {
    let Config { c, h, formulation } = prep.config;
    let np = ws.shape.n * ws.shape.n;
    let m_total = ws.shape.rows();
    let Plan { rows, chunk, .. } = ws.plan;
    let super_rows = ws.plan.super_rows();
    let CpuWorkspace { t, gate, scratch, .. } = ws;
    let (t, gate) = (&*t, &*gate);

    let sub_block = |r0: usize, yb: &mut [f32], u: &mut [f32]| -> Result<()> {
        let q = yb.len() / c;
        let u = &mut u[..h * rows];
        // Gather t hidden-major: u[hh][qi] = t[b, hh, p], contiguous runs per batch.
        for hh in 0..h {
            for_runs(r0, r0, r0 + q, np, rows, |b, p, off, len| {
                u[hh * rows + off..][..len].copy_from_slice(&t[(b * h + hh) * np + p..][..len]);
            });
        }
        // LN_H statistics per position, accumulated across h rows so the loops run over
        // positions (contiguous) and vectorise; two passes in f64 as for LN_C.
        let mut mean = [0.0f64; SUB_ROWS];
        let mut rstd = [0.0f64; SUB_ROWS];
        let (mean, rstd) = (&mut mean[..q], &mut rstd[..q]);
        for urow in u.chunks_exact(rows) {
            for (m, &v) in mean.iter_mut().zip(urow) {
                *m += v as f64;
            }
        }
        mean.iter_mut().for_each(|m| *m /= h as f64);
        for urow in u.chunks_exact(rows) {
            for ((s, &m), &v) in rstd.iter_mut().zip(mean.iter()).zip(urow) {
                let d = v as f64 - m;
                *s += d * d;
            }
        }
        rstd.iter_mut().for_each(|s| *s = 1.0 / (*s / h as f64 + LN_EPS as f64).sqrt());
        for (hh, urow) in u.chunks_exact_mut(rows).enumerate() {
            let (wi, bi) = (prep.norm_out_w[hh], prep.norm_out_b[hh]);
            for ((v, &m), &s) in urow.iter_mut().zip(mean.iter()).zip(rstd.iter()) {
                *v = ((*v as f64 - m) * s) as f32 * wi + bi;
            }
            if formulation == Formulation::GpuMode {
                for_runs(r0, r0, r0 + q, np, rows, |b, p, off, len| {
                    for (v, &g) in urow[off..off + len].iter_mut().zip(&gate[(b * h + hh) * np + p..][..len]) {
                        *v *= g;
                    }
                });
            }
        }
        // y rows = u(q, h)·Woutᵀ, with u read column-major (positions contiguous).
        matmul(
            MatMut::new(yb, q, c, c, 1)?,
            MatRef::new(u, q, h, 1, rows)?,
            MatRef::new(&prep.w_out_t, h, c, c, 1)?,
            Parallelism::None,
        )?;
        if formulation == Formulation::Af3 {
            for (yrow, grow) in yb.chunks_exact_mut(c).zip(gate[r0 * c..].chunks_exact(c)) {
                for ((v, &g), &bz) in yrow.iter_mut().zip(grow).zip(&prep.b_out) {
                    *v = g * (*v + bz);
                }
            }
        }
        Ok(())
    };

    for m0 in (0..m_total).step_by(super_rows) {
        let m1 = (m0 + super_rows).min(m_total);
        let subs = (m1 - m0).div_ceil(rows);
        y[m0 * c..m1 * c]
            .par_chunks_mut(rows * c)
            .zip(scratch[..subs * chunk].par_chunks_mut(chunk))
            .enumerate()
            .try_for_each(|(s, (yb, u))| sub_block(m0 + s * rows, yb, u))?;
    }
    Ok(())
}
