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

use crate::backend::staged_plan::{align_up, mul};
pub use crate::backend::staged_plan::{CHUNK_ALIGN, STAGING_ALIGN};
use crate::error::Result;
use crate::problem::{Formulation, Problem};

/// Fewest positions per projection chunk when chunking (GEMM efficiency drops below this).
pub const MIN_CHUNK_ROWS: usize = 4096;

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
}

#[cfg(test)]
mod equivalence {
    use super::*;
    use crate::plan::{Blas, Buffer, Capabilities, InputStage, Plan as NewPlan};
    use crate::problem::{Config, Direction, Shape};

    #[test]
    fn new_plan_matches_the_old_hip_plan() {
        let caps = Capabilities { input: InputStage::Staged, blas: Blas::RocBlas };
        for (f, b, n, c, h) in [
            (Formulation::GpuMode, 1, 32, 128, 128),
            (Formulation::GpuMode, 2, 256, 128, 128),
            (Formulation::GpuMode, 1, 1024, 768, 128),
            (Formulation::GpuMode, 1, 1024, 384, 128),
            (Formulation::Af3, 1, 768, 384, 128),
            (Formulation::Af3, 1, 100, 4096, 8),
            (Formulation::GpuMode, 3, 7, 5, 3),
        ] {
            let p = Problem::new(Config::new(f, c, h).unwrap(), Shape::new(b, n), Direction::Outgoing, false).unwrap();
            let old = Plan::new(&p).unwrap();
            let new = NewPlan::one_pass(&p, caps, false).unwrap();
            assert_eq!(new.input_rows, old.chunk_rows);
            assert_eq!(new.proj.unwrap().offset, old.proj_offset);
            assert_eq!(new.z.unwrap().buffer == Buffer::T, old.staging == Staging::InT);
            if old.staging == Staging::Separate {
                assert_eq!(new.staging_bytes, old.staging_bytes);
            }
            assert_eq!((new.left_bytes, new.gate_bytes, new.t_bytes, new.ones_bytes), (old.left_bytes, old.gate_bytes, old.t_bytes, old.ones_bytes));
            assert_eq!(new.workspace_bytes(), old.total_bytes());
        }
    }
}
