//! The three GEMMs of a forward, written once as column-major BLAS calls (the convention of
//! cuBLASLt and rocBLAS), so the CUDA and HIP backends issue identical calls and the layout math
//! is tested here, on the host, against the formulas of SPEC.md.
//!
//! Row-major `X[r, c]` seen by a column-major library is `Xᵀ`. Every product below is therefore
//! computed transposed: a row-major `D = U·V` is the column-major `Dᵀ = Vᵀ·Uᵀ`.
//!
//! - projection (one chunk of `rows` positions): `P[rows, Pw] = z[rows, C]·Wᵀ` with the fused
//!   weights `W[Pw, C]`: column-major `Pᵀ = W·zᵀ`, i.e. A = W (transposed), B = z, m = Pw, n = rows, k = C.
//! - contraction, per (b, h) with `L, R` the `N×N` row-major slices of left/right:
//!   outgoing `T = L·Rᵀ` → `Tᵀ = R·Lᵀ`: A = R (transposed), B = L (as stored);
//!   incoming `T = Lᵀ·R` → `Tᵀ = Rᵀ·L`: A = R (as stored), B = L (transposed);
//!   m = n = k = N, batch B·H, stride N² for all three.
//! - output projection: `y[M, C] = a[M, H]·Woutᵀ`: A = Wout (transposed), B = a, m = C, n = rows, k = H.

use crate::problem::Direction;

/// One (possibly strided-batched) column-major GEMM `D = op(A)·op(B)`, `D` of size `m × n`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct GemmSpec {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// `op(A) = Aᵀ`: A is stored `k × m` (leading dimension `lda ≥ k`), else `m × k`.
    pub trans_a: bool,
    /// `op(B) = Bᵀ`: B is stored `n × k`, else `k × n`.
    pub trans_b: bool,
    pub lda: usize,
    pub ldb: usize,
    pub ldd: usize,
    pub batch: usize,
    /// Elements between consecutive batch entries (0 when `batch == 1`).
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_d: usize,
}

impl GemmSpec {
    /// `P[rows, pw] = z[rows, c]·W[pw, c]ᵀ`; A = W, B = z, D = P.
    pub fn projection(rows: usize, c: usize, pw: usize) -> Self {
        GemmSpec::row_major(rows, pw, c, (false, c), (true, c), pw)
    }

    /// `t = contraction(left, right)` for `batch_h = B·H` matrices of `n × n`; A = right,
    /// B = left, D = t, all in the `[B, H, N, N]` layout.
    pub fn contraction(direction: Direction, batch_h: usize, n: usize) -> Self {
        // Outgoing t = L·Rᵀ, incoming t = Lᵀ·R.
        let (left_t, right_t) = match direction {
            Direction::Outgoing => (false, true),
            Direction::Incoming => (true, false),
        };
        GemmSpec::row_major(n, n, n, (left_t, n), (right_t, n), n).batched(batch_h, n * n)
    }

    /// `y[rows, c] = a[rows, h]·Wout[c, h]ᵀ`; A = Wout, B = a, D = y.
    pub fn output(rows: usize, c: usize, h: usize) -> Self {
        GemmSpec::row_major(rows, c, h, (false, h), (true, h), c)
    }

    /// A row-major product `D[m, n] = op(U)·op(V)` (`op(U)` is `m × k`, `op(V)` is `k × n`),
    /// where `U` is stored `[m, k]` row-major with leading dimension `ldu`, or `[k, m]` when
    /// `u_t` (then `op(U) = Uᵀ`), and likewise `V` (`[k, n]`, or `[n, k]` when `v_t`), `D` with
    /// leading dimension `ldd`: the column-major `Dᵀ = op(V)ᵀ·op(U)ᵀ`, so A = V and B = U. The
    /// backward's GEMMs are written this way (`cuda/backward.rs`, `hip/backward.rs`).
    pub fn row_major(
        m: usize,
        n: usize,
        k: usize,
        (u_t, ldu): (bool, usize),
        (v_t, ldv): (bool, usize),
        ldd: usize,
    ) -> Self {
        GemmSpec {
            m: n,
            n: m,
            k,
            trans_a: v_t,
            trans_b: u_t,
            lda: ldv,
            ldb: ldu,
            ldd,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_d: 0,
        }
    }

    /// The same product for `batch` matrices, `U`, `V` and `D` each `stride` elements apart.
    pub fn batched(self, batch: usize, stride: usize) -> Self {
        let s = if batch > 1 { stride } else { 0 };
        GemmSpec { batch, stride_a: s, stride_b: s, stride_d: s, ..self }
    }

    /// One rank's contraction GEMM for one exchange step of `count` matrices on a row-sharded
    /// pair tensor (`plan::shard`), every operand in the compact layout: a rank's rows of a matrix,
    /// `[rows, N]` row-major, the step's matrices one after another. The rank holds `own` rows;
    /// `block` is rank p's rows (global indices):
    ///
    /// - outgoing: the column block `block` of the rank's rows of t,
    ///   `T[i, j ∈ block] = Σ_k L[i, k]·R_p[j, k]`, from its rows of left (`[own, N]`) and p's
    ///   rows of right (`[|block|, N]`), into its t (`[own, N]`, starting at column
    ///   `block.start`);
    /// - incoming: p's rows of the partial t over the rank's rows of the contracted index,
    ///   `T_p[i ∈ block, j] = Σ_{k ∈ own} L[k, i]·R[k, j]`, from its rows of left and right
    ///   (`[own, N]` each, left read from column `block.start`), into a `[|block|, N]` matrix.
    ///
    /// Returns the spec and the element offsets of A (= right), B (= left) and D (= t) from
    /// the step's first matrix of each.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA sharded forward's
    pub fn shard_step(
        direction: Direction,
        n: usize,
        own: usize,
        block: std::ops::Range<usize>,
        count: usize,
    ) -> (Self, [usize; 3]) {
        let p = block.len();
        let (spec, strides, offsets) = match direction {
            Direction::Outgoing => (
                GemmSpec::row_major(own, p, n, (false, n), (true, n), n),
                [p * n, own * n, own * n],
                [0, 0, block.start],
            ),
            Direction::Incoming => (
                GemmSpec::row_major(p, n, own, (true, n), (false, n), n),
                [own * n, own * n, p * n],
                [0, block.start, 0],
            ),
        };
        let [a, b, d] = if count > 1 { strides } else { [0; 3] };
        (GemmSpec { batch: count, stride_a: a, stride_b: b, stride_d: d, ..spec }, offsets)
    }

    /// Rows and columns of A and B as stored (column-major), for layout descriptors.
    pub fn a_dims(&self) -> (usize, usize) {
        if self.trans_a {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        }
    }

    pub fn b_dims(&self) -> (usize, usize) {
        if self.trans_b {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        }
    }

    /// Executes the call on the host exactly as a column-major BLAS would (f64 accumulation).
    /// Used by tests to prove the layout math; not a compute path.
    #[cfg(test)]
    pub fn run_host(&self, a: &[f32], b: &[f32], d: &mut [f32]) {
        for bt in 0..self.batch {
            let (oa, ob, od) = (bt * self.stride_a, bt * self.stride_b, bt * self.stride_d);
            for col in 0..self.n {
                for row in 0..self.m {
                    let mut acc = 0f64;
                    for kk in 0..self.k {
                        let av = if self.trans_a { a[oa + row * self.lda + kk] } else { a[oa + kk * self.lda + row] };
                        let bv = if self.trans_b { b[ob + kk * self.ldb + col] } else { b[ob + col * self.ldb + kk] };
                        acc += av as f64 * bv as f64;
                    }
                    d[od + col * self.ldd + row] = acc as f32;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rand::Rng;

    /// f32 results of f64-accumulated products: equal to the f64 sum to f32 rounding.
    fn close(a: f32, b: f64) -> bool {
        approx::relative_eq!(a as f64, b, epsilon = 1e-4, max_relative = 1e-4)
    }

    /// Checks that `spec`, run on the host with A = a random weight `w` `[n, k]` and B = a random
    /// `x` `[rows, k]` (drawn in that order from `seed`), makes `D[rows, n] = x·wᵀ`.
    fn check_times_w_transposed(spec: GemmSpec, (rows, k, n): (usize, usize, usize), seed: u64) {
        let mut r = Rng::new(seed);
        let x = r.normal_vec(rows * k, 1.0);
        let w = r.normal_vec(n * k, 1.0);
        let mut d = vec![0f32; rows * n];
        spec.run_host(&w, &x, &mut d);
        for i in 0..rows {
            for o in 0..n {
                let want: f64 = (0..k).map(|l| x[i * k + l] as f64 * w[o * k + l] as f64).sum();
                assert!(close(d[i * n + o], want), "D[{i},{o}]");
            }
        }
    }

    #[test]
    fn projection_is_z_times_w_transposed() {
        let (rows, c, pw) = (7, 5, 11);
        check_times_w_transposed(GemmSpec::projection(rows, c, pw), (rows, c, pw), 1);
    }

    /// `left`, `right` and each direction's contraction t of them.
    type Contractions = (Vec<f32>, Vec<f32>, Vec<(Direction, Vec<f32>)>);

    /// Random `left` and `right` of `bh` matrices `n × n` (drawn in that order from `seed`), and
    /// in each direction their contraction t, run on the host.
    fn contractions(bh: usize, n: usize, seed: u64) -> Contractions {
        let mut r = Rng::new(seed);
        let left = r.normal_vec(bh * n * n, 1.0);
        let right = r.normal_vec(bh * n * n, 1.0);
        let t = [Direction::Outgoing, Direction::Incoming].map(|dir| {
            let mut t = vec![0f32; bh * n * n];
            GemmSpec::contraction(dir, bh, n).run_host(&right, &left, &mut t);
            (dir, t)
        });
        (left, right, t.into())
    }

    #[test]
    fn contraction_matches_spec_in_both_directions() {
        let (bh, n) = (3, 6);
        let (left, right, ts) = contractions(bh, n, 2);
        for (dir, t) in ts {
            for s in 0..bh {
                let (l, rr) = (&left[s * n * n..], &right[s * n * n..]);
                for i in 0..n {
                    for j in 0..n {
                        let want: f64 = (0..n)
                            .map(|k| match dir {
                                // t[i,j] = Σ_k left[i,k]·right[j,k]
                                Direction::Outgoing => l[i * n + k] as f64 * rr[j * n + k] as f64,
                                // t[i,j] = Σ_k left[k,i]·right[k,j]
                                Direction::Incoming => l[k * n + i] as f64 * rr[k * n + j] as f64,
                            })
                            .sum();
                        assert!(close(t[s * n * n + i * n + j], want), "{dir} t[{s}][{i},{j}]");
                    }
                }
            }
        }
    }

    /// Every rank's pieces of a sharded contraction in the compact layout (uneven splits, both
    /// directions) put together the whole one: outgoing, each rank's rows of t from its column
    /// blocks; incoming, the sum over ranks of each rank's partial rows.
    #[test]
    fn shard_steps_put_together_the_whole() {
        let (bh, n) = (2, 7);
        let (left, right, wholes) = contractions(bh, n, 5);
        // A rank's rows of every matrix, one matrix after another.
        let compact = |v: &[f32], rows: &std::ops::Range<usize>| -> Vec<f32> {
            (0..bh).flat_map(|s| v[s * n * n + rows.start * n..s * n * n + rows.end * n].to_vec()).collect()
        };
        for (dir, whole) in wholes {
            let mut pieced = vec![0f32; bh * n * n];
            let split = crate::plan::shard::row_split(n, 3).unwrap();
            for rows in split.clone() {
                let (l, rr) = (compact(&left, &rows), compact(&right, &rows));
                for block in split.clone() {
                    let (spec, [oa, ob, od]) = GemmSpec::shard_step(dir, n, rows.len(), block.clone(), bh);
                    match dir {
                        Direction::Outgoing => {
                            let mut t = vec![f32::NAN; bh * rows.len() * n];
                            spec.run_host(&compact(&right, &block)[oa..], &l[ob..], &mut t[od..]);
                            for s in 0..bh {
                                for (li, i) in rows.clone().enumerate() {
                                    for j in block.clone() {
                                        pieced[s * n * n + i * n + j] = t[(s * rows.len() + li) * n + j];
                                    }
                                }
                            }
                        }
                        Direction::Incoming => {
                            let mut t = vec![f32::NAN; bh * block.len() * n];
                            spec.run_host(&rr[oa..], &l[ob..], &mut t[od..]);
                            assert!(t.iter().all(|v| v.is_finite()), "every element of the block written");
                            for s in 0..bh {
                                for (bi, i) in block.clone().enumerate() {
                                    for j in 0..n {
                                        pieced[s * n * n + i * n + j] += t[(s * block.len() + bi) * n + j];
                                    }
                                }
                            }
                        }
                    }
                }
            }
            for (at, (p, w)) in pieced.iter().zip(&whole).enumerate() {
                assert!(close(*p, *w as f64), "{dir} t[{at}]: {p} vs {w}");
            }
        }
    }

    #[test]
    fn row_major_products_in_every_transposition() {
        let (m, n, k, batch) = (5, 7, 4, 2);
        let mut r = Rng::new(4);
        for (u_t, v_t) in [(false, false), (true, false), (false, true), (true, true)] {
            // Leading dimensions one wider than the rows, so a swapped ld shows.
            let (ldu, ldv, ldd) = (if u_t { m } else { k } + 1, if v_t { k } else { n } + 1, n + 1);
            let (urows, vrows) = (if u_t { k } else { m }, if v_t { n } else { k });
            let (su, sv, sd) = (urows * ldu, vrows * ldv, m * ldd);
            let stride = su.max(sv).max(sd);
            let u = r.normal_vec(batch * stride, 1.0);
            let v = r.normal_vec(batch * stride, 1.0);
            let mut d = vec![0f32; batch * stride];
            GemmSpec::row_major(m, n, k, (u_t, ldu), (v_t, ldv), ldd).batched(batch, stride).run_host(&v, &u, &mut d);
            for b in 0..batch {
                let o = b * stride;
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|l| {
                                let uv = if u_t { u[o + l * ldu + i] } else { u[o + i * ldu + l] };
                                let vv = if v_t { v[o + j * ldv + l] } else { v[o + l * ldv + j] };
                                uv as f64 * vv as f64
                            })
                            .sum();
                        assert!(close(d[o + i * ldd + j], want), "u_t {u_t} v_t {v_t} D[{b}][{i},{j}]");
                    }
                }
            }
        }
    }

    #[test]
    fn output_is_a_times_wout_transposed() {
        let (rows, c, h) = (9, 4, 6);
        check_times_w_transposed(GemmSpec::output(rows, c, h), (rows, h, c), 3);
    }
}
