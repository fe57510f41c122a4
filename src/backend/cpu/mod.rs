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
//! - `t`: `[B, H, N²]`, hidden channel outside, so each `(b, h)` slice is an `N × N` row-major
//!   matrix and the contraction is one GEMM per slice with no copies;
//! - `left`, `right`: `[B, hc, N²]` for one *hidden chunk* of `hc` channels (all `H` when memory
//!   allows; see [`crate::plan`] for why chunks are exact);
//! - `scratch`: one chunk per sub-block (below), reused by the projection and the output stage.
//!
//! The output gate is never stored: the output stage recomputes it per sub-block from its rows
//! of `x` (LN_C again and a `[C, G]` GEMM, about 1/8 of the projection work, while the stored
//! `[M, G]` tensor would add a quarter to the workspace). The same order makes in-place mode
//! free: a sub-block reads its rows of `x` for the gate before it writes those rows of `y`.
//!
//! # Blocking and threading
//! Positions are processed in *super-blocks* of `subs · rows` consecutive positions (flat over
//! `M`, so `N = 1` with a large `B` still makes full blocks), each split into `subs` sub-blocks of
//! `rows` positions, one per rayon task and one scratch chunk each. Only a super-block's worth of
//! `P` ever exists, so memory beyond the `[B, ·, N²]` tensors stays a few MiB.
//! 1. Projection, per hidden chunk and super-block. Pass A, parallel over sub-blocks: LN_C of the
//!    rows into `z`, then `P = z·Wᵀ` for the chunk's rows of the four left/right projections as
//!    single-threaded GEMMs written hidden-major (`P[w][q]`, so every output column is contiguous
//!    over positions). Pass B, parallel over `(b, h)`: bias, σ, mask and product, reading
//!    contiguous runs of `P` and writing contiguous runs of `left`/`right`. (Two passes because a
//!    sub-block's outputs are separate runs of the `[B, hc, N²]` tensors, which safe Rust cannot
//!    hand to one task; the extra read of `P` hits the cache.)
//! 2. Contraction, per hidden chunk: one `N × N × N` GEMM per `(b, h)`, parallel over the slices
//!    with a single-threaded GEMM each (no synchronisation inside); when there are too few slices
//!    to keep every thread busy, the slices run one after another with a multi-threaded GEMM.
//! 3. Output, per super-block, parallel over sub-blocks: the gate `σ(LN_C(x)·Wogᵀ)` hidden-major,
//!    then `t` gathered for the sub-block's positions hidden-major (`u[h][q]`, contiguous runs),
//!    LN_H with statistics vectorised across positions, the gpumode gate, then one GEMM
//!    `u·Woutᵀ` written straight into the rows of `y`; af3 adds `bz` and multiplies its gate.
//!
//! # Precision
//! Storage and GEMMs are f32. Both LayerNorms take mean and variance in two passes accumulated
//! in f64 (cheap next to the GEMMs): Cauchy-distributed inputs put values of 1e4 beside values of
//! 1e-2 in one row, where a one-pass f32 `E[x²] − E[x]²` would lose every digit. Sigmoid uses a
//! branch-free polynomial `exp` (about 2 ulp) so the gate loops vectorise; `libm`'s `expf` is a
//! scalar call. Measured against the f64 reference: relative L2 error 1e-7 to 4e-7.
//!
//! # Where the time goes
//! Single-threaded at N = 256, B = 2, C = H = 128 (34.4 GFLOP), roughly: projection GEMM 200 ms,
//! contraction 100 ms, output GEMM 47 ms (all near the `gemm` crate's single-core rate), gates
//! and mask (pass B) 43 ms, LN_H and gathering `t` 25 ms, LN_C 11 ms. The element-wise stages are
//! bound by memory traffic: `left`, `right`, the gate and `t` are each written to and read back
//! from DRAM once, as in any unfused pipeline.
//!
//! # Safety and SIMD
//! This module has no `unsafe`: GEMMs go through `backend::host_gemm`, which checks every view
//! against its slice before calling `gemm`. Element-wise loops run inside `simd()`, which lets
//! `pulp` pick AVX2+FMA (or NEON) at run time, so a portable build still vectorises them fully.

#![forbid(unsafe_code)]

use rayon::prelude::*;

mod backward;
mod elementwise;
mod prepared;
#[cfg(test)]
mod test_cases;

pub use self::prepared::CpuPrepared;

use self::elementwise::{gated, layer_norm_rows, sigmoid, simd};
use super::host_gemm::{matmul, MatMut, MatRef, Parallelism};
use super::{Backend, Ceilings, DeviceInfo, MemoryInfo};
use crate::device_io::{BackwardIo, ForwardIo, Operands};
use crate::error::{BackendKind, Error, Result};
use crate::gradients::Gradients;
use crate::plan::ExecPlan;
use crate::problem::{Config, Direction, Formulation, Problem, Shape};
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
    /// The CPU backend (rayon threads, the `gemm` crate).
    pub fn new() -> Self {
        CpuBackend
    }
}

/// How positions and hidden channels are blocked for one problem, thread count and memory limit
/// (the host's tiling; its hidden chunk comes from [`crate::plan::widest_hidden_chunk`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Blocking {
    /// Positions per sub-block.
    rows: usize,
    /// Sub-blocks per super-block.
    subs: usize,
    /// f32 elements of one sub-block's scratch chunk.
    chunk: usize,
    /// Hidden channels per projection + contraction pass.
    hc: usize,
}

impl Blocking {
    fn new(config: &Config, shape: &Shape, threads: usize, hc: usize) -> Blocking {
        let m = shape.rows();
        let rows = SUB_ROWS.min(m).max(1);
        let subs = (threads.max(1) * SUBS_PER_THREAD).min(m.div_ceil(rows)).max(1);
        // Projection: z [rows, C] + P [4·hc, rows]. Output: z + og [G, rows] + u [H, rows].
        // Problem::new bounds every tensor far below usize::MAX, and these are a tiny fraction.
        let chunk = rows * config.c + rows * (4 * hc).max(config.gate_width() + config.h);
        Blocking { rows, subs, chunk, hc }
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
    blocking: Blocking,
    /// `[B, hc, N²]`: one hidden chunk of the left and right projections.
    left: Vec<f32>,
    right: Vec<f32>,
    /// `[B, H, N²]`: the contraction, every channel.
    t: Vec<f32>,
    scratch: Vec<f32>,
    /// LayerNorm epsilon of the forward running in this workspace (set from its problem).
    eps: f64,
}

/// Element counts of the workspace tensors: left, right, t, scratch.
fn workspace_lens(config: &Config, shape: &Shape, blocking: &Blocking) -> [u128; 4] {
    let m = shape.rows() as u128;
    let chunk = m * blocking.hc as u128;
    let scratch = blocking.subs as u128 * blocking.chunk as u128;
    [chunk, chunk, m * config.h as u128, scratch]
}

fn workspace_bytes_of(config: &Config, shape: &Shape, blocking: &Blocking) -> u128 {
    workspace_lens(config, shape, blocking).iter().sum::<u128>() * 4
}

fn plan_bytes(problem: &Problem, hc: usize) -> u64 {
    let blocking = Blocking::new(&problem.config, &problem.shape, rayon::current_num_threads(), hc);
    u64::try_from(workspace_bytes_of(&problem.config, &problem.shape, &blocking)).unwrap_or(u64::MAX)
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
        CpuPrepared::new(weights)
    }

    fn prepared_bytes(&self, p: &CpuPrepared) -> u64 {
        p.bytes()
    }

    fn workspace(&self, prepared: &CpuPrepared, problem: &Problem, limit: Option<u64>) -> Result<CpuWorkspace> {
        check_config(prepared, problem)?;
        let (config, shape) = (problem.config, problem.shape);
        let available = crate::hostmem::available();
        let lim = limit.unwrap_or(u64::MAX).min(available.unwrap_or(u64::MAX));
        let what = || format!("CPU workspace for B={} N={} C={} H={}", shape.batch, shape.n, config.c, config.h);
        let Some(hc) = crate::plan::widest_hidden_chunk(config.h, 1, lim, |hc| plan_bytes(problem, hc)) else {
            return Err(Error::OutOfMemory {
                backend: BackendKind::Cpu,
                what: format!("{} (one hidden channel per pass)", what()),
                needed: plan_bytes(problem, 1),
                available: lim,
            });
        };
        let blocking = Blocking::new(&config, &shape, rayon::current_num_threads(), hc);
        let avail = available.unwrap_or(0);
        let [l, r, t, s] = workspace_lens(&config, &shape, &blocking);
        Ok(CpuWorkspace {
            config,
            shape,
            blocking,
            left: try_zeroed(l, "left projection chunk [B,hc,N,N]", avail)?,
            right: try_zeroed(r, "right projection chunk [B,hc,N,N]", avail)?,
            t: try_zeroed(t, "contraction [B,H,N,N]", avail)?,
            scratch: try_zeroed(s, "block scratch", avail)?,
            eps: f64::from(problem.eps),
        })
    }

    fn workspace_fits(&self, workspace: &CpuWorkspace, problem: &Problem) -> bool {
        workspace.config == problem.config && workspace.shape == problem.shape
    }

    fn workspace_bytes(&self, _prepared: &CpuPrepared, problem: &Problem) -> u64 {
        if problem.validate().is_err() {
            return u64::MAX; // no blocking for a problem Problem::new refuses
        }
        plan_bytes(problem, problem.config.h)
    }

    fn min_workspace_bytes(&self, _prepared: &CpuPrepared, problem: &Problem) -> u64 {
        if problem.validate().is_err() {
            return u64::MAX;
        }
        plan_bytes(problem, 1)
    }

    fn exec_plan(ws: &CpuWorkspace) -> ExecPlan {
        let blocking = ws.blocking;
        ExecPlan {
            hidden_chunk: blocking.hc,
            hidden_passes: ws.config.h.div_ceil(blocking.hc),
            output_rows: blocking.super_rows().min(ws.shape.rows()),
            gate_recomputed: true,
            workspace_bytes: u64::try_from(workspace_bytes_of(&ws.config, &ws.shape, &blocking)).unwrap_or(u64::MAX),
        }
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        try_zeroed(len as u128, "buffer", crate::hostmem::available().unwrap_or(0))
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

    fn buffer_io<'a>(x: Option<&'a Vec<f32>>, mask: Option<&'a Vec<f32>>, y: &'a mut Vec<f32>) -> ForwardIo<'a> {
        let mask = mask.map(Vec::as_slice);
        match x {
            Some(x) => ForwardIo::host(x, mask, y),
            None => ForwardIo::host_in_place(y, mask),
        }
    }

    /// Host slices only: they are this backend's memory, read and written where they lie (no
    /// copy of x or y). In place, each sub-block's rows of x are read before its rows of y are
    /// written over them (see the module docs).
    fn forward(
        &self,
        prepared: &CpuPrepared,
        workspace: &mut CpuWorkspace,
        problem: &Problem,
        io: ForwardIo<'_>,
    ) -> Result<()> {
        if let Operands::Device(_) = io.operands() {
            return Err(super::no_device_io(BackendKind::Cpu));
        }
        io.check(problem)?;
        let Operands::Host { x, mask, y } = io.into_operands() else {
            return Err(super::no_device_io(BackendKind::Cpu));
        };
        check_call(self, prepared, workspace, problem)?;
        run(prepared, workspace, problem, x.unwrap_or(&*y), mask)?;
        output(prepared, workspace, x, y)
    }

    fn backward(&self, prepared: &CpuPrepared, problem: &Problem, io: BackwardIo<'_>) -> Result<Gradients> {
        check_config(prepared, problem)?;
        super::check_backward_io(problem, io.x.len(), io.mask.map(<[f32]>::len), io.dy.len(), None)?;
        backward::backward(prepared, problem, io)
    }

    fn backward_buffers(
        &self,
        prepared: &CpuPrepared,
        problem: &Problem,
        x: &Vec<f32>,
        mask: Option<&Vec<f32>>,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
    ) -> Result<Gradients> {
        super::check_backward_io(problem, x.len(), mask.map(Vec::len), dy.len(), Some(dx.len()))?;
        let mut g = self.backward(prepared, problem, BackwardIo { x, mask: mask.map(|m| &m[..]), dy })?;
        dx.copy_from_slice(&g.x);
        g.x = Vec::new();
        Ok(g)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// The GEMM ceiling is the `gemm` crate's plain f32 2048³ product on all threads (the same
    /// number the CPU speed bar divides by); the copy ceiling is a 256 MiB parallel copy,
    /// counting bytes read plus written, far beyond any last-level cache.
    fn measure_ceilings(&self) -> Result<Ceilings> {
        const GEMM_N: usize = 2048;
        const REPS: usize = 5;
        let avail = crate::hostmem::available().unwrap_or(0);
        let gemm = gemm_ceiling_gflops(GEMM_N, REPS);
        if !gemm.is_finite() {
            return Err(Error::OutOfMemory {
                backend: BackendKind::Cpu,
                what: format!("three {GEMM_N}×{GEMM_N} f32 matrices for the GEMM ceiling"),
                needed: 3 * 4 * (GEMM_N * GEMM_N) as u64,
                available: avail,
            });
        }
        // 256 MiB each way: far beyond any cache, small enough for any machine that runs this.
        let len = 64usize << 20;
        let src: Vec<f32> = {
            let mut v = try_zeroed(len as u128, "copy ceiling source", avail)?;
            v.iter_mut().enumerate().for_each(|(i, x)| *x = (i % 1013) as f32);
            v
        };
        let mut dst = try_zeroed(len as u128, "copy ceiling destination", avail)?;
        // Split across the pool: one core cannot draw the memory system's full bandwidth.
        let piece = len.div_ceil(rayon::current_num_threads().max(1) * 4);
        let mut copy = || {
            let start = std::time::Instant::now();
            dst.par_chunks_mut(piece).zip(src.par_chunks(piece)).for_each(|(d, s)| d.copy_from_slice(s));
            start.elapsed().as_secs_f64()
        };
        copy();
        let mut times: Vec<f64> = (0..REPS).map(|_| copy()).collect();
        times.sort_by(f64::total_cmp);
        let copy_s = times[REPS / 2];
        Ok(Ceilings {
            gemm_tflops: gemm / 1e3,
            gemm_desc: format!("gemm crate f32 {GEMM_N}³, {} rayon threads", rayon::current_num_threads()),
            copy_gbs: 2.0 * (len * 4) as f64 / copy_s / 1e9,
        })
    }

    fn memory_info(&self) -> Result<Option<MemoryInfo>> {
        Ok(match (crate::hostmem::available(), crate::hostmem::total()) {
            (Some(free), Some(total)) => Some(MemoryInfo { free, total }),
            _ => None,
        })
    }
}

/// The plain f32 GEMM rate of this machine through the same `gemm` crate and rayon pool the
/// backend uses: an `n × n × n` product (`2n³` FLOPs), one warm-up, then the median of
/// `repeats` timed runs, in GFLOP/s. The CPU backend's speed bar is a fraction of this.
/// Returns NaN if the three `n × n` matrices cannot be allocated.
pub fn gemm_ceiling_gflops(n: usize, repeats: usize) -> f64 {
    let n = n.max(1);
    let alloc = || try_zeroed((n as u128).pow(2), "GEMM ceiling matrix", 0);
    let (Ok(mut a), Ok(mut b), Ok(mut c)) = (alloc(), alloc(), alloc()) else {
        return f64::NAN;
    };
    // Deterministic, non-trivial values: zeros or repeated constants could take shortcuts.
    a.iter_mut().enumerate().for_each(|(i, v)| *v = ((i * 7 + 3) % 31) as f32 / 31.0 - 0.5);
    b.iter_mut().enumerate().for_each(|(i, v)| *v = ((i * 11 + 5) % 29) as f32 / 29.0 - 0.5);
    let par = Parallelism::Rayon(rayon::current_num_threads());
    let mut once = || -> Result<f64> {
        let start = std::time::Instant::now();
        matmul(MatMut::new(&mut c, n, n, n, 1)?, MatRef::new(&a, n, n, n, 1)?, MatRef::new(&b, n, n, n, 1)?, par)?;
        Ok(start.elapsed().as_secs_f64())
    };
    if once().is_err() {
        return f64::NAN;
    }
    let mut times: Vec<f64> = (0..repeats.max(1)).filter_map(|_| once().ok()).collect();
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).map_or(f64::NAN, |t| 2.0 * (n as f64).powi(3) / t / 1e9)
}

/// The checks of the weights and the workspace every forward makes before touching memory (the
/// I/O's are [`ForwardIo::check`]'s).
fn check_call(be: &CpuBackend, prepared: &CpuPrepared, workspace: &mut CpuWorkspace, problem: &Problem) -> Result<()> {
    check_config(prepared, problem)?;
    if !be.workspace_fits(workspace, problem) {
        return Err(Error::InvalidArgument(format!(
            "workspace was made for B={} N={} and {:?}, not for this problem",
            workspace.shape.batch, workspace.shape.n, workspace.config
        )));
    }
    workspace.eps = f64::from(problem.eps);
    Ok(())
}

/// Every hidden pass: the chunk's projections, then its channels of the contraction.
fn run(prep: &CpuPrepared, ws: &mut CpuWorkspace, problem: &Problem, x: &[f32], mask: Option<&[f32]>) -> Result<()> {
    let (h, hc) = (prep.config.h, ws.blocking.hc);
    for h0 in (0..h).step_by(hc) {
        let n = hc.min(h - h0);
        project(prep, ws, x, mask, h0, n)?;
        contract(ws, problem.direction, h0, n)?;
    }
    Ok(())
}

fn check_config(prepared: &CpuPrepared, problem: &Problem) -> Result<()> {
    super::check_prepared_for(&prepared.config, problem)
}

fn copy_checked(src: &[f32], dst: &mut [f32]) -> Result<()> {
    if src.len() != dst.len() {
        return Err(Error::Shape(format!("copy of {} elements into a buffer of {}", src.len(), dst.len())));
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// One run of consecutive positions `m0 + off .. m0 + off + len` that stays inside one batch
/// `b` (starting at in-batch position `p`) and one sub-block.
#[derive(Copy, Clone, Debug)]
struct Run {
    b: usize,
    p: usize,
    off: usize,
    len: usize,
}

/// The maximal [`Run`]s covering positions `[lo, hi)`, with offsets counted from `m0` and
/// sub-blocks of `rows` positions starting at `m0`. An iterator rather than a callback so the
/// loops over it stay inside one function and compile for the SIMD level of [`simd`].
struct Runs {
    m: usize,
    hi: usize,
    m0: usize,
    np: usize,
    rows: usize,
}

impl Runs {
    #[inline(always)]
    fn new(m0: usize, lo: usize, hi: usize, np: usize, rows: usize) -> Runs {
        Runs { m: lo, hi, m0, np, rows }
    }
}

impl Iterator for Runs {
    type Item = Run;

    #[inline(always)]
    fn next(&mut self) -> Option<Run> {
        if self.m >= self.hi {
            return None;
        }
        let (b, p) = (self.m / self.np, self.m % self.np);
        let off = self.m - self.m0;
        let len = (self.rows - off % self.rows).min(self.np - p).min(self.hi - self.m);
        self.m += len;
        Some(Run { b, p, off, len })
    }
}

// ---------------------------------------------------------------------------------------------
// Stage 1: LN_C, the left/right projections of one hidden chunk, gates and mask.

/// `left`/`right` for hidden channels `h0 .. h0 + n` of every position, into the workspace's
/// `[B, n, N²]` chunk buffers.
fn project(
    prep: &CpuPrepared,
    ws: &mut CpuWorkspace,
    x: &[f32],
    mask: Option<&[f32]>,
    h0: usize,
    n: usize,
) -> Result<()> {
    let Config { c, h, .. } = prep.config;
    let np = ws.shape.n * ws.shape.n;
    let m_total = ws.shape.rows();
    let Blocking { rows, chunk, .. } = ws.blocking;
    let super_rows = ws.blocking.super_rows();
    let eps = ws.eps;
    let CpuWorkspace { left, right, scratch, .. } = ws;

    // Pass A for one sub-block: LN_C, then P = z·Wᵀ for the chunk's rows of the four left/right
    // projections, stored P[w][q] (column stride `rows`) with w = s·n + j for section s (lp,
    // lg, rp, rg) and channel h0 + j, so each output is a contiguous run over positions.
    let pass_a = |sc: &mut [f32], xb: &[f32]| -> Result<()> {
        let q = xb.len() / c;
        let (z, p) = sc.split_at_mut(rows * c);
        let z = &mut z[..q * c];
        simd(
            #[inline(always)]
            || layer_norm_rows(xb, z, &prep.norm_in_w, &prep.norm_in_b, eps),
        );
        let zv = || MatRef::new(z, q, c, c, 1);
        if n == h {
            // The four sections are contiguous rows of Wcat: one GEMM.
            let w = &prep.w_cat[..4 * h * c];
            return matmul(
                MatMut::new(&mut p[..4 * h * rows], q, 4 * h, 1, rows)?,
                zv()?,
                MatRef::new(w, c, 4 * h, 1, c)?,
                Parallelism::None,
            );
        }
        for (s, ps) in p[..4 * n * rows].chunks_exact_mut(n * rows).enumerate() {
            let w = &prep.w_cat[(s * h + h0) * c..(s * h + h0 + n) * c];
            matmul(MatMut::new(ps, q, n, 1, rows)?, zv()?, MatRef::new(w, c, n, 1, c)?, Parallelism::None)?;
        }
        Ok(())
    };

    for m0 in (0..m_total).step_by(super_rows) {
        let m1 = (m0 + super_rows).min(m_total);
        let subs = (m1 - m0).div_ceil(rows);
        let scratch = &mut scratch[..subs * chunk];
        let xs = &x[m0 * c..m1 * c];
        scratch.par_chunks_mut(chunk).zip(xs.par_chunks(rows * c)).try_for_each(|(sc, xb)| pass_a(sc, xb))?;

        // Pass B, per (b, channel): bias, σ, mask and product for the runs of left/right inside
        // this super-block, from the contiguous runs of P.
        let scratch = &*scratch;
        let (b0, b1) = (m0 / np, (m1 - 1) / np + 1);
        let range = b0 * n * np..b1 * n * np;
        let bc = &prep.b_cat;
        left[range.clone()].par_chunks_mut(np).zip(right[range].par_chunks_mut(np)).enumerate().for_each(
            |(e, (lrow, rrow))| {
                let (b, j) = (b0 + e / n, e % n);
                let hh = h0 + j;
                let runs = Runs::new(m0, m0.max(b * np), m1.min((b + 1) * np), np, rows);
                simd(
                    #[inline(always)]
                    || {
                        for Run { p, off, len, .. } in runs {
                            let mk = mask.map(|m| &m[b * np + p..][..len]);
                            let col = |s: usize| p_run(scratch, chunk, rows, c, s * n + j, off, len);
                            gated(&mut lrow[p..p + len], col(0), col(1), bc[hh], bc[h + hh], mk);
                            gated(&mut rrow[p..p + len], col(2), col(3), bc[2 * h + hh], bc[3 * h + hh], mk);
                        }
                    },
                );
            },
        );
    }
    Ok(())
}

/// Column `col` of the projection output `P` for positions `off .. off + len` of the current
/// super-block (one run, so inside one sub-block's scratch chunk).
#[inline(always)]
fn p_run(scratch: &[f32], chunk: usize, rows: usize, c: usize, col: usize, off: usize, len: usize) -> &[f32] {
    &scratch[(off / rows) * chunk + rows * c + col * rows + off % rows..][..len]
}

// ---------------------------------------------------------------------------------------------
// Stage 2: the triangle contraction, one GEMM per (b, h).

/// `t[b, h0 + j] = L·Rᵀ` (or `Lᵀ·R`) for the chunk's `n` channels, from the chunk buffers.
fn contract(ws: &mut CpuWorkspace, direction: Direction, h0: usize, n: usize) -> Result<()> {
    let nseq = ws.shape.n;
    let np = nseq * nseq;
    let h = ws.config.h;
    let slices = ws.shape.batch * n;
    let threads = rayon::current_num_threads();
    // outgoing t = L·Rᵀ: rhs(k, j) = R[j][k]; incoming t = Lᵀ·R: lhs(i, k) = L[k][i].
    let one = |t: &mut [f32], l: &[f32], r: &[f32], par: Parallelism| -> Result<()> {
        let (lhs, rhs) = match direction {
            Direction::Outgoing => (MatRef::new(l, nseq, nseq, nseq, 1)?, MatRef::new(r, nseq, nseq, 1, nseq)?),
            Direction::Incoming => (MatRef::new(l, nseq, nseq, 1, nseq)?, MatRef::new(r, nseq, nseq, nseq, 1)?),
        };
        matmul(MatMut::new(t, nseq, nseq, nseq, 1)?, lhs, rhs, par)
    };
    let CpuWorkspace { left, right, t, .. } = ws;
    // The chunk's channels of t: per batch, n consecutive N×N slices.
    let mut ts: Vec<&mut [f32]> =
        t.chunks_mut(h * np).flat_map(|tb| tb[h0 * np..(h0 + n) * np].chunks_mut(np)).collect();
    let (left, right) = (&left[..slices * np], &right[..slices * np]);
    if slices >= threads * SLICES_PER_THREAD {
        ts.par_iter_mut()
            .zip(left.par_chunks(np))
            .zip(right.par_chunks(np))
            .try_for_each(|((t, l), r)| one(t, l, r, Parallelism::None))
    } else {
        ts.iter_mut()
            .zip(left.chunks(np))
            .zip(right.chunks(np))
            .try_for_each(|((t, l), r)| one(t, l, r, Parallelism::Rayon(threads)))
    }
}

// ---------------------------------------------------------------------------------------------
// Stage 3: output gate (from x), LN_H, output projection.

/// The output stage, per sub-block of positions. `x` is `None` in place: the sub-block's rows
/// of `x` are then the rows of `y` it is about to write, and its gate reads them first.
fn output(prep: &CpuPrepared, ws: &mut CpuWorkspace, x: Option<&[f32]>, y: &mut [f32]) -> Result<()> {
    let Config { c, h, formulation } = prep.config;
    let g = prep.config.gate_width();
    let np = ws.shape.n * ws.shape.n;
    let m_total = ws.shape.rows();
    let Blocking { rows, chunk, .. } = ws.blocking;
    let super_rows = ws.blocking.super_rows();
    let eps = ws.eps;
    let CpuWorkspace { t, scratch, .. } = ws;
    let t = t.as_slice();

    // One sub-block of positions r0 .. r0 + q. Scratch: z [rows, C] | og [G][rows] | u [H][rows].
    let sub_block = |r0: usize, yb: &mut [f32], sc: &mut [f32]| -> Result<()> {
        let q = yb.len() / c;
        let (z, rest) = sc.split_at_mut(rows * c);
        let (og, u) = rest.split_at_mut(g * rows);
        let u = &mut u[..h * rows];
        {
            // og = σ(LN_C(x)·Wogᵀ + b), hidden-major like u. In place, x's rows are yb's.
            let xb: &[f32] = match x {
                Some(x) => &x[r0 * c..(r0 + q) * c],
                None => &*yb,
            };
            let z = &mut z[..q * c];
            simd(
                #[inline(always)]
                || layer_norm_rows(xb, z, &prep.norm_in_w, &prep.norm_in_b, eps),
            );
            matmul(
                MatMut::new(og, q, g, 1, rows)?,
                MatRef::new(z, q, c, c, 1)?,
                MatRef::new(&prep.w_cat[4 * h * c..], c, g, 1, c)?,
                Parallelism::None,
            )?;
            let bias = &prep.b_cat[4 * h..];
            simd(
                #[inline(always)]
                || {
                    for (orow, &b) in og.chunks_exact_mut(rows).zip(bias) {
                        for v in &mut orow[..q] {
                            *v = sigmoid(*v + b);
                        }
                    }
                },
            );
        }
        simd(
            #[inline(always)]
            || {
                norm_out_block(prep, t, u, r0, q, np, rows, eps);
                if formulation == Formulation::GpuMode {
                    for (urow, orow) in u.chunks_exact_mut(rows).zip(og.chunks_exact(rows)) {
                        for (v, &gv) in urow[..q].iter_mut().zip(&orow[..q]) {
                            *v *= gv;
                        }
                    }
                }
            },
        );
        matmul(
            MatMut::new(yb, q, c, c, 1)?,
            MatRef::new(u, q, h, 1, rows)?,
            MatRef::new(&prep.w_out_t, h, c, c, 1)?,
            Parallelism::None,
        )?;
        if formulation == Formulation::Af3 {
            simd(
                #[inline(always)]
                || {
                    for (qi, yrow) in yb.chunks_exact_mut(c).enumerate() {
                        for (o, (v, &bz)) in yrow.iter_mut().zip(&prep.b_out).enumerate() {
                            *v = og[o * rows + qi] * (*v + bz);
                        }
                    }
                },
            );
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
            .try_for_each(|(s, (yb, sc))| sub_block(m0 + s * rows, yb, sc))?;
    }
    Ok(())
}

/// `u[h][qi] = LN_H(t[·, r0 + qi])[h]` for the `q` positions from `r0`, with `u` hidden-major
/// (`[H][rows]`). Gathered from `t` ([B, H, N²]) in contiguous runs; the statistics accumulate
/// across the H rows so every loop runs over positions and vectorises. Two passes in f64, as
/// for LN_C.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn norm_out_block(prep: &CpuPrepared, t: &[f32], u: &mut [f32], r0: usize, q: usize, np: usize, rows: usize, eps: f64) {
    let h = prep.config.h;
    let mut mean = [0.0f64; SUB_ROWS];
    let mut rstd = [0.0f64; SUB_ROWS];
    let (mean, rstd) = (&mut mean[..q], &mut rstd[..q]);
    for (hh, urow) in u.chunks_exact_mut(rows).enumerate() {
        for Run { b, p, off, len } in Runs::new(r0, r0, r0 + q, np, rows) {
            let src = &t[(b * h + hh) * np + p..][..len];
            for ((d, m), &v) in urow[off..off + len].iter_mut().zip(&mut mean[off..off + len]).zip(src) {
                *d = v;
                *m += v as f64;
            }
        }
    }
    let inv_h = 1.0 / h as f64;
    mean.iter_mut().for_each(|m| *m *= inv_h);
    for urow in u.chunks_exact(rows) {
        for ((s, &m), &v) in rstd.iter_mut().zip(mean.iter()).zip(urow) {
            let d = v as f64 - m;
            *s += d * d;
        }
    }
    rstd.iter_mut().for_each(|s| *s = 1.0 / (*s * inv_h + eps).sqrt());
    for (hh, urow) in u.chunks_exact_mut(rows).enumerate() {
        let (wi, bi) = (prep.norm_out_w[hh], prep.norm_out_b[hh]);
        for ((v, &m), &s) in urow.iter_mut().zip(mean.iter()).zip(rstd.iter()) {
            *v = ((*v as f64 - m) * s) as f32 * wi + bi;
        }
    }
}

#[cfg(test)]
mod tests {
    //! Unit tests of this module's pieces and edge cases, judged against the f64 reference
    //! (`crate::reference`); the GPU MODE suite runs through tests/conformance.
    use super::elementwise::exp_f32;
    use super::test_cases::{case, inputs, Case};
    use super::*;
    use crate::reference;

    fn oracle(w: &Weights, pr: &Problem, x: &[f32], mask: Option<&[f32]>) -> Vec<f64> {
        reference::forward(w, pr, x, mask).unwrap()
    }

    fn run_cpu(w: &Weights, pr: &Problem, x: &[f32], mask: Option<&[f32]>) -> Result<Vec<f32>> {
        let be = CpuBackend::new();
        let prep = be.prepare(w)?;
        let mut ws = be.workspace(&prep, pr, None)?;
        let mut y = vec![f32::NAN; x.len()];
        be.forward(&prep, &mut ws, pr, ForwardIo::host(x, mask, &mut y))?;
        Ok(y)
    }

    fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
        reference::compare(got, want, 0.0, f64::INFINITY).rel_l2
    }

    fn check(cs: Case, seed: u64) {
        let (w, pr, x, mask, _) = inputs(&cs, seed);
        let y = run_cpu(&w, &pr, &x, mask.as_deref()).unwrap();
        let want = oracle(&w, &pr, &x, mask.as_deref());
        // f32 throughout lands near 1e-7 relative L2; elementwise far inside GPU MODE's 2e-2.
        let cmp = reference::compare(&y, &want, 1e-3, 1e-5);
        assert!(cmp.passed() && cmp.rel_l2 < 2e-6, "{pr:?}: {cmp}");
    }

    #[test]
    fn matches_f64_both_formulations_and_directions() {
        for f in [Formulation::GpuMode, Formulation::Af3] {
            for dir in [Direction::Outgoing, Direction::Incoming] {
                for masked in [false, true] {
                    check(Case { masked, ..case(f, dir, 2, 9, 16, 12) }, 1);
                }
            }
        }
    }

    /// The epsilon reaches both LayerNorms: with x scaled so that its variance (about 1e-4) is
    /// below eps = 1e-2, the result moves far from the default eps's, and it matches the f64
    /// reference computed with the same eps.
    #[test]
    fn layer_norm_eps_is_the_problems() {
        for f in [Formulation::GpuMode, Formulation::Af3] {
            let (w, pr, x, _, _) = inputs(&case(f, Direction::Outgoing, 1, 8, 16, 8), 11);
            let x: Vec<f32> = x.iter().map(|v| v * 1e-2).collect();
            let wide = pr.with_eps(1e-2);
            let y = run_cpu(&w, &wide, &x, None).unwrap();
            let cmp = reference::compare(&y, &oracle(&w, &wide, &x, None), 1e-3, 1e-5);
            assert!(cmp.passed() && cmp.rel_l2 < 2e-6, "{wide:?}: {cmp}");
            let default = oracle(&w, &pr, &x, None);
            assert!(rel_l2(&y, &default) > 1e-2, "eps 1e-2 should change y: {}", rel_l2(&y, &default));
        }
    }

    #[test]
    fn af3_biases_odd_sizes_and_cauchy() {
        check(Case { biases: true, masked: true, ..case(Formulation::Af3, Direction::Outgoing, 1, 33, 24, 20) }, 2);
        check(Case { biases: true, ..case(Formulation::Af3, Direction::Incoming, 2, 17, 7, 13) }, 3);
        check(Case { cauchy: true, ..case(Formulation::GpuMode, Direction::Incoming, 1, 33, 16, 8) }, 4);
        check(Case { cauchy: true, masked: true, ..case(Formulation::Af3, Direction::Outgoing, 2, 12, 10, 6) }, 5);
    }

    #[test]
    fn tiny_and_batched_shapes() {
        // N = 1: one position per batch, so blocks straddle batches.
        check(case(Formulation::GpuMode, Direction::Outgoing, 5, 1, 4, 3), 6);
        check(Case { biases: true, ..case(Formulation::Af3, Direction::Incoming, 3, 1, 3, 5) }, 7);
        check(case(Formulation::GpuMode, Direction::Incoming, 1, 2, 1, 1), 8);
        // More positions than one super-block, with batch boundaries inside sub-blocks.
        check(Case { masked: true, ..case(Formulation::GpuMode, Direction::Outgoing, 3, 37, 8, 4) }, 9);
    }

    #[test]
    fn thread_count_does_not_change_results() {
        let cs = Case { masked: true, biases: true, ..case(Formulation::Af3, Direction::Outgoing, 2, 40, 12, 9) };
        let (w, pr, x, mask, _) = inputs(&cs, 10);
        let ys: Vec<Vec<f32>> = [1, 3]
            .iter()
            .map(|&t| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap();
                pool.install(|| run_cpu(&w, &pr, &x, mask.as_deref()).unwrap())
            })
            .collect();
        let want = oracle(&w, &pr, &x, mask.as_deref());
        for y in &ys {
            assert!(rel_l2(y, &want) < 1e-5);
        }
        // Each output element is computed by one thread in a fixed order, whatever the pool.
        assert_eq!(ys[0], ys[1], "one thread and three threads differ");
    }

    #[test]
    fn workspace_is_reused_and_checked() {
        let cs = case(Formulation::GpuMode, Direction::Outgoing, 1, 10, 8, 8);
        let (w, pr, x, _, _) = inputs(&cs, 11);
        let be = CpuBackend::new();
        let prep = be.prepare(&w).unwrap();
        let mut ws = be.workspace(&prep, &pr, None).unwrap();
        let mut y1 = vec![0.0; x.len()];
        let mut y2 = vec![0.0; x.len()];
        be.forward(&prep, &mut ws, &pr, ForwardIo::host(&x, None, &mut y1)).unwrap();
        let x2: Vec<f32> = x.iter().map(|v| v * 0.5 - 0.25).collect();
        be.forward(&prep, &mut ws, &pr, ForwardIo::host(&x2, None, &mut y2)).unwrap();
        be.forward(&prep, &mut ws, &pr, ForwardIo::host(&x, None, &mut y2)).unwrap();
        assert_eq!(y1, y2, "a reused workspace must not leak state between calls");

        let other = Problem::new(pr.config, Shape::new(1, 11), pr.direction, false).unwrap();
        assert!(!be.workspace_fits(&ws, &other));
        let mut y3 = vec![0.0; other.x_len()];
        let x3 = vec![0.5; other.x_len()];
        assert!(be.forward(&prep, &mut ws, &other, ForwardIo::host(&x3, None, &mut y3)).is_err());
        let incoming = Problem::new(pr.config, pr.shape, Direction::Incoming, true).unwrap();
        assert!(be.workspace_fits(&ws, &incoming));
        // Lengths and mask presence are checked even when called directly.
        assert!(be.forward(&prep, &mut ws, &incoming, ForwardIo::host(&x, None, &mut y1)).is_err());
        assert!(be.forward(&prep, &mut ws, &pr, ForwardIo::host(&x[1..], None, &mut y1)).is_err());
        let bytes = be.workspace_bytes(&prep, &pr);
        let floats = ws.left.len() + ws.right.len() + ws.t.len() + ws.scratch.len();
        assert_eq!(bytes, 4 * floats as u64);
    }

    #[test]
    fn huge_workspace_is_an_error_not_an_abort() {
        let cfg = Config::new(Formulation::GpuMode, 128, 128).unwrap();
        let w = Weights::random(cfg, false, 12).unwrap();
        let pr = Problem::new(cfg, Shape::new(4, 100_000), Direction::Outgoing, false).unwrap();
        let be = CpuBackend::new();
        let prep = be.prepare(&w).unwrap();
        match be.workspace(&prep, &pr, None) {
            Err(Error::OutOfMemory { backend: BackendKind::Cpu, needed, .. }) => {
                assert_eq!(needed, be.min_workspace_bytes(&prep, &pr))
            }
            other => panic!("expected OutOfMemory, got {:?}", other.map(|_| ())),
        }
    }

    #[test]
    fn nan_propagates_where_the_math_says() {
        let cs = case(Formulation::GpuMode, Direction::Outgoing, 2, 6, 8, 4);
        let (w, pr, mut x, _, _) = inputs(&cs, 13);
        // Position (b=1, i=2, j=4): left row i=2 and right row j... → t[1, 2, :] and t[1, :, 2].
        x[((6 + 2) * 6 + 4) * 8 + 3] = f32::NAN;
        let y = run_cpu(&w, &pr, &x, None).unwrap();
        let want = oracle(&w, &pr, &x, None);
        let cmp = reference::compare(&y, &want, 1e-3, 1e-5);
        assert!(cmp.passed() && cmp.nan_mismatch == 0, "{cmp}");
        assert!(y.iter().any(|v| v.is_nan()) && y.iter().any(|v| v.is_finite()));
    }

    #[test]
    fn incoming_is_outgoing_on_the_transpose() {
        let cs = Case { masked: true, ..case(Formulation::Af3, Direction::Incoming, 2, 11, 6, 5) };
        let (w, pr, x, mask, _) = inputs(&cs, 14);
        let (n, c) = (11, 6);
        let swap = |v: &[f32], width: usize| {
            let mut out = vec![0.0; v.len()];
            for b in 0..2 {
                for i in 0..n {
                    for j in 0..n {
                        let (src, dst) = (((b * n + i) * n + j) * width, ((b * n + j) * n + i) * width);
                        out[dst..dst + width].copy_from_slice(&v[src..src + width]);
                    }
                }
            }
            out
        };
        let y_in = run_cpu(&w, &pr, &x, mask.as_deref()).unwrap();
        // With i and j swapped, Σ_k L[k,i]·R[k,j] becomes Σ_k R'[j,k]·L'[i,k] at (j, i): the
        // outgoing product of the swapped input with the left and right projections exchanged.
        // (Without the exchange the identity only holds for t symmetric.)
        let mut w_swapped = w.clone();
        std::mem::swap(&mut w_swapped.left_proj, &mut w_swapped.right_proj);
        std::mem::swap(&mut w_swapped.left_gate, &mut w_swapped.right_gate);
        let w = w_swapped;
        let out = Problem { direction: Direction::Outgoing, ..pr };
        let mask_t = mask.as_deref().map(|m| swap(m, 1));
        let y_out = swap(&run_cpu(&w, &out, &swap(&x, c), mask_t.as_deref()).unwrap(), c);
        let want: Vec<f64> = y_in.iter().map(|&v| v as f64).collect();
        assert!(rel_l2(&y_out, &want) < 1e-5);
    }

    #[test]
    fn exp_is_accurate_and_keeps_nan() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let got = exp_f32(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 5e-7, "worst relative error {worst:e}");
        assert!(exp_f32(f32::NAN).is_nan() && sigmoid(f32::NAN).is_nan());
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
        assert!(sigmoid(f32::NEG_INFINITY) < 1e-37);
        assert_eq!(sigmoid(0.0), 0.5);
    }

    #[test]
    fn ceilings_are_measured() {
        let c = CpuBackend::new().measure_ceilings().unwrap();
        assert!(c.gemm_tflops > 0.0 && c.gemm_tflops.is_finite(), "{c:?}");
        assert!(c.copy_gbs > 0.0 && c.copy_gbs.is_finite(), "{c:?}");
        assert!(c.gemm_desc.contains("2048"));
    }

    #[test]
    fn info_and_memory() {
        let be = CpuBackend::new();
        let info = be.info();
        assert_eq!(info.arch, std::env::consts::ARCH);
        assert!(info.compute_units >= 1);
        if let Some(m) = be.memory_info().unwrap() {
            assert!(m.free <= m.total && m.total == info.memory_bytes);
        }
    }
}
