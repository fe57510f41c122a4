//! The one plan type: how a forward is split (hidden passes, row chunks, where the gate comes
//! from) and where each intermediate lives, for every way a backend runs its stages.
//!
//! A backend declares two things ([`Capabilities`]): how its input stage makes left, right and
//! the gate ([`InputStage`]), and what its BLAS needs ([`Blas`]). From those and a problem come
//! two kinds of plan, both a [`Plan`]:
//!
//! - **one pass** ([`Plan::one_pass`]): left, right (and the gate, unless the output stage makes
//!   it from x) for every position in buffers of their own, then t, then the output stage over
//!   every position. The fastest, and the largest.
//! - **chunked** ([`Plan::chunked`]): hidden passes of `hidden_chunk` channels, each projecting
//!   and contracting its channels of t; then the output stage over row chunks of `output_rows`
//!   positions, recomputing the gate from x. Left and right of a pass live in the caller's y
//!   (dead until the output stage) when they fit there, else in a scratch buffer; the scratch
//!   holds each phase's regions in turn (the phases never overlap in time).
//!
//! Regions ([`Region`]) name a buffer ([`Buffer`]) and an offset into it; a backend allocates
//! each buffer of non-zero size ([`Plan::buffer_bytes`]) or carves it from caller memory, and
//! resolves a region to `base(buffer) + offset` ([`Plan::address`]). Every byte count a backend
//! allocates or reports comes from here ([`Plan::workspace_bytes`]).

use crate::error::{Error, Result};
use crate::problem::{Formulation, Problem};

/// Alignment of every region inside a buffer.
pub const REGION_ALIGN: usize = 256;
/// Row chunks of the staged input stage start at multiples of this many positions (the stage
/// kernels' 16-byte vector accesses along positions rely on it).
pub const STAGED_ROW_STEP: usize = 64;
/// Hidden channels per pass of the staged input stage are multiples of this (`input_gating`
/// stores 16-byte runs of 8).
pub const STAGED_CHANNEL_STEP: usize = 8;
/// Positions per block of CUDA's fused input kernels: their row chunks are multiples of it.
pub const FUSED_ROW_STEP: usize = 128;
/// Hidden channels per pass of CUDA's fused input kernels are multiples of this (their column
/// chunks of 32 channels). HIP's fused kernel writes any window of channels, so its plans keep
/// the stage kernels' steps (the rocBLAS output path runs those kernels on the row chunks).
pub const FUSED_CHANNEL_STEP: usize = 32;
/// Largest row chunk of a chunked plan: beyond a million positions more launches cost nothing.
pub const MAX_CHUNK_ROWS: usize = 1 << 20;
/// Most bytes a cuBLASLt GEMM of a one-pass plan is offered as workspace.
pub const MAX_GEMM_WORKSPACE: usize = 32 << 20;
/// Fewest positions per projection chunk of a rocBLAS one-pass plan when it chunks (GEMM
/// efficiency drops below this); smaller problems take one chunk in a staging buffer of its own.
pub const ROCBLAS_MIN_INPUT_ROWS: usize = 4096;

/// How a backend's input stage makes left, right and the gate.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum InputStage {
    /// One kernel reads x and writes them (the fused input-projection kernels, CUDA's and HIP's
    /// MFMA one): no staging.
    Fused,
    /// `input_norm` into z, a BLAS projection into proj, `input_gating` from proj: z and proj
    /// are staged per row chunk.
    Staged,
}

/// The vendor BLAS a backend runs its GEMMs with, for what they need besides their operands.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Blas {
    /// cuBLASLt: a workspace per GEMM; biases in the epilogue.
    CublasLt,
    /// rocBLAS: no workspace; af3's projection biases added by a rank-1 GEMM with a vector of
    /// ones (`[rows]` f32).
    RocBlas,
}

/// What a backend can do, as far as plans care.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// How its input stage runs.
    pub input: InputStage,
    /// Its BLAS.
    pub blas: Blas,
}

/// A buffer of a workspace (or the caller's y, which a plan may borrow while it is dead).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Buffer {
    /// `[B, H, N, N]` f16, the contraction (one-pass staged plans grow it to hold their staging).
    T,
    /// One-pass: `[B, H, N, N]` f16.
    Left,
    /// One-pass: `[B, H, N, N]` f16.
    Right,
    /// One-pass with a stored gate: `[M, G]` f16.
    Gate,
    /// A rocBLAS one-pass plan's z and proj (the projection's input and output) when they do
    /// not go inside t.
    Projection,
    /// Chunked: the regions of each phase in turn.
    Scratch,
    /// Staged chunked: each pass's rows of the gated projections, `[4H, C]` f16, then their
    /// biases `[4H]` f32.
    PassWeights,
    /// Staged chunked with cuBLASLt: the workspace every GEMM shares.
    GemmWorkspace,
    /// rocBLAS with biases: `[rows]` f32 ones.
    Ones,
    /// The caller's y (in place: x), dead until the output stage.
    Y,
}

/// A run of bytes inside a buffer.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    /// The buffer it lies in.
    pub buffer: Buffer,
    /// Its first byte, from the buffer's start.
    pub offset: usize,
    /// Its length.
    pub bytes: usize,
}

impl Region {
    /// A region at `offset` of `buffer`.
    pub const fn new(buffer: Buffer, offset: usize, bytes: usize) -> Region {
        Region { buffer, offset, bytes }
    }

    /// Its address, given where its buffer starts.
    pub fn at(&self, base: u64) -> u64 {
        base + self.offset as u64
    }

    /// The first byte after it.
    pub fn end(&self) -> usize {
        self.offset + self.bytes
    }
}

/// How one forward is split and laid out: see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// What it was made for.
    pub caps: Capabilities,
    /// Positions M = B·N².
    pub rows: usize,
    /// Pair channels C.
    pub c: usize,
    /// Hidden channels H.
    pub h: usize,
    /// Output-gate width G.
    pub g: usize,
    /// Fused projection width P = 4H + G.
    pub p: usize,
    /// The af3 formulation (its gate and biases), not gpumode.
    pub af3: bool,
    /// y is written over x.
    pub in_place: bool,
    /// Bytes of the caller's y (in its I/O precision).
    pub y_bytes: usize,

    /// Hidden channels per projection + contraction pass (H: one pass).
    pub hidden_chunk: usize,
    /// Positions per chunk of the staged input stage (every position for the fused one).
    pub input_rows: usize,
    /// Positions per chunk of the output stage.
    pub output_rows: usize,
    /// Whether the output stage makes the gate from x instead of reading a stored one.
    pub gate_from_x: bool,

    /// Left of one pass: `[B, hc, N, N]` f16 (a one-pass plan: its own buffer).
    pub left: Region,
    /// Right of one pass, as left.
    pub right: Region,
    /// The stored gate `[M, G]`, or a chunked plan's recomputed gate of one output chunk
    /// `[rows, G]` (f16); `None` when the output kernel makes it from x itself.
    pub gate: Option<Region>,
    /// z `[rows, C]` f16 of one input chunk (staged input).
    pub z: Option<Region>,
    /// proj `[rows, P]` (one pass) or `[rows, 4·hc]` (chunked: its output stage's `[rows, G]`
    /// projection of the gate starts here too) f16 of one input chunk.
    pub proj: Option<Region>,
    /// LN_H(t) of one output chunk `[rows, H]` f16, the output GEMM's operand.
    pub a: Region,
    /// cuBLASLt: the contraction's workspace.
    pub contraction_ws: Option<Region>,
    /// cuBLASLt: the output GEMM's workspace.
    pub output_ws: Option<Region>,
    /// cuBLASLt with the staged input: the projection GEMM's workspace.
    pub projection_ws: Option<Region>,
    /// Staged chunked: the per-pass projection rows `[4H, C]` f16, then their biases.
    pub pass_weights: Option<Region>,
    /// Where the per-pass biases `[4H]` f32 start in `pass_weights`.
    pub pass_bias_offset: usize,
    /// rocBLAS: the ones vector of af3's bias GEMMs.
    pub ones: Option<Region>,

    /// Bytes of [`Buffer::T`].
    pub t_bytes: usize,
    /// Bytes of [`Buffer::Left`] and of [`Buffer::Right`] each (0: a chunked plan).
    pub left_bytes: usize,
    /// Bytes of [`Buffer::Gate`] (0: none).
    pub gate_bytes: usize,
    /// Bytes of [`Buffer::Projection`] (0: none).
    pub projection_bytes: usize,
    /// Bytes of [`Buffer::Scratch`] (0: none).
    pub scratch_bytes: usize,
    /// Bytes of [`Buffer::PassWeights`] (0: none).
    pub pass_weights_bytes: usize,
    /// Bytes of [`Buffer::GemmWorkspace`] (0: none).
    pub gemm_ws_bytes: usize,
    /// Bytes of [`Buffer::Ones`] (0: none).
    pub ones_bytes: usize,
}

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

/// `bytes` rounded up to [`REGION_ALIGN`].
fn aligned(bytes: usize) -> usize {
    align_up(bytes, REGION_ALIGN)
}

impl Plan {
    /// The fields every plan of `problem` shares, with nothing allocated yet.
    fn base(problem: &Problem, caps: Capabilities) -> Result<Plan> {
        let cfg = problem.config;
        let rows = problem.shape.rows();
        let none = Region::new(Buffer::Scratch, 0, 0);
        Ok(Plan {
            caps,
            rows,
            c: cfg.c,
            h: cfg.h,
            g: cfg.gate_width(),
            p: cfg.fused_proj_width(),
            af3: cfg.formulation == Formulation::Af3,
            in_place: problem.in_place,
            y_bytes: mul(&[rows, cfg.c, problem.io.io_bytes()])?,
            hidden_chunk: cfg.h,
            input_rows: rows,
            output_rows: rows,
            gate_from_x: false,
            left: none,
            right: none,
            gate: None,
            z: None,
            proj: None,
            a: none,
            contraction_ws: None,
            output_ws: None,
            projection_ws: None,
            pass_weights: None,
            pass_bias_offset: 0,
            ones: None,
            t_bytes: mul(&[rows, cfg.h, 2])?,
            left_bytes: 0,
            gate_bytes: 0,
            projection_bytes: 0,
            scratch_bytes: 0,
            pass_weights_bytes: 0,
            gemm_ws_bytes: 0,
            ones_bytes: 0,
        })
    }

    /// The one-pass plan. `gate_from_x`: the output stage makes the gate from x (only the fused
    /// input stage leaves it out; a backend asks for it where its output kernel can).
    pub fn one_pass(problem: &Problem, caps: Capabilities, gate_from_x: bool) -> Result<Plan> {
        let mut plan = Plan::base(problem, caps)?;
        let (rows, g) = (plan.rows, plan.g);
        let lr = plan.t_bytes;
        plan.left_bytes = lr;
        plan.left = Region::new(Buffer::Left, 0, lr);
        plan.right = Region::new(Buffer::Right, 0, lr);
        // After the contraction left is dead: LN_H(t) goes there.
        plan.a = Region::new(Buffer::Left, 0, lr);
        plan.gate_from_x = gate_from_x && caps.input == InputStage::Fused;
        if !plan.gate_from_x {
            plan.gate_bytes = mul(&[rows, g, 2])?;
            plan.gate = Some(Region::new(Buffer::Gate, 0, plan.gate_bytes));
        }
        match (caps.input, caps.blas) {
            (_, Blas::CublasLt) => {
                // y is dead until the output stage and right after the contraction: they lend
                // the two GEMMs their workspaces.
                plan.contraction_ws = Some(Region::new(Buffer::Y, 0, plan.y_bytes));
                plan.output_ws = Some(Region::new(Buffer::Right, 0, lr));
                if caps.input == InputStage::Staged {
                    plan.stage_in_t_cublas();
                }
            }
            (InputStage::Staged, Blas::RocBlas) => plan.stage_in_t_rocblas(),
            (InputStage::Fused, Blas::RocBlas) => {}
        }
        if caps.blas == Blas::RocBlas && plan.af3 {
            plan.ones_bytes = mul(&[rows, 4])?;
            plan.ones = Some(Region::new(Buffer::Ones, 0, plan.ones_bytes));
        }
        Ok(plan)
    }

    /// cuBLASLt's staged one-pass input: row chunks as large as t's natural size allows, less an
    /// eighth of it (at most 8 MiB) for the projection GEMM's workspace, z, proj and that
    /// workspace inside t; tiny problems grow t to fit one row.
    fn stage_in_t_cublas(&mut self) {
        let (m, c, p) = (self.rows, self.c, self.p);
        let natural = self.t_bytes;
        let ws = ((natural / 8).min(8 << 20) / 256) * 256;
        let row_bytes = (c + p) * 2;
        let mut chunk_rows = ((natural - ws) / row_bytes).min(m).max(1);
        if chunk_rows >= 64 && chunk_rows < m {
            // Chunks start 64-aligned so the gating kernel's tiles keep their 16-byte stores.
            chunk_rows -= chunk_rows % 64;
        }
        let proj_offset = aligned(chunk_rows * c * 2);
        let ws_offset = proj_offset + aligned(chunk_rows * p * 2);
        self.t_bytes = natural.max(ws_offset + ws);
        self.input_rows = chunk_rows;
        self.z = Some(Region::new(Buffer::T, 0, chunk_rows * c * 2));
        self.proj = Some(Region::new(Buffer::T, proj_offset, chunk_rows * p * 2));
        self.projection_ws = Some(Region::new(Buffer::T, ws_offset, self.t_bytes - ws_offset));
    }

    /// rocBLAS's staged one-pass input: z and proj inside t (idle until the contraction) in
    /// chunks of at least [`ROCBLAS_MIN_INPUT_ROWS`] positions, or, for small problems or where
    /// such a chunk does not fit t, in a staging buffer of their own.
    fn stage_in_t_rocblas(&mut self) {
        let (rows, c, p) = (self.rows, self.c, self.p);
        let per_row = 2 * (c + p);
        let (chunk_rows, in_t) = if rows <= ROCBLAS_MIN_INPUT_ROWS {
            (rows, false)
        } else {
            let in_t = (self.t_bytes.saturating_sub(REGION_ALIGN) / per_row) / STAGED_ROW_STEP * STAGED_ROW_STEP;
            if in_t >= ROCBLAS_MIN_INPUT_ROWS {
                (in_t.min(rows), true)
            } else {
                (ROCBLAS_MIN_INPUT_ROWS, false)
            }
        };
        let proj_offset = aligned(chunk_rows * c * 2);
        let buffer = if in_t { Buffer::T } else { Buffer::Projection };
        if !in_t {
            self.projection_bytes = proj_offset + chunk_rows * p * 2;
        }
        self.input_rows = chunk_rows;
        self.z = Some(Region::new(buffer, 0, chunk_rows * c * 2));
        self.proj = Some(Region::new(buffer, proj_offset, chunk_rows * p * 2));
    }

    /// The chunked plan with `hc` hidden channels per pass and row chunks of `chunk_rows`
    /// positions (both clamped to the problem).
    pub fn chunked(problem: &Problem, caps: Capabilities, hc: usize, chunk_rows: usize) -> Result<Plan> {
        let mut plan = Plan::base(problem, caps)?;
        let (rows, c, h, g) = (plan.rows, plan.c, plan.h, plan.g);
        let hc = hc.min(h).max(1);
        let chunk_rows = chunk_rows.clamp(1, rows.max(1));
        plan.hidden_chunk = hc;
        plan.output_rows = chunk_rows;
        plan.gate_from_x = true;
        let lr_bytes = aligned(mul(&[rows, hc, 2])?);
        let lr_in_y = !problem.in_place && 2 * lr_bytes <= plan.y_bytes;
        let (lr_buffer, lr_at) = if lr_in_y { (Buffer::Y, 0) } else { (Buffer::Scratch, 0) };
        match caps.input {
            InputStage::Fused => {
                // Phase A: left/right (unless in y), cuBLASLt's contraction workspace. Phase B:
                // the gate and a of one row chunk, cuBLASLt's output-GEMM workspace (rocBLAS
                // needs neither workspace, and af3's bias update a vector of ones).
                let cublas = caps.blas == Blas::CublasLt;
                let lr_end = if lr_in_y { 0 } else { 2 * lr_bytes };
                let cws = if cublas { aligned((rows * hc / 2).min(MAX_GEMM_WORKSPACE)) } else { 0 };
                let gate_bytes = aligned(chunk_rows * g * 2);
                let a_bytes = aligned(chunk_rows * h * 2);
                let ows = if cublas { aligned((chunk_rows * h / 2).min(8 << 20)) } else { 0 };
                plan.left = Region::new(lr_buffer, lr_at, lr_bytes);
                plan.right = Region::new(lr_buffer, lr_at + lr_bytes, lr_bytes);
                plan.gate = Some(Region::new(Buffer::Scratch, 0, gate_bytes));
                plan.a = Region::new(Buffer::Scratch, gate_bytes, a_bytes);
                plan.scratch_bytes = (lr_end + cws).max(gate_bytes + a_bytes + ows);
                if cublas {
                    plan.contraction_ws = Some(Region::new(Buffer::Scratch, lr_end, cws));
                    plan.output_ws = Some(Region::new(Buffer::Scratch, gate_bytes + a_bytes, ows));
                } else if plan.af3 {
                    plan.ones_bytes = chunk_rows * 4;
                    plan.ones = Some(Region::new(Buffer::Ones, 0, plan.ones_bytes));
                }
            }
            InputStage::Staged => {
                // Phase A `[z | proj | left | right]`, phase B `[z | proj | gate | a]`.
                plan.input_rows = chunk_rows;
                let z = aligned(mul(&[chunk_rows, c, 2])?);
                let lr_off = z + aligned(mul(&[chunk_rows, 4 * hc, 2])?);
                let phase_a = lr_off + if lr_in_y { 0 } else { 2 * lr_bytes };
                let proj_b = aligned(mul(&[chunk_rows, g, 2])?);
                let gate_off = z + proj_b;
                let a_off = gate_off + aligned(mul(&[chunk_rows, g, 2])?);
                let phase_b = a_off + aligned(mul(&[chunk_rows, h, 2])?);
                let lr_at = if lr_in_y { 0 } else { lr_off };
                plan.z = Some(Region::new(Buffer::Scratch, 0, chunk_rows * c * 2));
                // Phase A's proj `[rows, 4·hc]`; phase B's `[rows, G]` starts there too and ends
                // before the gate (at `gate.offset`).
                plan.proj = Some(Region::new(Buffer::Scratch, z, lr_off - z));
                plan.left = Region::new(lr_buffer, lr_at, lr_bytes);
                plan.right = Region::new(lr_buffer, lr_at + lr_bytes, lr_bytes);
                plan.gate = Some(Region::new(Buffer::Scratch, gate_off, chunk_rows * g * 2));
                plan.a = Region::new(Buffer::Scratch, a_off, chunk_rows * h * 2);
                plan.scratch_bytes = phase_a.max(phase_b);
                plan.pass_bias_offset = aligned(mul(&[4, h, c, 2])?);
                plan.pass_weights_bytes = plan.pass_bias_offset + 4 * h * 4;
                plan.pass_weights = Some(Region::new(Buffer::PassWeights, 0, plan.pass_weights_bytes));
                match caps.blas {
                    Blas::CublasLt => {
                        // At most 4 MiB, and no more than one chunk of z, so that the narrowest
                        // plans of small problems stay small.
                        plan.gemm_ws_bytes = aligned((chunk_rows * c * 2).min(4 << 20));
                        let ws = Region::new(Buffer::GemmWorkspace, 0, plan.gemm_ws_bytes);
                        plan.projection_ws = Some(ws);
                        plan.contraction_ws = Some(ws);
                        plan.output_ws = Some(ws);
                    }
                    Blas::RocBlas if plan.af3 => {
                        plan.ones_bytes = chunk_rows * 4;
                        plan.ones = Some(Region::new(Buffer::Ones, 0, plan.ones_bytes));
                    }
                    Blas::RocBlas => {}
                }
            }
        }
        Ok(plan)
    }

    /// The narrowest chunked plan: the fewest channels per pass and the shortest row chunk the
    /// input stage takes.
    pub fn narrowest(problem: &Problem, caps: Capabilities) -> Result<Plan> {
        let (channels, rows) = Plan::granularity(caps);
        Plan::chunked(problem, caps, channels, problem.shape.rows().min(rows))
    }

    /// The widest chunked plan whose workspace fits `limit` bytes ([`super::budget::widest_fit`]),
    /// or `None`.
    pub fn widest_chunked(problem: &Problem, caps: Capabilities, limit: u64) -> Result<Option<Plan>> {
        let (channels, rows) = Plan::granularity(caps);
        let fit = super::budget::widest_fit(
            problem.config.h,
            channels,
            problem.shape.rows(),
            rows,
            MAX_CHUNK_ROWS,
            limit,
            |hc, rows| Plan::chunked(problem, caps, hc, rows).map_or(u64::MAX, |p| p.workspace_bytes()),
        );
        fit.map(|(hc, rows)| Plan::chunked(problem, caps, hc, rows)).transpose()
    }

    /// The granularity of hidden passes and row chunks of a backend's plans.
    fn granularity(caps: Capabilities) -> (usize, usize) {
        match (caps.input, caps.blas) {
            (InputStage::Fused, Blas::CublasLt) => (FUSED_CHANNEL_STEP, FUSED_ROW_STEP),
            _ => (STAGED_CHANNEL_STEP, STAGED_ROW_STEP),
        }
    }

    /// The address of `region`, given where each buffer starts (`base`: the caller's y for
    /// [`Buffer::Y`], the workspace's allocations for the others).
    pub fn address(region: Region, base: impl Fn(Buffer) -> u64) -> u64 {
        region.at(base(region.buffer))
    }

    /// `region`, or the error naming what this plan lacks (a backend ran a plan of another
    /// kind than the one it was made for).
    pub fn require(region: Option<Region>, what: &str) -> Result<Region> {
        region.ok_or_else(|| Error::Internal(format!("the plan has no {what}")))
    }

    /// Bytes of `buffer` (0: the plan has none; the caller's y is not the workspace's).
    pub fn buffer_bytes(&self, buffer: Buffer) -> usize {
        match buffer {
            Buffer::T => self.t_bytes,
            Buffer::Left | Buffer::Right => self.left_bytes,
            Buffer::Gate => self.gate_bytes,
            Buffer::Projection => self.projection_bytes,
            Buffer::Scratch => self.scratch_bytes,
            Buffer::PassWeights => self.pass_weights_bytes,
            Buffer::GemmWorkspace => self.gemm_ws_bytes,
            Buffer::Ones => self.ones_bytes,
            Buffer::Y => 0,
        }
    }

    /// Every buffer the workspace allocates, in a fixed order.
    pub const BUFFERS: [Buffer; 9] = [
        Buffer::Left,
        Buffer::Right,
        Buffer::Gate,
        Buffer::T,
        Buffer::Projection,
        Buffer::Scratch,
        Buffer::PassWeights,
        Buffer::GemmWorkspace,
        Buffer::Ones,
    ];

    /// Bytes of the whole workspace: every buffer.
    pub fn workspace_bytes(&self) -> u64 {
        Plan::BUFFERS.iter().map(|&b| self.buffer_bytes(b) as u64).sum()
    }

    /// Whether this is the one-pass plan (left and right for every channel in buffers of their
    /// own). A chunked plan may also run H channels in one hidden pass.
    pub fn is_one_pass(&self) -> bool {
        self.left.buffer == Buffer::Left
    }

    /// Whether left and right of a pass live in the caller's y.
    pub fn left_right_in_y(&self) -> bool {
        self.left.buffer == Buffer::Y
    }

    /// The hidden passes: `(first channel, channels)`.
    pub fn passes(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.h).step_by(self.hidden_chunk).map(|h0| (h0, self.hidden_chunk.min(self.h - h0)))
    }

    /// The input stage's row chunks: `(first position, positions)`.
    pub fn input_chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.rows).step_by(self.input_rows.max(1)).map(|r0| (r0, self.input_rows.min(self.rows - r0)))
    }

    /// The output stage's row chunks: `(first position, positions)`.
    pub fn output_chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.rows).step_by(self.output_rows.max(1)).map(|r0| (r0, self.output_rows.min(self.rows - r0)))
    }

    /// How a staged chunked plan's `pass_weights` are filled from the prepared `[P, C]` weights
    /// (and `[P]` biases): for each pass and each of its four gated projections,
    /// `(destination row, source row, rows)`, a row being C halves (or one f32 bias). Pass
    /// `(h0, hn)` holds `[lp; lg; rp; rg]` rows `h0 .. h0 + hn` at rows `4·h0 ..`, so its
    /// projection is one GEMM and `input_gating` sees H = hn.
    pub fn pass_row_copies(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let h = self.h;
        self.passes().flat_map(move |(h0, hn)| (0..4).map(move |part| (4 * h0 + part * hn, part * h + h0, hn)))
    }

    /// Whether a workspace made for this plan serves `problem` on a backend with `caps`: the
    /// same buffers and regions (left and right inside y need room for them in y's I/O
    /// precision).
    pub fn serves(&self, problem: &Problem, caps: Capabilities) -> bool {
        let cfg = problem.config;
        self.caps == caps
            && self.rows == problem.shape.rows()
            && (self.c, self.h, self.g, self.p) == (cfg.c, cfg.h, cfg.gate_width(), cfg.fused_proj_width())
            && self.af3 == (cfg.formulation == Formulation::Af3)
            && self.in_place == problem.in_place
            && (!self.left_right_in_y()
                || problem.shape.rows().saturating_mul(cfg.c).saturating_mul(problem.io.io_bytes()) >= self.right.end())
    }

    /// The report on this plan.
    pub fn summary(&self) -> super::budget::ExecPlan {
        super::budget::ExecPlan {
            hidden_chunk: self.hidden_chunk,
            hidden_passes: self.h.div_ceil(self.hidden_chunk.max(1)),
            output_rows: self.output_rows,
            gate_recomputed: self.gate_from_x,
            workspace_bytes: self.workspace_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Config, Direction, Precision, Shape};

    const ALL_CAPS: [Capabilities; 4] = [
        Capabilities { input: InputStage::Fused, blas: Blas::CublasLt },
        Capabilities { input: InputStage::Staged, blas: Blas::CublasLt },
        Capabilities { input: InputStage::Staged, blas: Blas::RocBlas },
        Capabilities { input: InputStage::Fused, blas: Blas::RocBlas },
    ];

    fn problem(f: Formulation, b: usize, n: usize, c: usize, h: usize) -> Problem {
        Problem::new(Config::new(f, c, h).unwrap(), Shape::new(b, n), Direction::Outgoing, false).unwrap()
    }

    /// Every region lies inside its buffer (y: the caller's, of `y_bytes`); regions of the
    /// scratch live at the same time do not overlap (phase A: z, proj, left, right and the
    /// contraction's workspace; phase B: z, proj, gate, a and the output GEMM's workspace);
    /// passes and row chunks cover every channel and position once, chunks starting at the
    /// input stage's row step.
    fn assert_consistent(p: &Problem, plan: &Plan) {
        let what = format!("{p:?}: {plan:?}");
        let (m, h) = (p.shape.rows(), p.config.h);
        let size = |b: Buffer| if b == Buffer::Y { plan.y_bytes } else { plan.buffer_bytes(b) };
        let regions = [
            Some(plan.left),
            Some(plan.right),
            plan.gate,
            plan.z,
            plan.proj,
            Some(plan.a),
            plan.contraction_ws,
            plan.output_ws,
            plan.projection_ws,
            plan.pass_weights,
            plan.ones,
        ];
        for r in regions.into_iter().flatten() {
            assert!(r.end() <= size(r.buffer), "{what}: {r:?} outside its buffer");
            assert!(r.offset % REGION_ALIGN == 0 || r.buffer == Buffer::Y, "{what}: {r:?} unaligned");
        }
        assert!(
            plan.left.bytes >= m * plan.hidden_chunk * 2 && plan.right.bytes >= m * plan.hidden_chunk * 2,
            "{what}"
        );
        if plan.left_right_in_y() {
            assert!(!p.in_place, "{what}: left/right in y, which is x in place");
        }
        let disjoint = |set: &[Option<Region>]| {
            let set: Vec<Region> = set.iter().flatten().copied().filter(|r| r.bytes > 0).collect();
            for (i, a) in set.iter().enumerate() {
                for b in &set[i + 1..] {
                    let apart = a.buffer != b.buffer || a.end() <= b.offset || b.end() <= a.offset;
                    // cuBLASLt's staged GEMMs share one workspace buffer: never two at once.
                    let shared_ws = a.buffer == Buffer::GemmWorkspace && b.buffer == Buffer::GemmWorkspace;
                    assert!(apart || shared_ws, "{what}: {a:?} overlaps {b:?}");
                }
            }
        };
        disjoint(&[plan.z, plan.proj, Some(plan.left), Some(plan.right), plan.contraction_ws, plan.projection_ws]);
        if !plan.is_one_pass() {
            // Phase B's proj `[rows, G]` starts where phase A's does.
            let proj_b = plan.proj.map(|r| Region::new(r.buffer, r.offset, plan.output_rows * plan.g * 2));
            disjoint(&[plan.z, proj_b, plan.gate, Some(plan.a), plan.output_ws]);
        }
        let mut next = 0;
        for (h0, n) in plan.passes() {
            assert!(h0 == next && n >= 1 && n <= plan.hidden_chunk, "{what}");
            next += n;
        }
        assert_eq!(next, h, "{what}");
        for chunks in [plan.input_chunks().collect::<Vec<_>>(), plan.output_chunks().collect()] {
            let mut next = 0;
            for (r0, rows) in chunks {
                assert!(r0 == next && rows >= 1, "{what}");
                next += rows;
            }
            assert_eq!(next, m, "{what}");
        }
        if plan.caps.input == InputStage::Staged || plan.caps.blas == Blas::RocBlas {
            // The stage kernels store runs of 8 positions (16 bytes) where a tile starts
            // 8-aligned, else one by one: chunks of 64 positions or more start 64-aligned (HIP's
            // fused plans run them on the row chunks of the rocBLAS output path).
            if plan.input_rows >= STAGED_ROW_STEP {
                assert!(plan.input_chunks().all(|(r0, _)| r0 % STAGED_ROW_STEP == 0), "{what}");
            }
            if !plan.is_one_pass() {
                assert!(plan.output_chunks().all(|(r0, _)| r0 % STAGED_ROW_STEP == 0), "{what}");
            }
        }
        if plan.is_one_pass() && m >= 4096 {
            // No staging grows t beyond the contraction's output: the memory bound holds.
            assert_eq!(plan.t_bytes, m * h * 2, "{what}");
        }
        assert!(plan.serves(p, plan.caps), "{what}");
        assert_eq!(plan.summary().workspace_bytes, plan.workspace_bytes());
    }

    /// Small shapes both plan-consistency tests start from, `(formulation, B, N, C, H, in place)`:
    /// both formulations, in place and not, C above and below H, odd sizes.
    const SMALL: [(Formulation, usize, usize, usize, usize, bool); 4] = [
        (Formulation::GpuMode, 2, 10, 32, 24, false),
        (Formulation::Af3, 2, 10, 16, 24, true),
        (Formulation::Af3, 1, 33, 384, 128, false),
        (Formulation::GpuMode, 3, 7, 5, 3, true),
    ];

    #[test]
    fn every_plan_keeps_its_regions_apart_and_covers_the_problem() {
        for (f, b, n, c, h, in_place) in SMALL.into_iter().chain([
            (Formulation::GpuMode, 1, 1, 768, 128, false),
            (Formulation::GpuMode, 1, 300, 128, 128, false),
            (Formulation::Af3, 1, 100, 4096, 8, false),
            // Left and right fill f32 y exactly in the narrowest plan, so not 16-bit y.
            (Formulation::GpuMode, 1, 16, 8, 32, false),
        ]) {
            for io in [Precision::F32Io, Precision::Bf16Io] {
                let p = problem(f, b, n, c, h).in_place(in_place).with_io(io);
                for caps in ALL_CAPS {
                    for from_x in [false, true] {
                        assert_consistent(&p, &Plan::one_pass(&p, caps, from_x).unwrap());
                    }
                    assert_consistent(&p, &Plan::narrowest(&p, caps).unwrap());
                    assert_consistent(&p, &Plan::chunked(&p, caps, 16, 128).unwrap());
                    assert_consistent(&p, &Plan::chunked(&p, caps, h, 1 << 20).unwrap());
                }
            }
        }
    }

    #[test]
    fn chunked_plans_fit_their_limits_and_shrink_with_them() {
        for (f, b, n, c, h, in_place) in SMALL
            .into_iter()
            .chain([(Formulation::Af3, 2, 33, 64, 40, true), (Formulation::Af3, 1, 48, 128, 128, false)])
        {
            let p = problem(f, b, n, c, h).in_place(in_place);
            for caps in ALL_CAPS {
                let narrowest = Plan::narrowest(&p, caps).unwrap();
                let one_pass = Plan::one_pass(&p, caps, false).unwrap();
                if p.shape.rows() >= 1024 {
                    // Below that, the per-pass weights and 256-byte alignment can outweigh the saving.
                    assert!(narrowest.workspace_bytes() < one_pass.workspace_bytes(), "{p:?} {caps:?}");
                }
                let mut last = u64::MAX;
                for extra in [1u64 << 40, 1 << 24, 1 << 20, 1 << 14, 1 << 10, 0] {
                    let limit = narrowest.workspace_bytes() + extra;
                    let plan = Plan::widest_chunked(&p, caps, limit).unwrap().expect("the narrowest plan fits");
                    assert_consistent(&p, &plan);
                    assert!(plan.workspace_bytes() <= limit && plan.workspace_bytes() <= last, "{p:?} {caps:?}");
                    last = plan.workspace_bytes();
                }
                assert_eq!(Plan::widest_chunked(&p, caps, narrowest.workspace_bytes() - 1).unwrap(), None);
            }
        }
    }

    #[test]
    fn long_sequences_fit_an_h100_an_mi250_and_an_mi300x() {
        let gb = 1_000_000_000u64;
        let fused = Capabilities { input: InputStage::Fused, blas: Blas::CublasLt };
        let rocm = Capabilities { input: InputStage::Staged, blas: Blas::RocBlas };
        let long = |n: usize, in_place: bool| problem(Formulation::GpuMode, 1, n, 128, 128).in_place(in_place);
        // N = 4096 in 24 GB: x + y take 17.18 GB; left/right go into y, so one hidden pass fits.
        for caps in [fused, rocm] {
            let p = long(4096, false);
            let plan = Plan::widest_chunked(&p, caps, 24 * gb - p.io_device_bytes() - (1 << 20)).unwrap().unwrap();
            assert_consistent(&p, &plan);
            assert_eq!((plan.hidden_chunk, plan.left_right_in_y()), (128, true));
            assert_eq!(plan.output_rows, MAX_CHUNK_ROWS);
        }
        // N = 8192 in place on an 80 GB H100 (79 GB free, 2% margin): 64 channels per pass.
        let p = long(8192, true);
        let plan = Plan::widest_chunked(&p, fused, 79 * gb - 79 * gb / 50 - p.io_device_bytes()).unwrap().unwrap();
        assert_consistent(&p, &plan);
        assert_eq!((plan.hidden_chunk, plan.left_right_in_y()), (64, false));
        // The same on a 64 GB MI250X GCD: x/y alone take 34.4 GB; fewer channels per pass, with
        // the stage kernels or the fused MFMA kernel, which needs no more (no z, proj or copies).
        let fused_rocm = Capabilities { input: InputStage::Fused, blas: Blas::RocBlas };
        for caps in [rocm, fused_rocm] {
            let plan = Plan::widest_chunked(&p, caps, 64 * gb - p.io_device_bytes() - gb).unwrap().unwrap();
            assert_consistent(&p, &plan);
            assert!(!plan.left_right_in_y() && plan.hidden_chunk < 128, "{plan:?}");
        }
        for q in [long(8192, true), long(1000, true), long(1000, false)] {
            let staged = Plan::narrowest(&q, rocm).unwrap().workspace_bytes();
            assert!(Plan::narrowest(&q, fused_rocm).unwrap().workspace_bytes() <= staged, "{q:?}");
        }
    }

    #[test]
    fn a_plan_serves_only_the_problems_it_was_made_for() {
        let caps = Capabilities { input: InputStage::Staged, blas: Blas::RocBlas };
        let p = problem(Formulation::GpuMode, 1, 48, 128, 128);
        let plan = Plan::narrowest(&p, caps).unwrap();
        assert!(plan.left_right_in_y() && plan.serves(&p, caps));
        // Another shape, the other formulation (af3's bias GEMMs need the ones vector), another
        // backend, in place (x is read by every pass: left and right cannot sit in it).
        assert!(!plan.serves(&problem(Formulation::GpuMode, 1, 40, 128, 128), caps));
        assert!(!plan.serves(&problem(Formulation::Af3, 1, 48, 128, 128), caps));
        assert!(!plan.serves(&p, Capabilities { input: InputStage::Staged, blas: Blas::CublasLt }));
        assert!(!plan.serves(&p.in_place(true), caps));
        // Left and right fill f32 y exactly here: 16-bit y has room for half of them.
        let tight = problem(Formulation::GpuMode, 1, 16, 8, 32);
        let plan = Plan::narrowest(&tight, caps).unwrap();
        assert!(plan.left_right_in_y() && plan.serves(&tight, caps));
        assert!(!plan.serves(&tight.with_io(Precision::Bf16Io), caps));
    }

    #[test]
    fn pass_copies_place_every_gated_row_once() {
        let p = problem(Formulation::Af3, 1, 8, 16, 40);
        let caps = Capabilities { input: InputStage::Staged, blas: Blas::RocBlas };
        let plan = Plan::chunked(&p, caps, 16, 64).unwrap();
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

/// The plans chosen before the one plan type existed (the four types it replaced, at commit
/// b018ae5), for problems from a single position to N = 8192 and limits from the narrowest plan
/// to none: every choice and byte count must stay as it was, since a different chunking or
/// cuBLASLt workspace gives different bits.
#[cfg(test)]
mod pinned {
    use super::*;
    use crate::problem::{Config, Direction, Precision, Shape};

    #[test]
    fn plans_are_those_chosen_before_the_one_plan_type() {
        let fused = Capabilities { input: InputStage::Fused, blas: Blas::CublasLt };
        let cublas = Capabilities { input: InputStage::Staged, blas: Blas::CublasLt };
        let rocblas = Capabilities { input: InputStage::Staged, blas: Blas::RocBlas };
        let cases = [
            (Formulation::GpuMode, 1, 1, 768, 128, false, Precision::F32Io),
            (Formulation::Af3, 1, 33, 128, 128, false, Precision::F32Io),
            (Formulation::Af3, 2, 33, 64, 40, true, Precision::F32Io),
            (Formulation::GpuMode, 2, 256, 128, 128, false, Precision::Bf16Io),
            (Formulation::GpuMode, 1, 1024, 384, 128, true, Precision::F32Io),
            (Formulation::Af3, 1, 1024, 768, 128, false, Precision::Bf16Io),
            (Formulation::GpuMode, 1, 4096, 128, 128, false, Precision::F32Io),
            (Formulation::GpuMode, 1, 8192, 128, 128, true, Precision::Bf16Io),
        ];
        let mut lines = Vec::new();
        for (i, &(f, b, n, c, h, in_place, io)) in cases.iter().enumerate() {
            let p = Problem::new(Config::new(f, c, h).unwrap(), Shape::new(b, n), Direction::Outgoing, true)
                .unwrap()
                .in_place(in_place)
                .with_io(io);
            let one = Plan::one_pass(&p, cublas, false).unwrap();
            lines.push(format!("CASE {i} cublas_one_pass input_rows={} t_bytes={}", one.input_rows, one.t_bytes));
            let narrowest = |caps| Plan::narrowest(&p, caps).unwrap().workspace_bytes();
            for extra in [0u64, 1 << 20, 1 << 26, 1 << 32, u64::MAX / 4] {
                for (name, caps) in [("fused", fused), ("staged_cublas", cublas), ("staged_rocblas", rocblas)] {
                    if let Some(q) = Plan::widest_chunked(&p, caps, narrowest(caps) + extra).unwrap() {
                        lines.push(format!(
                            "CASE {i} {name} {extra} hc={} out_rows={} t={} scratch={} bytes={}",
                            q.hidden_chunk,
                            q.output_rows,
                            q.t_bytes,
                            q.scratch_bytes,
                            q.workspace_bytes()
                        ));
                    }
                }
            }
            let one = Plan::one_pass(&p, rocblas, false).unwrap();
            lines.push(format!(
                "CASE {i} rocblas_one_pass input_rows={} in_t={} bytes={}",
                one.input_rows,
                one.z.unwrap().buffer == Buffer::T,
                one.workspace_bytes()
            ));
        }
        let before: Vec<&str> = include_str!("testdata/plans-b018ae5.txt").lines().collect();
        assert_eq!(lines.len(), before.len());
        for (now, then) in lines.iter().zip(&before) {
            assert_eq!(now, then);
        }
    }
}
