//! Workspace layout of one problem shape: which buffers a forward needs, how large, and how the
//! input projection is chunked. Pure arithmetic, tested on the host.
//!
//! Buffers (M = B·N² positions, f16 unless noted):
//! - `left`, `right` `[B, H, N, N]` (M·H each); after the contraction `left` holds `a` `[M, H]`;
//! - `gate` `[M, G]`;
//! - `t` `[B, H, N, N]` (M·H);
//! - staging for one chunk of the projection: `z` `[chunk, C]` and `proj` `[chunk, 4H + G]`. The
//!   contraction result `t` is written only after every chunk is projected, so the staging lives
//!   inside `t`'s buffer whenever a chunk of at least [`MIN_CHUNK_ROWS`] fits there; small problems
//!   (M ≤ MIN_CHUNK_ROWS) get a separate staging buffer and one chunk, to save launches;
//! - `ones` `[M]` f32 for af3 (the bias update GEMM multiplies the bias by it).

#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use crate::problem::{Formulation, Problem};

/// Fewest positions per projection chunk when chunking (GEMM efficiency drops below this).
pub const MIN_CHUNK_ROWS: usize = 4096;
/// Chunks are multiples of this many positions: chunk starts stay 64-aligned, which the stage
/// kernels' 16-byte vector accesses along positions rely on.
pub const CHUNK_ALIGN: usize = 64;
/// Alignment of the `proj` staging area.
pub const STAGING_ALIGN: usize = 256;

/// Where `z` and `proj` live.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Staging {
    /// Inside the `t` buffer, which is idle until the contraction.
    InT,
    /// In a buffer of their own of `Plan::staging_bytes`.
    Separate,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Positions M = B·N².
    pub rows: usize,
    pub c: usize,
    pub h: usize,
    pub g: usize,
    pub p: usize,
    pub af3: bool,
    pub chunk_rows: usize,
    pub staging: Staging,
    /// Byte offset of `proj` in the staging area (`z` is at 0).
    pub proj_offset: usize,
    /// Bytes of the staging area (= `t_bytes` for [`Staging::InT`]).
    pub staging_bytes: usize,
    pub left_bytes: usize,
    pub gate_bytes: usize,
    pub t_bytes: usize,
    pub ones_bytes: usize,
}

fn align_up(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

fn mul(parts: &[usize]) -> Result<usize> {
    parts
        .iter()
        .try_fold(1usize, |acc, &v| acc.checked_mul(v))
        .ok_or_else(|| Error::Shape(format!("workspace size {parts:?} overflows usize")))
}

impl Plan {
    pub fn new(problem: &Problem) -> Result<Plan> {
        let cfg = problem.config;
        let (c, h, g) = (cfg.c, cfg.h, cfg.gate_width());
        let p = cfg.fused_proj_width();
        let rows = problem.shape.rows();
        let t_bytes = mul(&[rows, h, 2])?;
        let per_row = 2 * (c + p);
        let fits = |chunk: usize, capacity: usize| align_up(chunk * c * 2, STAGING_ALIGN) + chunk * p * 2 <= capacity;
        let (chunk_rows, staging) = if rows <= MIN_CHUNK_ROWS {
            (rows, Staging::Separate)
        } else {
            let in_t = (t_bytes.saturating_sub(STAGING_ALIGN) / per_row) / CHUNK_ALIGN * CHUNK_ALIGN;
            if in_t >= MIN_CHUNK_ROWS {
                (in_t.min(rows), Staging::InT)
            } else {
                (MIN_CHUNK_ROWS, Staging::Separate)
            }
        };
        let proj_offset = align_up(chunk_rows * c * 2, STAGING_ALIGN);
        let staging_bytes = match staging {
            Staging::InT => t_bytes,
            Staging::Separate => proj_offset + chunk_rows * p * 2,
        };
        debug_assert!(fits(chunk_rows, staging_bytes));
        Ok(Plan {
            rows,
            c,
            h,
            g,
            p,
            af3: cfg.formulation == Formulation::Af3,
            chunk_rows,
            staging,
            proj_offset,
            staging_bytes,
            left_bytes: t_bytes,
            gate_bytes: mul(&[rows, g, 2])?,
            t_bytes,
            ones_bytes: if cfg.formulation == Formulation::Af3 { mul(&[rows, 4])? } else { 0 },
        })
    }

    /// Whether a workspace of this plan serves `problem` (same buffer sizes and chunking).
    pub fn fits(&self, problem: &Problem) -> bool {
        Plan::new(problem).is_ok_and(|p| p == *self)
    }

    /// Device bytes of every intermediate: left, right, gate, t, separate staging, ones.
    pub fn total_bytes(&self) -> u64 {
        let staging = if self.staging == Staging::Separate { self.staging_bytes } else { 0 };
        (2 * self.left_bytes + self.gate_bytes + self.t_bytes + staging + self.ones_bytes) as u64
    }

    /// The chunks of the projection: `(first position, positions)`.
    pub fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.rows).step_by(self.chunk_rows.max(1)).map(|r0| (r0, self.chunk_rows.min(self.rows - r0)))
    }
}

/// Hidden channels per pass are multiples of this (`input_gating` stores 16-byte runs of 8).
pub const PASS_STEP: usize = 8;
/// Largest row chunk of a chunked plan: beyond a million positions more launches cost nothing.
pub const MAX_CHUNK_ROWS: usize = 1 << 20;

/// A plan that fits a memory limit (see [`crate::memory`] for why it is exact):
///
/// - **hidden passes** of `hc` channels: per row chunk, `input_norm` (z), the projection GEMM with
///   this pass's rows of the four gated projections (packed per pass into `pass_w` when the
///   workspace is made), and `input_gating` with `H = hc` and no gate, writing left/right of the
///   pass as `[B, hc, N, N]`; then the pass's contraction, one strided-batched GEMM per batch
///   into its channels of the full `t`;
/// - **row chunks** of the output stage: the gate recomputed from x (`input_norm`, a GEMM with the
///   `out_gate` rows, `input_gating` with `H = 0`) into a chunk buffer, then the output stage of
///   those rows (MFMA kernel, or `output_norm` + GEMM + bias + af3 gate).
///
/// Out of place, left/right live in the caller's `y` (dead until the output stage) when they fit
/// there. In place (`y` is `x`, read by every pass) they take scratch, and each row chunk reads
/// its rows of x for the gate before its output overwrites them.
///
/// Scratch (one buffer, the two phases never overlap): phase A `[z | proj | left | right]`,
/// phase B `[z | proj | gate | a]`, each region 256-aligned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkedPlan {
    pub rows: usize,
    pub c: usize,
    pub h: usize,
    pub g: usize,
    pub af3: bool,
    pub hc: usize,
    pub chunk_rows: usize,
    pub lr_in_y: bool,
    /// Bytes of one of the left/right pass buffers (`M·hc` f16, aligned).
    pub lr_bytes: usize,
    pub proj_a_off: usize,
    pub lr_off: usize,
    pub proj_b_off: usize,
    pub gate_off: usize,
    pub a_off: usize,
    pub scratch_bytes: usize,
    pub t_bytes: usize,
    /// Per-pass packed projection rows `[4H, C]` f16, then (at `pass_bias_off`) their biases
    /// `[4H]` f32.
    pub pass_w_bytes: usize,
    pub pass_bias_off: usize,
    pub ones_bytes: usize,
}

impl ChunkedPlan {
    /// The plan with `hc` channels per pass and row chunks of `chunk_rows` positions.
    pub fn new(problem: &Problem, hc: usize, chunk_rows: usize) -> Result<ChunkedPlan> {
        let cfg = problem.config;
        let (c, h, g) = (cfg.c, cfg.h, cfg.gate_width());
        let rows = problem.shape.rows();
        let hc = hc.clamp(1, h);
        let chunk_rows = chunk_rows.clamp(1, rows.max(1));
        let a16 = |elems: usize| -> Result<usize> { Ok(align_up(mul(&[elems, 2])?, STAGING_ALIGN)) };
        let lr_bytes = align_up(mul(&[rows, hc, 2])?, STAGING_ALIGN);
        let y_bytes = mul(&[rows, c, 4])?;
        let lr_in_y = !problem.in_place && 2 * lr_bytes <= y_bytes;
        let z = a16(chunk_rows * c)?;
        let proj_a_off = z;
        let lr_off = proj_a_off + a16(chunk_rows * 4 * hc)?;
        let phase_a = lr_off + if lr_in_y { 0 } else { 2 * lr_bytes };
        let proj_b_off = z;
        let gate_off = proj_b_off + a16(chunk_rows * g)?;
        let a_off = gate_off + a16(chunk_rows * g)?;
        let phase_b = a_off + a16(chunk_rows * h)?;
        let pass_bias_off = align_up(mul(&[4, h, c, 2])?, STAGING_ALIGN);
        Ok(ChunkedPlan {
            rows,
            c,
            h,
            g,
            af3: cfg.formulation == Formulation::Af3,
            hc,
            chunk_rows,
            lr_in_y,
            lr_bytes,
            proj_a_off,
            lr_off,
            proj_b_off,
            gate_off,
            a_off,
            scratch_bytes: phase_a.max(phase_b),
            t_bytes: mul(&[rows, h, 2])?,
            pass_w_bytes: pass_bias_off + 4 * h * 4,
            pass_bias_off,
            ones_bytes: if cfg.formulation == Formulation::Af3 { chunk_rows * 4 } else { 0 },
        })
    }

    /// The narrowest plan: [`PASS_STEP`] channels per pass, row chunks of [`CHUNK_ALIGN`].
    pub fn narrowest(problem: &Problem) -> Result<ChunkedPlan> {
        ChunkedPlan::new(problem, PASS_STEP, CHUNK_ALIGN)
    }

    /// The widest hidden pass that fits `limit` bytes, then the largest row chunk (halving from
    /// [`MAX_CHUNK_ROWS`], multiples of [`CHUNK_ALIGN`]) that still fits; `None` when even the
    /// narrowest plan does not.
    pub fn choose(problem: &Problem, limit: u64) -> Result<Option<ChunkedPlan>> {
        let rows = problem.shape.rows();
        let min_rows = rows.min(CHUNK_ALIGN);
        let need = |hc: usize| ChunkedPlan::new(problem, hc, min_rows).map_or(u64::MAX, |p| p.total_bytes());
        let Some(hc) = crate::memory::widest_hidden_chunk(problem.config.h, PASS_STEP, limit, need) else {
            return Ok(None);
        };
        let mut chunk = rows.min(MAX_CHUNK_ROWS);
        loop {
            let plan = ChunkedPlan::new(problem, hc, chunk)?;
            if plan.total_bytes() <= limit || chunk <= min_rows {
                return Ok((plan.total_bytes() <= limit).then_some(plan));
            }
            chunk = (chunk / 2 / CHUNK_ALIGN * CHUNK_ALIGN).max(min_rows);
        }
    }

    /// Device bytes: t, the scratch, the per-pass weights and af3's ones.
    pub fn total_bytes(&self) -> u64 {
        (self.t_bytes + self.scratch_bytes + self.pass_w_bytes + self.ones_bytes) as u64
    }

    /// The hidden passes: `(first channel, channels)`.
    pub fn passes(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.h).step_by(self.hc).map(|h0| (h0, self.hc.min(self.h - h0)))
    }

    /// The row chunks of both phases: `(first position, positions)`, starting 64-aligned.
    pub fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.rows).step_by(self.chunk_rows).map(|r0| (r0, self.chunk_rows.min(self.rows - r0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Config, Direction, Shape};

    fn problem(f: Formulation, b: usize, n: usize, c: usize, h: usize) -> Problem {
        Problem::new(Config::new(f, c, h).unwrap(), Shape::new(b, n), Direction::Outgoing, false).unwrap()
    }

    #[test]
    fn staging_fits_and_chunks_cover_every_row_once() {
        for (f, b, n, c, h) in [
            (Formulation::GpuMode, 1, 32, 128, 128),
            (Formulation::GpuMode, 2, 256, 128, 128),
            (Formulation::GpuMode, 1, 1024, 768, 128),
            (Formulation::GpuMode, 1, 1024, 384, 128),
            (Formulation::Af3, 1, 768, 384, 128),
            (Formulation::Af3, 1, 100, 4096, 8),
            (Formulation::GpuMode, 3, 7, 5, 3),
        ] {
            let pr = problem(f, b, n, c, h);
            let plan = Plan::new(&pr).unwrap();
            let what = format!("{f} B={b} N={n} C={c} H={h}: {plan:?}");
            assert!(plan.chunk_rows >= 1 && plan.chunk_rows <= plan.rows.max(1), "{what}");
            // z [chunk, C] then proj [chunk, P], inside the staging area, not overlapping.
            assert!(plan.proj_offset >= plan.chunk_rows * c * 2, "{what}");
            assert!(plan.proj_offset % STAGING_ALIGN == 0, "{what}");
            assert!(plan.proj_offset + plan.chunk_rows * plan.p * 2 <= plan.staging_bytes, "{what}");
            if plan.staging == Staging::InT {
                assert_eq!(plan.staging_bytes, plan.t_bytes, "{what}");
                assert!(plan.chunk_rows >= MIN_CHUNK_ROWS && plan.chunk_rows % CHUNK_ALIGN == 0, "{what}");
            }
            let mut next = 0;
            for (r0, rows) in plan.chunks() {
                assert_eq!(r0, next, "{what}");
                // Chunks start 64-aligned: the gating kernel's 16-byte tile stores rely on it.
                assert_eq!(r0 % CHUNK_ALIGN, 0, "{what}");
                assert!(rows >= 1 && rows <= plan.chunk_rows, "{what}");
                next += rows;
            }
            assert_eq!(next, plan.rows, "{what}");
            assert!(plan.fits(&pr));
            assert_eq!(plan.ones_bytes > 0, f == Formulation::Af3);
        }
    }

    #[test]
    fn large_problems_stage_inside_t_and_small_ones_separately() {
        let small = Plan::new(&problem(Formulation::GpuMode, 1, 32, 128, 128)).unwrap();
        assert_eq!((small.staging, small.chunk_rows), (Staging::Separate, 1024));
        let big = Plan::new(&problem(Formulation::GpuMode, 1, 1024, 128, 128)).unwrap();
        assert_eq!(big.staging, Staging::InT);
        // t holds M·H halves; one staged row takes C + 5H = 768 halves: M·128/768 rows.
        assert!(big.chunk_rows <= 1024 * 1024 * 128 / 768 && big.chunk_rows > 1024 * 1024 * 128 / 768 - 64);
        // C so wide that a chunk of MIN_CHUNK_ROWS does not fit in t: separate staging.
        let wide = Plan::new(&problem(Formulation::Af3, 1, 100, 4096, 8)).unwrap();
        assert_eq!((wide.staging, wide.chunk_rows), (Staging::Separate, MIN_CHUNK_ROWS));
        // Another shape does not fit; the same one does.
        assert!(!big.fits(&problem(Formulation::GpuMode, 1, 512, 128, 128)));
    }

    /// The regions of a chunked plan fit its scratch without overlapping within a phase, and its
    /// passes and row chunks cover every channel and position once.
    fn assert_chunked_consistent(p: &Problem, plan: &ChunkedPlan) {
        let what = format!("{p:?}: {plan:?}");
        let (m, c, h, g) = (p.shape.rows(), p.config.c, p.config.h, p.config.gate_width());
        let r = plan.chunk_rows;
        assert!(plan.proj_a_off >= r * c * 2 && plan.lr_off >= plan.proj_a_off + r * 4 * plan.hc * 2, "{what}");
        assert!(plan.gate_off >= plan.proj_b_off + r * g * 2 && plan.a_off >= plan.gate_off + r * g * 2, "{what}");
        assert!(plan.scratch_bytes >= plan.a_off + r * h * 2, "{what}");
        assert!(plan.lr_bytes >= m * plan.hc * 2, "{what}");
        if plan.lr_in_y {
            assert!(!p.in_place && 2 * plan.lr_bytes <= m * c * 4, "{what}");
        } else {
            assert!(plan.scratch_bytes >= plan.lr_off + 2 * plan.lr_bytes, "{what}");
        }
        assert!(plan.pass_bias_off >= 4 * h * c * 2 && plan.pass_w_bytes >= plan.pass_bias_off + 4 * h * 4, "{what}");
        let mut next = 0;
        for (h0, n) in plan.passes() {
            assert!(h0 == next && n >= 1 && n <= plan.hc, "{what}");
            next += n;
        }
        assert_eq!(next, h, "{what}");
        let mut next = 0;
        for (r0, rows) in plan.chunks() {
            assert!(r0 == next && r0 % CHUNK_ALIGN == 0 && rows >= 1 && rows <= r, "{what}");
            next += rows;
        }
        assert_eq!(next, m, "{what}");
    }

    #[test]
    fn chunked_plans_fit_their_limits_and_shrink_with_them() {
        for (f, b, n, c, h, in_place) in [
            (Formulation::GpuMode, 2, 10, 32, 24, false),
            (Formulation::Af3, 2, 10, 16, 24, true),
            (Formulation::Af3, 1, 33, 384, 128, false),
            (Formulation::GpuMode, 3, 7, 5, 3, true),
        ] {
            let p = problem(f, b, n, c, h).in_place(in_place);
            let one_pass = Plan::new(&p).unwrap().total_bytes();
            let narrowest = ChunkedPlan::narrowest(&p).unwrap();
            assert_chunked_consistent(&p, &narrowest);
            assert!(narrowest.total_bytes() < one_pass, "{p:?}");
            let mut last = u64::MAX;
            for extra in [1u64 << 40, 1 << 20, 1 << 14, 1 << 10, 0] {
                let plan = ChunkedPlan::choose(&p, narrowest.total_bytes() + extra).unwrap().expect("fits");
                assert_chunked_consistent(&p, &plan);
                assert!(plan.total_bytes() <= narrowest.total_bytes() + extra && plan.total_bytes() <= last);
                last = plan.total_bytes();
            }
            assert_eq!(ChunkedPlan::choose(&p, narrowest.total_bytes() - 1).unwrap(), None);
        }
    }

    #[test]
    fn long_sequences_fit_an_mi250_and_an_mi300x() {
        let gb = 1_000_000_000u64;
        // N = 8192, C = H = 128 in place: x/y alone take 34.4 GB; on a 64 GB MI250X GCD the
        // workspace gets what is left.
        let p = problem(Formulation::GpuMode, 1, 8192, 128, 128).in_place(true);
        let io = 8192u64 * 8192 * 128 * 4;
        let plan = ChunkedPlan::choose(&p, 64 * gb - io - gb).unwrap().expect("N = 8192 fits in place in 64 GB");
        assert_chunked_consistent(&p, &plan);
        assert!(!plan.lr_in_y && plan.hc < 128, "{plan:?}");
        // Out of place at N = 4096 in 24 GB: left/right in y, one pass.
        let p = problem(Formulation::GpuMode, 1, 4096, 128, 128);
        let io = 2 * (4096u64 * 4096 * 128 * 4);
        let plan = ChunkedPlan::choose(&p, 24 * gb - io).unwrap().expect("fits");
        assert_chunked_consistent(&p, &plan);
        assert_eq!((plan.hc, plan.lr_in_y), (128, true));
    }
}
