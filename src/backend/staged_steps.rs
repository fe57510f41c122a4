//! The staged pipeline's steps (the portable stage kernels `input_norm` and `input_gating`
//! around a vendor BLAS projection, as the HIP backend and the CUDA backend's cuBLASLt path run
//! a chunked [`Plan`]): every launch and GEMM of a forward with its addresses resolved, written
//! once for both backends and checked on the host. Why chunking is exact, and the layout, are in
//! [`crate::plan`].

#![forbid(unsafe_code)]

use crate::backend::gemm::GemmSpec;
use crate::backend::params::{self, to_i32, to_i64, CommonParams, InputParams, OutputParams};
use crate::error::{Error, Result};
use crate::plan::{Buffer, InputStage, Plan};
use crate::problem::Problem;

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
/// [`steps`] in order with its own launches and BLAS calls, so the plan's addresses,
/// shapes and order are written once, for both backends, and checked on the host.
#[derive(Clone, Debug, PartialEq)]
pub enum StagedStep {
    /// `input_norm` of `params.common.rows()` positions from `params.common.row0()` into `params.z`.
    Norm(InputParams),
    /// An f16 GEMM with f32 accumulation: `D = op(A)·op(B)` as `spec` says (projections and the
    /// contraction of one pass and batch).
    Gemm { spec: GemmSpec, a: u64, b: u64, d: u64 },
    /// `input_gating` with `tile_rows` positions per block and `smem` bytes of shared memory.
    Gating { params: InputParams, tile_rows: usize, smem: usize },
    /// Every hidden pass is done: `t` is complete (a backend may mark its timeline here).
    PassesDone,
    /// The output stage of positions `row0 .. row0 + rows`: `gate` and `a` hold them from
    /// `buf_row0`, `t` is whole, y is written at those rows.
    Output(OutputParams),
}

/// The forward of `problem` under a staged chunked `plan` as steps: per hidden pass, per row chunk `Norm`, the pass's
/// projection `Gemm` and `Gating` with H = the pass width into left/right `[B, hn, N, N]`,
/// then one contraction `Gemm` per batch into the pass's channels of t; after `PassesDone`, per
/// row chunk `Norm`, the out-gate `Gemm`, `Gating` with H = 0 into the gate chunk, `Output`.
/// `base` carries x, mask, y, the LayerNorm parameters and the shape ([`CommonParams::new`]).
/// Fails on any other kind of plan.
pub fn steps(plan: &Plan, problem: &Problem, base: &CommonParams, bufs: StagedBuffers) -> Result<Vec<StagedStep>> {
    if plan.caps.input != InputStage::Staged || plan.is_one_pass() {
        return Err(Error::Internal(format!("a staged chunked forward was given another plan: {:?}", plan.caps)));
    }
    let (c, h, g) = (plan.c, plan.h, plan.g);
    let (batch, n) = (problem.shape.batch, problem.shape.n);
    let nn = n * n;
    let z = bufs.scratch;
    let mut steps = Vec::new();

    // Phase A. Left/right live in y out of place when they fit there, else in scratch.
    let base_of = |b: Buffer| match b {
        Buffer::Y => base.y(),
        Buffer::Scratch => bufs.scratch,
        _ => 0,
    };
    let (left, right) = (Plan::address(plan.left, base_of), Plan::address(plan.right, base_of));
    let proj = Plan::address(Plan::require(plan.proj, "proj")?, base_of);
    let pass_bias = plan.pass_bias_offset;
    for (h0, hn) in plan.passes() {
        let w = bufs.pass_w + (4 * h0 * c * 2) as u64;
        let bias = if bufs.proj_bias != 0 { bufs.pass_w + (pass_bias + 4 * h0 * 4) as u64 } else { 0 };
        let tile_rows = params::gating_tile_rows(hn);
        for (row0, rows) in plan.input_chunks() {
            // The pass's channels of left and right, no gate.
            let chunk = chunk_params(base.over(row0, rows)?, z, proj, bias, tile_rows)?;
            let p = InputParams { left, right, proj_h: to_i32(hn, "a pass's channels")?, ..chunk };
            push_projected(&mut steps, p, (c, 4 * hn), w, (tile_rows, params::gating_smem_bytes(hn, tile_rows)));
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
    let gate = Plan::address(Plan::require(plan.gate, "gate")?, base_of);
    let a = Plan::address(plan.a, base_of);
    let w_gate = bufs.w_in + (4 * h * c * 2) as u64;
    let gate_bias = if bufs.proj_bias != 0 { bufs.proj_bias + (4 * h * 4) as u64 } else { 0 };
    for (r0, rows) in plan.output_chunks() {
        let common = base.over(r0, rows)?;
        let buf_row0 = to_i64(r0, "first position of a chunk")?;
        // input_gating of the gate alone: only σ(z·Wogᵀ + b) into the gate chunk.
        let gate_chunk = chunk_params(common, z, proj, gate_bias, GATE_TILE_ROWS)?;
        let gp = InputParams { gate, buf_row0, proj_g: to_i32(g, "G")?, ..gate_chunk };
        let chunk = OutputParams { common, t: bufs.t, a, gate, buf_row0, ..OutputParams::default() };
        push_projected(&mut steps, gp, (c, g), w_gate, (GATE_TILE_ROWS, 0));
        steps.push(StagedStep::Output(chunk));
    }
    Ok(steps)
}

/// The input-stage parameters both phases share for the chunk `common`: LN_C into `z`, the
/// projection in `proj` with its bias at `proj_bias` (0: none), `tile_rows` positions per
/// `input_gating` block. The caller names what the gating writes.
fn chunk_params(common: CommonParams, z: u64, proj: u64, proj_bias: u64, tile_rows: usize) -> Result<InputParams> {
    let tile_rows = to_i32(tile_rows, "positions per block")?;
    Ok(InputParams { common, z, proj, proj_bias, tile_rows, ..InputParams::default() })
}

/// One input chunk's steps: `Norm` into `p.z`, the projection `Gemm` of z (`c` channels) by the
/// `width` weight rows at `w` into `p.proj`, and `Gating` of it with `tile_rows` positions per
/// block and `smem` bytes of shared memory.
fn push_projected(
    steps: &mut Vec<StagedStep>,
    p: InputParams,
    (c, width): (usize, usize),
    w: u64,
    (tile_rows, smem): (usize, usize),
) {
    steps.push(StagedStep::Norm(p));
    steps.push(StagedStep::Gemm { spec: GemmSpec::projection(p.common.rows(), c, width), a: w, b: p.z, d: p.proj });
    steps.push(StagedStep::Gating { params: p, tile_rows, smem });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::params::Addresses;
    use crate::plan::{Blas, Capabilities, InputStage};
    use crate::problem::{Config, Direction, Formulation, Precision, Shape};

    fn problem(f: Formulation, b: usize, n: usize, c: usize, h: usize) -> Problem {
        Problem::new(Config::new(f, c, h).unwrap(), Shape::new(b, n), Direction::Outgoing, false).unwrap()
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
                let caps = Capabilities { input: InputStage::Staged, blas: Blas::RocBlas };
                for plan in [Plan::narrowest(&p, caps).unwrap(), Plan::chunked(&p, caps, 16, 128).unwrap()] {
                    let what = format!("{p:?}: {plan:?}");
                    let y = if in_place { X } else { Y };
                    let base = CommonParams::new(&p, Addresses { x: X, y, ..Addresses::default() }).unwrap();
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
                        (PASS_W, plan.pass_weights_bytes as u64),
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
                    for step in steps(&plan, &p, &base, bufs).unwrap() {
                        match step {
                            StagedStep::Norm(q) => {
                                let (row0, rows) = (q.common.row0() as u64, q.common.rows() as u64);
                                inside(q.common.x() + row0 * c as u64 * e, rows * c as u64 * e, "x");
                                inside(q.z, rows * c as u64 * 2, "z");
                                assert!(q.z + rows * c as u64 * 2 <= q.proj, "{what}: z runs into proj");
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
                                let (hn, gq) = (q.proj_h as u64, q.proj_g as u64);
                                let pq = 4 * hn + gq;
                                let rows = q.common.rows() as u64;
                                assert!(
                                    tile_rows >= 1
                                        && tile_rows == q.tile_rows as usize
                                        && smem == params::gating_smem_bytes(hn as usize, tile_rows),
                                    "{what}"
                                );
                                inside(q.proj, rows * pq * 2, "proj");
                                if q.proj_bias != 0 {
                                    inside(q.proj_bias, pq * 4, "bias");
                                }
                                inside(q.left, m as u64 * hn * 2, "left");
                                inside(q.right, m as u64 * hn * 2, "right");
                                let brow = q.common.row0() as u64 - q.buf_row0 as u64;
                                inside(q.gate + brow * gq * 2, rows * gq * 2, "gate");
                                if hn > 0 && q.left >= SCRATCH {
                                    assert!(q.proj + rows * pq * 2 <= q.left, "{what}: proj runs into left");
                                }
                            }
                            StagedStep::PassesDone => passes_done = true,
                            StagedStep::Output(q) => {
                                assert!(passes_done, "{what}: output before t is complete");
                                let (r0, rows) = (q.common.row0(), q.common.rows());
                                inside(q.t, (m * h * 2) as u64, "t");
                                inside(
                                    q.gate + (r0 as u64 - q.buf_row0 as u64) * g as u64 * 2,
                                    (rows * g * 2) as u64,
                                    "gate chunk",
                                );
                                inside(q.a, (rows * h * 2) as u64, "a chunk");
                                inside(q.common.y() + r0 as u64 * c as u64 * e, rows as u64 * c as u64 * e, "y rows");
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
}
