//! Row-sharded forwards across GPUs (issue 29): the row split, the exchange's row blocks and
//! chunks the CUDA sharded forward runs (`backend/cuda/shard.rs`), and the memory arithmetic of
//! the design for long N (compact row buffers and hidden passes, not built yet).
//!
//! What runs today: outgoing gathers right by in-place broadcasts of each rank's row blocks;
//! incoming sums each rank's partial t to the owner of each row block (an f16 reduction), the
//! [`IncomingExchange::ReduceScatter`] way with 16-bit partials. The ring and the gather below
//! are design.
//!
//! Each of `R` ranks holds rows `i ∈ [r0, r1)` of x (and receives the same rows of y): for every
//! batch, `(r1 − r0)·N` positions. Its input stage makes left and right for those positions only.
//! The contraction needs more than a rank's own rows:
//!
//! - **outgoing**, `t[b,i,j,h] = Σ_k left[b,i,k,h]·right[b,j,k,h]`: the rank's rows of t need its
//!   own rows of left and *every* rank's rows of right. Per hidden pass of `hc` channels the
//!   rank gathers the others' right (`B·N·N·hc` halves in all, its own rows among them) and
//!   computes t's column block of each peer as that peer's rows arrive (a ring overlaps the
//!   transfer of one block with the GEMM of another).
//! - **incoming**, `t[b,i,j,h] = Σ_k left[b,k,i,h]·right[b,k,j,h]`: the sum runs over the *first*
//!   index, the one the ranks split. A rank can form the partial sum over its own `k` for every
//!   `(i, j)` and the ranks then reduce-scatter those partials by rows of `i`
//!   ([`IncomingExchange::ReduceScatter`]); or it gathers every rank's right and the column
//!   block `left[k, i ∈ own]` of every peer, and sums locally ([`IncomingExchange::Gather`]).
//!
//! The output stage needs all H channels of t at a position and nothing from other positions:
//! it stays local, over row chunks, with the gate recomputed from x (so in-place mode works per
//! rank as on one GPU).
//!
//! What a rank holds ([`RankMemory`]): its rows of x, mask and y (x alone in place); its rows of
//! t for every hidden channel (t must be complete before LN_H); and per hidden pass, per channel,
//! its own left and right rows and the exchanged operand. The widest pass that fits a rank's
//! budget is [`RankMemory::widest_pass`]. `docs/multi-gpu.md` works the numbers through for
//! N = 16384 on two 80 GB H100s.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::problem::{Direction, Problem};

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

/// Each rank's rows as element offsets within one `N × N` matrix of the `[B, H, N, N]`
/// intermediates: rows `[r0, r1)` are the contiguous halves `[r0·N, r1·N)`, the unit every
/// exchange moves.
pub fn matrix_blocks(split: &[Range<usize>], n: usize) -> Vec<Range<usize>> {
    split.iter().map(|r| r.start * n..r.end * n).collect()
}

/// Matrices of the `[B, H, N, N]` intermediates per step of the sharded forward's pipeline (by
/// default): the chunks' exchanges run on the communication stream under GEMMs on the compute
/// stream (outgoing: under the GEMMs against the rank's own rows; incoming: one chunk's sums
/// under the next chunk's GEMM).
pub const CHUNK_MATRICES: usize = 8;

/// The pipeline's chunks of the `matrices = B·H` matrices, `per_chunk` each (the last one
/// fewer), in order.
pub fn matrix_chunks(matrices: usize, per_chunk: usize) -> Vec<Range<usize>> {
    let per_chunk = per_chunk.max(1);
    (0..matrices).step_by(per_chunk).map(|m0| m0..(m0 + per_chunk).min(matrices)).collect()
}

/// What one rank of today's sharded forward (`backend::cuda`, one pass, every buffer of the
/// contraction full size) holds besides the caller's x, mask and y, in bytes: left, right and
/// t as `[B, H, N, N]` f16 each (the gathered operand and the partial sums need every row; the
/// rank's own rows alone are a third of that), and the output gate of its own positions.
/// Narrower hidden passes over compact row buffers ([`RankMemory`]) are what N = 16384 needs.
pub fn full_buffers_bytes(problem: &Problem, rows: &Range<usize>) -> u64 {
    let (b, n) = (problem.shape.batch as u64, problem.shape.n as u64);
    let matrices = b * problem.config.h as u64 * n * n;
    let gate = b * rows.len() as u64 * n * problem.config.gate_width() as u64;
    (3 * matrices + gate) * 2
}

/// How the incoming direction exchanges its operands (see the module docs).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum IncomingExchange {
    /// Partial t over the rank's own `k` for every `(i, j)` of a pass, reduce-scattered by rows;
    /// the partials in f32 (`4` bytes) or 16 bits (`2`: one more rounding per rank).
    ReduceScatter {
        /// Bytes per element of the partial sums.
        partial_bytes: usize,
    },
    /// Every rank's right and every peer's column block of left gathered, summed locally.
    Gather,
}

/// What one rank holds for a sharded forward (bytes).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RankMemory {
    /// Its rows of x, the mask (f32) and y (x alone in place).
    pub io: u64,
    /// Its rows of t, every hidden channel, f16.
    pub t: u64,
    /// Per hidden channel of one pass: its left and right rows (f16) and the exchanged operand.
    pub per_channel: u64,
    /// Bytes moved into this rank per hidden channel (what the link carries for it).
    pub received_per_channel: u64,
}

impl RankMemory {
    /// What the rank holding `rows` of `problem` (the global problem: its N, C, H, I/O
    /// precision, direction and in-place flag) holds among `ranks` ranks.
    pub fn of(problem: &Problem, rows: Range<usize>, ranks: usize, incoming: IncomingExchange) -> RankMemory {
        let (b, n) = (problem.shape.batch as u64, problem.shape.n as u64);
        let (c, h) = (problem.config.c as u64, problem.config.h as u64);
        let r = (rows.end - rows.start) as u64;
        let own = b * r * n; // positions this rank holds
        let all = b * n * n;
        let io_elem = problem.io.io_bytes() as u64;
        let mask = if problem.masked { own * 4 } else { 0 };
        let io = own * c * io_elem * if problem.in_place { 1 } else { 2 } + mask;
        let t = own * h * 2;
        let lr = 2 * own * 2; // its left and right rows, f16
        let peers = ranks.saturating_sub(1) as u64;
        let (per_channel, received_per_channel) = match problem.direction {
            // Its left rows, and right for every row (its own among them).
            Direction::Outgoing => (own * 2 + all * 2, (all - own) * 2),
            Direction::Incoming => match incoming {
                IncomingExchange::ReduceScatter { partial_bytes } => {
                    let pb = partial_bytes as u64;
                    // Partials of every (i, j): the peers' rows of them leave, its own arrive
                    // from each peer.
                    (lr + all * pb, peers * own * pb)
                }
                IncomingExchange::Gather => {
                    // Right for every row, and left's column block of its own i from each peer.
                    let left_cols = peers * b * r * r * 2;
                    (lr + (all - own) * 2 + left_cols, (all - own) * 2 + left_cols)
                }
            },
        };
        RankMemory { io, t, per_channel, received_per_channel }
    }

    /// Bytes besides the pass buffers: x/mask/y, t, the prepared weights and a fixed reserve
    /// (output-stage scratch, communicator buffers).
    pub fn fixed(&self, weights: u64, reserve: u64) -> u64 {
        self.io.saturating_add(self.t).saturating_add(weights).saturating_add(reserve)
    }

    /// The widest hidden pass (channels, a multiple of `step` unless H is smaller) whose buffers
    /// fit `budget` after [`RankMemory::fixed`]; `None` when not even `step` channels do.
    pub fn widest_pass(&self, h: usize, step: usize, budget: u64, weights: u64, reserve: u64) -> Option<usize> {
        let left = budget.checked_sub(self.fixed(weights, reserve))?;
        super::budget::widest_hidden_chunk(h, step, left, |hc| (hc as u64).saturating_mul(self.per_channel))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Config, Formulation, Precision, Shape};

    const GIB: u64 = 1 << 30;

    fn af3(n: usize, direction: Direction) -> Problem {
        let cfg = Config::new(Formulation::Af3, 128, 128).unwrap();
        Problem::new(cfg, Shape::new(1, n), direction, true).unwrap().with_io(Precision::Bf16Io).in_place(true)
    }

    #[test]
    fn blocks_and_chunks_cover_everything_once() {
        let split = row_split(10, 3).unwrap();
        assert_eq!(matrix_blocks(&split, 10), vec![0..40, 40..70, 70..100]);
        assert_eq!(matrix_chunks(20, 8), vec![0..8, 8..16, 16..20]);
        assert_eq!(matrix_chunks(8, 8), vec![0..8]);
        assert_eq!(matrix_chunks(2, 0), vec![0..1, 1..2]);
        let cfg = Config::new(Formulation::Af3, 128, 128).unwrap();
        let p = Problem::new(cfg, Shape::new(1, 4096), Direction::Outgoing, false).unwrap();
        // left, right, t: 4 GiB each; the gate of 2048 rows: 2 GiB.
        assert_eq!(full_buffers_bytes(&p, &(0..2048)), 14 * GIB);
    }

    #[test]
    fn rows_split_as_evenly_as_possible() {
        assert_eq!(row_split(10, 3).unwrap(), vec![0..4, 4..7, 7..10]);
        assert_eq!(row_split(16384, 2).unwrap(), vec![0..8192, 8192..16384]);
        assert_eq!(row_split(5, 5).unwrap(), vec![0..1, 1..2, 2..3, 3..4, 4..5]);
        assert!(row_split(4, 5).is_err() && row_split(4, 0).is_err());
    }

    /// The case: N = 16384, af3 bf16 in place, two 80 GB H100s (79.2 GiB each as the
    /// driver reports it, less the 2% margin). x (= y) is 32 GiB a rank, t another 32 GiB; what
    /// is left takes hidden passes of 16 channels outgoing.
    #[test]
    fn n16384_fits_two_h100s_in_passes_of_16_channels() {
        let budget = (79.2 * GIB as f64) as u64;
        let budget = budget - budget / 50;
        let p = af3(16384, Direction::Outgoing);
        let rows = row_split(16384, 2).unwrap();
        let m = RankMemory::of(&p, rows[0].clone(), 2, IncomingExchange::Gather);
        assert_eq!(m.io, 32 * GIB + GIB / 2); // x in place, and the f32 mask
        assert_eq!(m.t, 32 * GIB);
        // Per channel: its left rows (256 MiB) and right for all rows (512 MiB).
        assert_eq!(m.per_channel, 768 << 20);
        assert_eq!(m.received_per_channel, 256 << 20);
        let reserve = GIB; // output-stage scratch, cuBLASLt, NCCL buffers
        assert_eq!(m.widest_pass(128, 8, budget, 1 << 20, reserve), Some(16));
        // Incoming, reduce-scattering f32 partials: 1.5 GiB a channel, 8 channels a pass.
        let p = af3(16384, Direction::Incoming);
        let rs = RankMemory::of(&p, rows[0].clone(), 2, IncomingExchange::ReduceScatter { partial_bytes: 4 });
        assert_eq!(rs.per_channel, (512 << 20) + GIB);
        assert_eq!(rs.widest_pass(128, 8, budget, 1 << 20, reserve), Some(8));
        // Gathering instead: right (256 MiB) and the peer's column block of left (128 MiB) arrive,
        // 896 MiB a channel with its own rows: passes of 8 channels too, 3/4 of the traffic.
        let g = RankMemory::of(&p, rows[0].clone(), 2, IncomingExchange::Gather);
        assert_eq!(g.per_channel, (896 << 20));
        assert_eq!(g.received_per_channel, (256 << 20) + (128 << 20));
        assert_eq!(rs.received_per_channel, 512 << 20);
        assert_eq!(g.widest_pass(128, 8, budget, 1 << 20, reserve), Some(8));
        // One GPU cannot hold it: x and t alone take 128 GiB.
        let one = RankMemory::of(&af3(16384, Direction::Outgoing), 0..16384, 1, IncomingExchange::Gather);
        assert!(one.fixed(0, 0) > budget);
    }

    #[test]
    fn uneven_splits_and_out_of_place_count_their_own_rows() {
        let cfg = Config::new(Formulation::GpuMode, 64, 32).unwrap();
        let p = Problem::new(cfg, Shape::new(2, 10), Direction::Outgoing, false).unwrap();
        let rows = row_split(10, 3).unwrap();
        let m = RankMemory::of(&p, rows[0].clone(), 3, IncomingExchange::Gather);
        let own = 2 * 4 * 10;
        assert_eq!(m.io, own * 64 * 4 * 2);
        assert_eq!(m.t, own * 32 * 2);
        assert_eq!(m.per_channel, own * 2 + 2 * 100 * 2);
        assert_eq!(m.received_per_channel, (200 - own) * 2);
        assert_eq!(m.widest_pass(32, 8, m.fixed(0, 0) + 8 * m.per_channel, 0, 0), Some(8));
        assert_eq!(m.widest_pass(32, 8, m.fixed(0, 0) + 7 * m.per_channel, 0, 0), None);
    }
}
