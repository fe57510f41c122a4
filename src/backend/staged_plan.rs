//! The chunked plan of the staged pipeline (the portable stage kernels `input_norm` and
//! `input_gating` around a vendor BLAS projection, as the HIP backend and the CUDA backend's
//! cuBLASLt path run it): hidden passes and row chunks that keep a forward within a memory limit.
//! Pure arithmetic, shared by both backends and tested here. Why chunking is exact, and the
//! in-place rules, are in [`crate::memory`].

#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use crate::problem::{Formulation, Problem};

/// Chunks are multiples of this many positions: chunk starts stay 64-aligned, which the stage
/// kernels' 16-byte vector accesses along positions rely on.
pub const CHUNK_ALIGN: usize = 64;
/// Alignment of every staging region.
pub const STAGING_ALIGN: usize = 256;

pub(crate) fn align_up(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

/// The product of `parts`, or a shape error when it overflows.
pub(crate) fn mul(parts: &[usize]) -> Result<usize> {
    parts
        .iter()
        .try_fold(1usize, |acc, &v| acc.checked_mul(v))
        .ok_or_else(|| Error::Shape(format!("workspace size {parts:?} overflows usize")))
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
        Self::choose_by(problem, limit, ChunkedPlan::total_bytes)
    }

    /// [`ChunkedPlan::choose`] with a backend's own count of a plan's bytes (what it allocates
    /// besides, or does not need, of [`ChunkedPlan::total_bytes`]).
    pub fn choose_by(
        problem: &Problem,
        limit: u64,
        bytes: impl Fn(&ChunkedPlan) -> u64,
    ) -> Result<Option<ChunkedPlan>> {
        let rows = problem.shape.rows();
        let min_rows = rows.min(CHUNK_ALIGN);
        let need = |hc: usize| ChunkedPlan::new(problem, hc, min_rows).map_or(u64::MAX, |p| bytes(&p));
        let Some(hc) = crate::memory::widest_hidden_chunk(problem.config.h, PASS_STEP, limit, need) else {
            return Ok(None);
        };
        let mut chunk = rows.min(MAX_CHUNK_ROWS);
        loop {
            let plan = ChunkedPlan::new(problem, hc, chunk)?;
            if bytes(&plan) <= limit || chunk <= min_rows {
                return Ok((bytes(&plan) <= limit).then_some(plan));
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

    /// The one-pass workspace of the staged pipeline: left, right, gate and t (staging aside).
    fn one_pass_bytes(p: &Problem) -> u64 {
        let (m, h, g) = (p.shape.rows() as u64, p.config.h as u64, p.config.gate_width() as u64);
        2 * m * (3 * h + g)
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
            let narrowest = ChunkedPlan::narrowest(&p).unwrap();
            assert_chunked_consistent(&p, &narrowest);
            if p.shape.rows() >= 1024 {
                // Below that, the per-pass weights and 256-byte alignment can outweigh the saving.
                assert!(narrowest.total_bytes() < one_pass_bytes(&p), "{p:?}");
            }
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
