//! Row-sharded forwards across GPUs (issue 29): the row split, and the plan one rank of the CUDA
//! sharded forward (`backend/cuda/shard.rs`) runs: its buffers, hidden passes and exchange steps,
//! chosen to fit its memory.
//!
//! Each of `R` ranks holds rows `i ∈ [r0, r1)` of x (and receives the same rows of y): for every
//! batch, `r·N` positions (`r = r1 − r0`). Its input stage makes left and right for those
//! positions only, and it keeps only its own rows of each `N × N` matrix of left, right and t
//! (`[B, channels, r, N]`: the kernels' `mat_rows`). The contraction needs more:
//!
//! - **outgoing**, `t[b,i,j,h] = Σ_k left[b,i,k,h]·right[b,j,k,h]`: the rank's rows of t need its
//!   own rows of left and *every* rank's rows of right. Each rank broadcasts its rows of right,
//!   chunk by chunk of matrices, into the others' exchange buffers; the GEMM of the rank's own
//!   column block needs no exchange and runs first, each peer's block once its rows are in.
//! - **incoming**, `t[b,i,j,h] = Σ_k left[b,k,i,h]·right[b,k,j,h]`: the sum runs over the *first*
//!   index, the one the ranks split. Each rank forms the partial sum over its own `k` for every
//!   `(i, j)`, the owner's row block of it straight into its t and every peer's block into the
//!   exchange buffer, and each block is then summed into its owner's t (an f16 reduction: one
//!   more rounding per rank than on one GPU).
//!
//! Either way a rank holds, per hidden channel of a pass, its own rows of left and right and
//! the other ranks' rows of one matrix (`(N + r)·N` halves), and t of every channel for its own
//! rows (`H·r·N` halves: t must be whole before LN_H). The output stage needs nothing from other
//! positions: it stays local, with the gate stored by the input stage when it fits, or else
//! made again from x per row chunk (so in-place mode works per rank as on one GPU).
//! [`RankPlan::new`] picks the widest pass that fits a rank's memory; `docs/multi-gpu.md` works
//! the numbers through for N = 16384 on two 80 GB H100s.

use std::ops::Range;

use super::budget::widest_hidden_chunk;
use crate::error::{Error, Result};
use crate::problem::Problem;

/// The rows of the first pair index `i` each of `ranks` ranks holds: as even as possible, the
/// first `n % ranks` ranks one row more.
pub fn row_split(n: usize, ranks: usize) -> Result<Vec<Range<usize>>> {
    if ranks == 0 || ranks > n.max(1) {
        return Err(Error::Shape(format!("{ranks} ranks cannot split N = {n} rows (each needs at least one)")));
    }
    let (base, extra) = (n / ranks, n % ranks);
    let mut r0 = 0;
    Ok((0..ranks)
        .map(|r| {
            let rows = base + usize::from(r < extra);
            let range = r0..r0 + rows;
            r0 += rows;
            range
        })
        .collect())
}

/// Matrices per exchange step of the sharded forward's pipeline (by default): the steps'
/// exchanges run on the communication stream under GEMMs on the compute stream (outgoing:
/// under the GEMMs of the rank's own column block; incoming: one step's sums under the next
/// step's GEMMs).
pub const CHUNK_MATRICES: usize = 8;

/// Positions per output-stage chunk (at most) when the gate is made again from x.
pub const OUTPUT_ROWS: usize = 1 << 20;

/// What a caller may fix in a rank's plan instead of leaving it to the memory it has (every
/// rank must be given the same).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ShardOptions {
    /// Matrices per exchange step ([`CHUNK_MATRICES`] by default).
    pub chunk_matrices: usize,
    /// Hidden channels per pass (`None`: the widest that fits).
    pub hidden_pass: Option<usize>,
    /// `Some(rows)`: the output stage per chunk of `rows` positions with the gate made again
    /// from x, even where the stored gate would fit (`None`: stored when it fits).
    pub output_rows: Option<usize>,
    /// Bytes a rank may hold on its GPU in all: its rows of x, the mask and y, the prepared
    /// weights, the workspace and room for NCCL (`None`: what the GPU has free, less a margin).
    /// The plan then fits both.
    pub memory_limit: Option<u64>,
}

impl Default for ShardOptions {
    fn default() -> Self {
        ShardOptions { chunk_matrices: CHUNK_MATRICES, hidden_pass: None, output_rows: None, memory_limit: None }
    }
}

/// One exchange step of a pass: batch `b`'s channels `channels` (relative to the pass's first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// The batch.
    pub b: usize,
    /// The step's channels, counted from the pass's first.
    pub channels: Range<usize>,
}

/// The plan of one rank of a sharded forward: the global problem, the rows of every rank, the
/// hidden passes and how the output stage gets its gate. Element counts are of f16 buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankPlan {
    /// Every rank's rows of the first pair index ([`row_split`]).
    pub split: Vec<Range<usize>>,
    /// This rank.
    pub rank: usize,
    /// B of the global problem.
    pub b: usize,
    /// N of the global problem.
    pub n: usize,
    /// H of the global problem.
    pub h: usize,
    /// The output gate's width G (H for gpumode, C for af3).
    pub g: usize,
    /// Hidden channels per pass (the last pass may have fewer).
    pub pass: usize,
    /// Matrices per exchange step.
    pub chunk: usize,
    /// `None`: the gate of every own position, stored by the last pass's input stage;
    /// `Some(rows)`: the output stage per chunk of at most `rows` positions, each with its gate
    /// made again from x first.
    pub output_rows: Option<usize>,
}

impl RankPlan {
    /// The plan for rank `rank` of `ranks` of `problem` (the global problem: every row), whose
    /// buffers must fit `budget` bytes: the stored gate and one pass if they fit, else the gate
    /// made again per row chunk and the widest pass that fits. The choice is made for the rank
    /// with the most rows (rank 0), so that ranks given the same budget plan the same passes
    /// and steps (their exchanges pair up call by call).
    pub fn new(problem: &Problem, ranks: usize, rank: usize, options: ShardOptions, budget: u64) -> Result<RankPlan> {
        let split = row_split(problem.shape.n, ranks)?;
        if rank >= ranks {
            return Err(Error::InvalidArgument(format!("rank {rank} of a communicator of {ranks} ranks")));
        }
        let (n, h) = (problem.shape.n, problem.config.h);
        // The kernels store and load left, right and t 16 bytes (8 halves) at a time where N²
        // is a multiple of 8; a rank's matrices then must start and end on such a boundary too.
        if (n * n) % 8 == 0 {
            if let Some(r) = split.iter().find(|r| (r.start * n) % 8 != 0 || (r.len() * n) % 8 != 0) {
                return Err(Error::Shape(format!(
                    "N = {n} over {ranks} ranks gives a rank rows {r:?}, whose {} elements of each N × N matrix are \
                     not a multiple of 8 (the kernels' 16-byte accesses): use N a multiple of 8, or 2 ranks",
                    r.len() * n
                )));
            }
        }
        let plan = |pass: usize, output_rows: Option<usize>| RankPlan {
            split: split.clone(),
            rank,
            b: problem.shape.batch,
            n: problem.shape.n,
            h,
            g: problem.config.gate_width(),
            pass,
            chunk: options.chunk_matrices.max(1),
            output_rows,
        };
        if let Some(pass) = options.hidden_pass {
            if pass == 0 || pass > h {
                return Err(Error::InvalidArgument(format!("hidden passes of {pass} channels for H = {h}")));
            }
        }
        // Rank 0 holds the most rows, and a plan's bytes grow with the rows.
        let worst = |pass: usize, output_rows: Option<usize>| RankPlan { rank: 0, ..plan(pass, output_rows) }.bytes();
        if let Some(0) = options.output_rows {
            return Err(Error::InvalidArgument("output chunks of 0 positions".into()));
        }
        let chunked = options.output_rows.unwrap_or(OUTPUT_ROWS);
        let candidates = match (options.hidden_pass, options.output_rows) {
            (Some(p), o) => vec![plan(p, o), plan(p, Some(chunked))],
            (None, Some(rows)) => {
                let need = |hc| worst(hc, Some(rows));
                widest_hidden_chunk(h, 1, budget, need).map(|hc| plan(hc, Some(rows))).into_iter().collect()
            }
            (None, None) => {
                let need = |hc| worst(hc, Some(chunked));
                let narrow = widest_hidden_chunk(h, 1, budget, need).map(|hc| plan(hc, Some(chunked)));
                std::iter::once(plan(h, None)).chain(narrow).collect()
            }
        };
        let narrowest = plan(options.hidden_pass.unwrap_or(1), Some(chunked));
        candidates.into_iter().find(|p| worst(p.pass, p.output_rows) <= budget).ok_or_else(|| Error::OutOfMemory {
            backend: crate::error::BackendKind::Cuda,
            what: format!(
                "rank {rank}'s sharded forward (its rows of t for all {h} channels, and per pass of {} channels its \
                 rows of left and right and the other ranks' rows of one matrix)",
                narrowest.pass
            ),
            needed: worst(narrowest.pass, narrowest.output_rows),
            available: budget,
        })
    }

    /// The bytes of a per-rank memory `limit` left for a plan once the rank's rows of x, the
    /// mask and y and `held` more bytes (prepared weights, the libraries' workspaces) are
    /// counted; the rows of the rank with the most (rank 0), so that every rank given the same
    /// limit gets the same budget.
    pub fn budget_within(problem: &Problem, ranks: usize, limit: u64, held: u64) -> Result<u64> {
        let rows = row_split(problem.shape.n, ranks)?[0].len();
        let own = (problem.shape.batch * rows * problem.shape.n) as u64;
        let x = own * (problem.config.c * problem.io.io_bytes()) as u64;
        let io = x * if problem.in_place { 1 } else { 2 } + if problem.masked { own * 4 } else { 0 };
        limit.checked_sub(io + held).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a memory limit of {} per GPU is below what a rank holds before any workspace: its rows of x, the \
                 mask and y ({}) and {} of weights and library workspaces",
                crate::units::fmt_bytes(limit),
                crate::units::fmt_bytes(io),
                crate::units::fmt_bytes(held)
            ))
        })
    }

    /// This rank's rows of the first pair index.
    pub fn rows(&self) -> Range<usize> {
        self.split[self.rank].clone()
    }

    /// The hidden passes: channel ranges of at most [`RankPlan::pass`] channels, in order.
    pub fn passes(&self) -> Vec<Range<usize>> {
        (0..self.h).step_by(self.pass.max(1)).map(|h0| h0..(h0 + self.pass).min(self.h)).collect()
    }

    /// The exchange steps of a pass of `channels` channels: per batch, runs of at most
    /// [`RankPlan::chunk`] channels (a step's matrices are contiguous in every buffer).
    pub fn steps(&self, channels: usize) -> Vec<Step> {
        (0..self.b)
            .flat_map(|b| {
                (0..channels)
                    .step_by(self.chunk.max(1))
                    .map(move |c0| Step { b, channels: c0..(c0 + self.chunk).min(channels) })
            })
            .collect()
    }

    /// Halves of left (and of right) for one pass: `[B, pass, r, N]`, the rank's rows.
    pub fn pair_len(&self) -> usize {
        self.b * self.pass * self.rows().len() * self.n
    }

    /// Halves of the exchange buffer: for every other rank `p`, `[B, pass, r_p, N]` (outgoing:
    /// its rows of right; incoming: this rank's partial sums of its rows of t), in rank order.
    pub fn exchange_len(&self) -> usize {
        self.b * self.pass * (self.n - self.rows().len()) * self.n
    }

    /// Where rank `peer`'s region starts in the exchange buffer (halves).
    pub fn exchange_offset(&self, peer: usize) -> usize {
        let before: usize = (0..peer).filter(|&q| q != self.rank).map(|q| self.split[q].len()).sum();
        self.b * self.pass * before * self.n
    }

    /// Halves of t: `[B, H, r, N]`, the rank's rows of every channel.
    pub fn t_len(&self) -> usize {
        self.b * self.h * self.rows().len() * self.n
    }

    /// Halves of the gate buffer: every own position's (`[B·r·N, G]`), or one output chunk's.
    pub fn gate_len(&self) -> usize {
        let own = self.b * self.rows().len() * self.n;
        self.output_rows.map_or(own, |rows| rows.min(own)) * self.g
    }

    /// Bytes of every buffer the plan holds (all f16).
    pub fn bytes(&self) -> u64 {
        2 * (2 * self.pair_len() + self.exchange_len() + self.t_len() + self.gate_len()) as u64
    }

    /// The output stage's chunks of one batch's own positions, `(first, count)` relative to the
    /// batch's first own position: one chunk with the stored gate.
    pub fn output_chunks(&self) -> Vec<(usize, usize)> {
        let own = self.rows().len() * self.n;
        let rows = self.output_rows.unwrap_or(own).max(1);
        (0..own).step_by(rows).map(|r| (r, rows.min(own - r))).collect()
    }

    /// `one pass, gate stored` or `9 passes of 15 channels, output per 1048576 positions with
    /// the gate made again`.
    pub fn describe(&self) -> String {
        let passes = self.passes().len();
        let passes =
            if passes == 1 { "one pass".to_string() } else { format!("{passes} passes of {} channels", self.pass) };
        match self.output_rows {
            None => format!("{passes}, gate stored"),
            Some(rows) => format!("{passes}, output per {rows} positions with the gate made again"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Config, Direction, Formulation, Precision, Shape};

    const GIB: u64 = 1 << 30;

    fn af3(n: usize, direction: Direction) -> Problem {
        let cfg = Config::new(Formulation::Af3, 128, 128).unwrap();
        Problem::new(cfg, Shape::new(1, n), direction, true).unwrap().with_io(Precision::Bf16Io).in_place(true)
    }

    #[test]
    fn rows_split_as_evenly_as_possible() {
        assert_eq!(row_split(10, 3).unwrap(), vec![0..4, 4..7, 7..10]);
        assert_eq!(row_split(16384, 2).unwrap(), vec![0..8192, 8192..16384]);
        assert_eq!(row_split(5, 5).unwrap(), vec![0..1, 1..2, 2..3, 3..4, 4..5]);
        assert!(row_split(4, 5).is_err() && row_split(4, 0).is_err());
    }

    /// Passes, steps, the exchange regions and output chunks cover everything once.
    #[test]
    fn passes_steps_and_regions_cover_everything_once() {
        let cfg = Config::new(Formulation::GpuMode, 64, 20).unwrap();
        let p = Problem::new(cfg, Shape::new(2, 10), Direction::Outgoing, false).unwrap();
        let opts = ShardOptions { chunk_matrices: 3, hidden_pass: Some(8), output_rows: Some(16), memory_limit: None };
        let plan = RankPlan::new(&p, 3, 1, opts, u64::MAX).unwrap();
        assert_eq!(plan.rows(), 4..7);
        assert_eq!(plan.passes(), vec![0..8, 8..16, 16..20]);
        let steps = plan.steps(8);
        assert_eq!(steps.len(), 6);
        assert_eq!(steps[2], Step { b: 0, channels: 6..8 });
        assert_eq!(steps[3], Step { b: 1, channels: 0..3 });
        // Left/right [2, 8, 3, 10]; peers 0 (4 rows) and 2 (3 rows) one after the other.
        assert_eq!(plan.pair_len(), 2 * 8 * 3 * 10);
        assert_eq!(plan.exchange_len(), 2 * 8 * 7 * 10);
        assert_eq!(plan.exchange_offset(0), 0);
        assert_eq!(plan.exchange_offset(2), 2 * 8 * 4 * 10);
        assert_eq!(plan.t_len(), 2 * 20 * 3 * 10);
        assert_eq!(plan.gate_len(), 16 * 20);
        assert_eq!(plan.output_chunks(), vec![(0, 16), (16, 14)]);
        // The stored gate: every own position's, one output chunk per batch.
        let stored = RankPlan::new(&p, 3, 1, ShardOptions::default(), u64::MAX).unwrap();
        assert_eq!((stored.pass, stored.output_rows, stored.gate_len()), (20, None, 2 * 30 * 20));
        assert_eq!(stored.output_chunks(), vec![(0, 30)]);
        assert_eq!(stored.describe(), "one pass, gate stored");
        assert!(RankPlan::new(&p, 3, 3, opts, u64::MAX).is_err());
        assert!(RankPlan::new(&p, 3, 0, ShardOptions { hidden_pass: Some(0), ..opts }, u64::MAX).is_err());
        assert!(RankPlan::new(&p, 3, 0, ShardOptions { output_rows: Some(0), ..opts }, u64::MAX).is_err());
    }

    /// Memory decides: the stored gate and one pass when they fit, then the gate made again,
    /// then narrower passes; an error naming the bytes when not even the narrowest fits.
    #[test]
    fn the_widest_plan_that_fits_is_chosen() {
        let p = af3(4096, Direction::Incoming);
        let pick = |budget| RankPlan::new(&p, 2, 0, ShardOptions::default(), budget);
        let one = pick(u64::MAX).unwrap();
        // t 2 GiB, left and right 2 GiB each, the peer's rows 2 GiB, the gate 2 GiB.
        assert_eq!(one.bytes(), 10 * GIB);
        assert_eq!(pick(10 * GIB).unwrap(), one);
        let regate = pick(10 * GIB - 1).unwrap();
        assert_eq!((regate.pass, regate.output_rows), (128, Some(OUTPUT_ROWS)));
        let narrow = pick(5 * GIB).unwrap();
        // t 2 GiB and the gate chunk 256 MiB leave 2.75 GiB: 58 channels of 48 MiB, balanced
        // into three passes of 43 (the last 42).
        assert_eq!((narrow.pass, narrow.passes().len()), (43, 3), "{narrow:?}");
        assert!(narrow.bytes() <= 5 * GIB);
        let err = pick(2 * GIB).unwrap_err().to_string();
        assert!(err.contains("rank 0") && err.contains("of 1 channels"), "{err}");
        // Rank rows whose matrices would break the kernels' 16-byte accesses are refused.
        let cfg = Config::new(Formulation::Af3, 128, 128).unwrap();
        let p100 = Problem::new(cfg, Shape::new(1, 100), Direction::Outgoing, false).unwrap();
        let err = RankPlan::new(&p100, 3, 0, ShardOptions::default(), u64::MAX).unwrap_err().to_string();
        assert!(err.contains("not a multiple of 8"), "{err}");
        assert!(RankPlan::new(&p100, 2, 1, ShardOptions::default(), u64::MAX).is_ok());
        let p97 = Problem::new(cfg, Shape::new(1, 97), Direction::Outgoing, false).unwrap();
        assert!(RankPlan::new(&p97, 3, 2, ShardOptions::default(), u64::MAX).is_ok());
    }

    /// Ranks with uneven rows plan alike (rank 0's rows decide), and a memory limit leaves the
    /// same budget to every rank, or an error naming what it does not cover.
    #[test]
    fn uneven_ranks_plan_alike_and_limits_count_the_rows() {
        let p = af3(4097, Direction::Outgoing);
        let budget = 5 * GIB;
        let plans: Vec<RankPlan> =
            (0..2).map(|r| RankPlan::new(&p, 2, r, ShardOptions::default(), budget).unwrap()).collect();
        assert_eq!(plans[0].rows().len(), plans[1].rows().len() + 1);
        assert_eq!((plans[0].pass, plans[0].output_rows), (plans[1].pass, plans[1].output_rows));
        assert!(plans[0].bytes() <= budget && plans[1].bytes() < plans[0].bytes());
        // In place, bf16: x 2049·4097·128·2 bytes and the f32 mask 2049·4097·4.
        let own = 2049 * 4097u64;
        let held = 1 << 20;
        assert_eq!(RankPlan::budget_within(&p, 2, 10 * GIB, held).unwrap(), 10 * GIB - own * 256 - own * 4 - held);
        let err = RankPlan::budget_within(&p, 2, GIB, held).unwrap_err().to_string();
        assert!(err.contains("below what a rank holds"), "{err}");
    }

    /// The case: N = 16384, af3 bf16 in place, two 80 GB H100s (79.2 GiB each as the
    /// driver reports it, less the 2% margin). x (= y) is 32 GiB a rank and the f32 mask 0.5
    /// GiB; t another 32 GiB; each channel of a pass 768 MiB (its rows of left and right, the
    /// peer's rows of one matrix), in either direction.
    #[test]
    fn n16384_fits_two_h100s_in_passes_of_15_channels() {
        let device = (79.2 * GIB as f64) as u64;
        let io = 32 * GIB + GIB / 2;
        let reserve = GIB; // cuBLASLt's workspace, NCCL's buffers
        let budget = device - super::super::budget::margin(device) - io - reserve;
        for dir in [Direction::Outgoing, Direction::Incoming] {
            let plan = RankPlan::new(&af3(16384, dir), 2, 1, ShardOptions::default(), budget).unwrap();
            assert_eq!(plan.t_len() as u64 * 2, 32 * GIB);
            assert_eq!((2 * plan.pair_len() + plan.exchange_len()) as u64 * 2, plan.pass as u64 * (768 << 20));
            // 11.9 GiB left after t and a gate chunk: 15 channels, 9 passes (the last of 8).
            assert_eq!((plan.pass, plan.passes().len(), plan.output_rows), (15, 9, Some(OUTPUT_ROWS)), "{plan:?}");
        }
        // One GPU cannot hold it: x and t alone take 128 GiB.
        let one = RankPlan::new(&af3(16384, Direction::Outgoing), 1, 0, ShardOptions::default(), u64::MAX).unwrap();
        assert!(one.t_len() as u64 * 2 + 64 * GIB > device);
    }
}
