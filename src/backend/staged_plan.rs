//! The chunked plan of the staged pipeline (the portable stage kernels `input_norm` and
//! `input_gating` around a vendor BLAS projection, as the HIP backend and the CUDA backend's
//! cuBLASLt path run it): hidden passes and row chunks that keep a forward within a memory limit.
//! Pure arithmetic, shared by both backends and tested here. Why chunking is exact, and the
//! in-place rules, are in [`crate::memory`].

#![forbid(unsafe_code)]

use crate::backend::gemm::GemmSpec;
use crate::backend::params::{self, KernelParams};
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
        let hc = hc.min(h).max(1);
        let chunk_rows = chunk_rows.clamp(1, rows.max(1));
        let a16 = |elems: usize| -> Result<usize> { Ok(align_up(mul(&[elems, 2])?, STAGING_ALIGN)) };
        let lr_bytes = align_up(mul(&[rows, hc, 2])?, STAGING_ALIGN);
        // y in the I/O precision: 16-bit y has room for half as much.
        let y_bytes = mul(&[rows, c, problem.io.io_bytes()])?;
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
    #[cfg(any(feature = "rocm", test))]
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
        let fit = crate::plan::widest_fit(
            problem.config.h,
            PASS_STEP,
            problem.shape.rows(),
            CHUNK_ALIGN,
            MAX_CHUNK_ROWS,
            limit,
            |hc, rows| ChunkedPlan::new(problem, hc, rows).map_or(u64::MAX, |p| bytes(&p)),
        );
        fit.map(|(hc, rows)| ChunkedPlan::new(problem, hc, rows)).transpose()
    }

    /// Device bytes: t, the scratch, the per-pass weights and af3's ones.
    pub fn total_bytes(&self) -> u64 {
        (self.t_bytes + self.scratch_bytes + self.pass_w_bytes + self.ones_bytes) as u64
    }

    /// The hidden passes: `(first channel, channels)`.
    pub fn passes(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.h).step_by(self.hc).map(|h0| (h0, self.hc.min(self.h - h0)))
    }

    /// How `pass_w` is filled from the prepared `[P, C]` weights (and `[P]` biases): for each pass
    /// and each of its four gated projections, `(destination row, source row, rows)`, a row being
    /// C halves (or one f32 bias). Pass `(h0, hn)` holds `[lp; lg; rp; rg]` rows `h0 .. h0 + hn` at
    /// rows `4·h0 ..`, so its projection is one GEMM and `input_gating` sees H = hn.
    pub fn pass_row_copies(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let h = self.h;
        self.passes().flat_map(move |(h0, hn)| (0..4).map(move |part| (4 * h0 + part * hn, part * h + h0, hn)))
    }

    /// The row chunks of both phases: `(first position, positions)`, starting 64-aligned.
    pub fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.rows).step_by(self.chunk_rows).map(|r0| (r0, self.chunk_rows.min(self.rows - r0)))
    }
}

/// Positions per block of `input_gating` when it computes only the gate (no shared memory).
pub const GATE_TILE_ROWS: usize = 64;

/// Device addresses a staged forward works in, besides the call's x, mask and y.
#[derive(Copy, Clone, Debug)]
pub struct StagedBuffers {
    /// The plan's scratch (`scratch_bytes`).
    pub scratch: u64,
    /// The per-pass packed projection rows and their biases (`pass_w_bytes`).
    pub pass_w: u64,
    /// `t`, `[B, H, N, N]` f16.
    pub t: u64,
    /// The prepared fused weights `[P, C]` f16 (their out-gate rows make the gate).
    pub w_in: u64,
    /// The prepared biases `[P]` f32, or 0.
    pub proj_bias: u64,
}

/// One operation of a staged chunked forward, every address resolved. A backend runs the list of
/// [`ChunkedPlan::steps`] in order with its own launches and BLAS calls, so the plan's addresses,
/// shapes and order are written once, for both backends, and checked on the host.
#[derive(Clone, Debug, PartialEq)]
pub enum StagedStep {
    /// `input_norm` of `params.rows` positions from `params.row0` into `params.z`.
    Norm(KernelParams),
    /// An f16 GEMM with f32 accumulation: `D = op(A)·op(B)` as `spec` says (projections and the
    /// contraction of one pass and batch).
    Gemm { spec: GemmSpec, a: u64, b: u64, d: u64 },
    /// `input_gating` with `tile_rows` positions per block and `smem` bytes of shared memory.
    Gating { params: KernelParams, tile_rows: usize, smem: usize },
    /// Every hidden pass is done: `t` is complete (a backend may mark its timeline here).
    PassesDone,
    /// The output stage of positions `row0 .. row0 + rows`: `gate` and `a` hold them from
    /// `buf_row0`, `t` is whole, y is written at those rows.
    Output(KernelParams),
}

impl ChunkedPlan {
    /// The forward of `problem` as steps: per hidden pass, per row chunk `Norm`, the pass's
    /// projection `Gemm` and `Gating` with H = the pass width into left/right `[B, hn, N, N]`,
    /// then one contraction `Gemm` per batch into the pass's channels of t; after `PassesDone`, per
    /// row chunk `Norm`, the out-gate `Gemm`, `Gating` with H = 0 into the gate chunk, `Output`.
    /// `base` carries x, mask, y, the LayerNorm parameters and the shape.
    pub fn steps(&self, problem: &Problem, base: &KernelParams, bufs: StagedBuffers) -> Vec<StagedStep> {
        let (c, h, g) = (self.c, self.h, self.g);
        let (batch, n) = (problem.shape.batch, problem.shape.n);
        let nn = n * n;
        let z = bufs.scratch;
        let mut steps = Vec::new();

        // Phase A. Left/right live in y out of place when they fit there, else in scratch.
        let (left, right) = if self.lr_in_y {
            (base.y, base.y + self.lr_bytes as u64)
        } else {
            (bufs.scratch + self.lr_off as u64, bufs.scratch + (self.lr_off + self.lr_bytes) as u64)
        };
        let proj = bufs.scratch + self.proj_a_off as u64;
        for (h0, hn) in self.passes() {
            let w = bufs.pass_w + (4 * h0 * c * 2) as u64;
            let bias = if bufs.proj_bias != 0 { bufs.pass_w + (self.pass_bias_off + 4 * h0 * 4) as u64 } else { 0 };
            let tile_rows = params::gating_tile_rows(hn);
            for (row0, rows) in self.chunks() {
                let p = KernelParams {
                    z,
                    proj,
                    left,
                    right,
                    proj_bias: bias,
                    gate: 0,
                    h: hn as i32,
                    g: 0,
                    p: (4 * hn) as i32,
                    row0: row0 as i64,
                    rows: rows as i64,
                    tile_rows: tile_rows as i32,
                    ..*base
                };
                steps.push(StagedStep::Norm(p));
                steps.push(StagedStep::Gemm { spec: GemmSpec::projection(rows, c, 4 * hn), a: w, b: z, d: proj });
                steps.push(StagedStep::Gating { params: p, tile_rows, smem: params::gating_smem_bytes(hn, tile_rows) });
            }
            // t's channels of a pass are contiguous within a batch only.
            let spec = GemmSpec::contraction(problem.direction, hn, n);
            for b in 0..batch {
                let off = (b * hn * nn * 2) as u64;
                let d = bufs.t + ((b * h + h0) * nn * 2) as u64;
                steps.push(StagedStep::Gemm { spec, a: right + off, b: left + off, d });
            }
        }
        steps.push(StagedStep::PassesDone);

        // Phase B.
        let proj = bufs.scratch + self.proj_b_off as u64;
        let (gate, a) = (bufs.scratch + self.gate_off as u64, bufs.scratch + self.a_off as u64);
        let w_gate = bufs.w_in + (4 * h * c * 2) as u64;
        let gate_bias = if bufs.proj_bias != 0 { bufs.proj_bias + (4 * h * 4) as u64 } else { 0 };
        for (r0, rows) in self.chunks() {
            let chunk = KernelParams {
                z,
                proj,
                gate,
                a,
                t: bufs.t,
                left: 0,
                right: 0,
                row0: r0 as i64,
                rows: rows as i64,
                buf_row0: r0 as i64,
                ..*base
            };
            // input_gating with H = 0: only σ(z·Wogᵀ + b) into the gate chunk.
            let gp =
                KernelParams { h: 0, p: g as i32, proj_bias: gate_bias, tile_rows: GATE_TILE_ROWS as i32, ..chunk };
            steps.push(StagedStep::Norm(gp));
            steps.push(StagedStep::Gemm { spec: GemmSpec::projection(rows, c, g), a: w_gate, b: z, d: proj });
            steps.push(StagedStep::Gating { params: gp, tile_rows: GATE_TILE_ROWS, smem: 0 });
            steps.push(StagedStep::Output(chunk));
        }
        steps
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Config, Direction, Precision, Shape};

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
            assert!(!p.in_place && 2 * plan.lr_bytes <= m * c * p.io.io_bytes(), "{what}");
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

    /// Every address a step touches lies inside the buffer it belongs to (regions of the scratch
    /// that are live together do not overlap), each hidden channel of t is written once per batch
    /// and every position gets its output stage once: the plan's addresses are right before any
    /// backend runs them.
    #[test]
    fn steps_stay_inside_their_buffers_and_cover_the_problem() {
        const X: u64 = 1 << 40;
        const Y: u64 = 2 << 40;
        const SCRATCH: u64 = 3 << 40;
        const PASS_W: u64 = 4 << 40;
        const T: u64 = 5 << 40;
        const W_IN: u64 = 6 << 40;
        const BIAS: u64 = 7 << 40;
        let span = |rows: usize, cols: usize, ld: usize| ((cols.max(1) - 1) * ld + rows) as u64;
        for (f, b, n, c, h, in_place, biases) in [
            (Formulation::GpuMode, 2, 10, 32, 24, false, false),
            (Formulation::Af3, 2, 10, 16, 24, true, true),
            (Formulation::Af3, 1, 33, 384, 128, false, true),
            (Formulation::GpuMode, 3, 7, 5, 3, true, false),
            // Left and right fill f32 y exactly in the narrowest plan, so not 16-bit y.
            (Formulation::GpuMode, 1, 16, 8, 32, false, false),
        ] {
            // x and y in f32 and in 16 bits (half the room for left and right inside y).
            for io in [Precision::F32Io, Precision::Bf16Io] {
                let p = problem(f, b, n, c, h).in_place(in_place).with_io(io);
                let e = io.io_bytes() as u64;
                let m = p.shape.rows();
                let g = p.config.gate_width();
                let pw = 4 * h + g;
                for plan in [ChunkedPlan::narrowest(&p).unwrap(), ChunkedPlan::new(&p, 16, 128).unwrap()] {
                    let what = format!("{p:?}: {plan:?}");
                    let y = if in_place { X } else { Y };
                    let base = KernelParams {
                        x: X,
                        y,
                        batch: b as i32,
                        n: n as i32,
                        c: c as i32,
                        h: h as i32,
                        ..Default::default()
                    };
                    let bufs = StagedBuffers {
                        scratch: SCRATCH,
                        pass_w: PASS_W,
                        t: T,
                        w_in: W_IN,
                        proj_bias: if biases { BIAS } else { 0 },
                    };
                    let sizes = [
                        (X, m as u64 * c as u64 * e),
                        (Y, if in_place { 0 } else { m as u64 * c as u64 * e }),
                        (SCRATCH, plan.scratch_bytes as u64),
                        (PASS_W, plan.pass_w_bytes as u64),
                        (T, plan.t_bytes as u64),
                        (W_IN, (pw * c * 2) as u64),
                        (BIAS, (pw * 4) as u64),
                    ];
                    let inside = |addr: u64, len: u64, what_: &str| {
                        if len == 0 {
                            return;
                        }
                        let ok = sizes.iter().any(|&(at, size)| addr >= at && addr + len <= at + size);
                        assert!(ok, "{what}: {what_} [{addr:#x}, +{len}) outside every buffer");
                    };
                    let mut t_written = vec![0u32; b * h];
                    let mut out_rows = vec![0u32; m];
                    let mut passes_done = false;
                    for step in plan.steps(&p, &base, bufs) {
                        match step {
                            StagedStep::Norm(q) => {
                                inside(q.x + q.row0 as u64 * c as u64 * e, q.rows as u64 * c as u64 * e, "x");
                                inside(q.z, q.rows as u64 * c as u64 * 2, "z");
                                assert!(q.z + q.rows as u64 * c as u64 * 2 <= q.proj, "{what}: z runs into proj");
                            }
                            StagedStep::Gemm { spec, a, b: bb, d } => {
                                let (ar, ac) = spec.a_dims();
                                let (br, bc) = spec.b_dims();
                                let batched = |one: u64, stride: usize| (spec.batch as u64 - 1) * stride as u64 + one;
                                inside(a, 2 * batched(span(ar, ac, spec.lda), spec.stride_a), "GEMM A");
                                inside(bb, 2 * batched(span(br, bc, spec.ldb), spec.stride_b), "GEMM B");
                                inside(d, 2 * batched(span(spec.m, spec.n, spec.ldd), spec.stride_d), "GEMM D");
                                if d >= T && d < T + plan.t_bytes as u64 {
                                    assert!(!passes_done, "{what}: t written after the passes");
                                    let first = ((d - T) / 2 / (n * n) as u64) as usize;
                                    for k in &mut t_written[first..first + spec.batch] {
                                        *k += 1;
                                    }
                                }
                            }
                            StagedStep::Gating { params: q, tile_rows, smem } => {
                                let (hn, gq, pq) = (q.h as u64, q.g as u64, q.p as u64);
                                assert!(
                                    tile_rows >= 1 && smem == params::gating_smem_bytes(q.h as usize, tile_rows),
                                    "{what}"
                                );
                                inside(q.proj, q.rows as u64 * pq * 2, "proj");
                                if q.proj_bias != 0 {
                                    inside(q.proj_bias, pq * 4, "bias");
                                }
                                inside(q.left, m as u64 * hn * 2, "left");
                                inside(q.right, m as u64 * hn * 2, "right");
                                let brow = (q.row0 - q.buf_row0) as u64;
                                inside(q.gate + brow * gq * 2, q.rows as u64 * gq * 2, "gate");
                                if hn > 0 && q.left >= SCRATCH {
                                    assert!(q.proj + q.rows as u64 * pq * 2 <= q.left, "{what}: proj runs into left");
                                }
                            }
                            StagedStep::PassesDone => passes_done = true,
                            StagedStep::Output(q) => {
                                assert!(passes_done, "{what}: output before t is complete");
                                let (r0, rows) = (q.row0 as usize, q.rows as usize);
                                inside(q.t, (m * h * 2) as u64, "t");
                                inside(
                                    q.gate + ((q.row0 - q.buf_row0) as u64) * g as u64 * 2,
                                    (rows * g * 2) as u64,
                                    "gate chunk",
                                );
                                inside(q.a, (rows * h * 2) as u64, "a chunk");
                                inside(q.y + r0 as u64 * c as u64 * e, rows as u64 * c as u64 * e, "y rows");
                                assert!(
                                    q.gate + (rows * g * 2) as u64 <= q.a || q.a + (rows * h * 2) as u64 <= q.gate,
                                    "{what}"
                                );
                                for row in &mut out_rows[r0..r0 + rows] {
                                    *row += 1;
                                }
                            }
                        }
                    }
                    assert!(t_written.iter().all(|&k| k == 1), "{what}: t channels written {t_written:?}");
                    assert!(out_rows.iter().all(|&k| k == 1), "{what}: output rows {out_rows:?}");
                }
            }
        }
    }

    #[test]
    fn pass_copies_place_every_gated_row_once() {
        let p = problem(Formulation::Af3, 1, 8, 16, 40);
        let plan = ChunkedPlan::new(&p, 16, 64).unwrap();
        let mut dst = vec![None; 4 * 40];
        for (to, from, rows) in plan.pass_row_copies() {
            for r in 0..rows {
                assert!(dst[to + r].is_none(), "row {} written twice", to + r);
                dst[to + r] = Some(from + r);
            }
        }
        // Pass (h0, hn) at rows 4·h0: its hn rows of left_proj, left_gate, right_proj, right_gate.
        for (h0, hn) in plan.passes() {
            for part in 0..4 {
                for r in 0..hn {
                    assert_eq!(dst[4 * h0 + part * hn + r], Some(part * 40 + h0 + r));
                }
            }
        }
    }
}

#[cfg(test)]
mod equivalence {
    use super::*;
    use crate::plan::{Blas, Capabilities, InputStage, Plan};
    use crate::problem::{Config, Direction, Precision, Shape};

    #[test]
    fn new_plan_matches_the_old_staged_plan() {
        for (f, b, n, c, h) in [
            (Formulation::GpuMode, 2, 10, 32, 24),
            (Formulation::Af3, 2, 10, 16, 24),
            (Formulation::Af3, 1, 33, 384, 128),
            (Formulation::GpuMode, 3, 7, 5, 3),
            (Formulation::GpuMode, 1, 300, 128, 128),
            (Formulation::Af3, 1, 1000, 128, 128),
        ] {
            for in_place in [false, true] {
                for io in [Precision::F32Io, Precision::Bf16Io] {
                    let p = Problem::new(Config::new(f, c, h).unwrap(), Shape::new(b, n), Direction::Outgoing, false)
                        .unwrap()
                        .in_place(in_place)
                        .with_io(io);
                    for blas in [Blas::CublasLt, Blas::RocBlas] {
                        let caps = Capabilities { input: InputStage::Staged, blas };
                        for (hc, rows) in [(8, 64), (16, 128), (h, 1 << 20), (24, 100)] {
                            let old = ChunkedPlan::new(&p, hc, rows).unwrap();
                            let new = Plan::chunked(&p, caps, hc, rows).unwrap();
                            let what = format!("{p:?} {blas:?} {hc} {rows}");
                            assert_eq!(new.hidden_chunk, old.hc, "{what}");
                            assert_eq!(new.output_rows, old.chunk_rows, "{what}");
                            assert_eq!(new.left_right_in_y(), old.lr_in_y, "{what}");
                            assert_eq!(new.left.bytes, old.lr_bytes, "{what}");
                            assert_eq!(new.proj.unwrap().offset, old.proj_a_off, "{what}");
                            assert_eq!(new.proj.unwrap().offset, old.proj_b_off, "{what}");
                            if !old.lr_in_y {
                                assert_eq!(new.left.offset, old.lr_off, "{what}");
                            }
                            assert_eq!(new.gate.unwrap().offset, old.gate_off, "{what}");
                            assert_eq!(new.a.offset, old.a_off, "{what}");
                            assert_eq!(new.scratch_bytes, old.scratch_bytes, "{what}");
                            assert_eq!(new.t_bytes, old.t_bytes, "{what}");
                            assert_eq!(new.pass_weights_bytes, old.pass_w_bytes, "{what}");
                            assert_eq!(new.pass_bias_offset, old.pass_bias_off, "{what}");
                            let old_bytes = match blas {
                                Blas::RocBlas => old.total_bytes(),
                                Blas::CublasLt => {
                                    old.total_bytes() - old.ones_bytes as u64
                                        + align_up((old.chunk_rows * old.c * 2).min(4 << 20), STAGING_ALIGN) as u64
                                }
                            };
                            assert_eq!(new.workspace_bytes(), old_bytes, "{what}");
                            assert_eq!(new.pass_row_copies().collect::<Vec<_>>(), old.pass_row_copies().collect::<Vec<_>>());
                        }
                        for limit in [0u64, 1 << 16, 1 << 20, 1 << 24, 1 << 30, u64::MAX] {
                            let old = match blas {
                                Blas::RocBlas => ChunkedPlan::choose(&p, limit).unwrap(),
                                Blas::CublasLt => ChunkedPlan::choose_by(&p, limit, |q| {
                                    q.total_bytes() - q.ones_bytes as u64
                                        + align_up((q.chunk_rows * q.c * 2).min(4 << 20), STAGING_ALIGN) as u64
                                })
                                .unwrap(),
                            };
                            let new = Plan::widest_chunked(&p, caps, limit).unwrap();
                            assert_eq!(
                                old.map(|o| (o.hc, o.chunk_rows)),
                                new.map(|n| (n.hidden_chunk, n.output_rows)),
                                "{p:?} {limit}"
                            );
                        }
                    }
                }
            }
        }
    }
}
