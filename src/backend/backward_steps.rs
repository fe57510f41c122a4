//! The backward pass's steps, written once for the GPU backends that run it (CUDA around
//! cuBLASLt, HIP around rocBLAS): every kernel launch and GEMM of one backward with its addresses
//! resolved, over buffers laid out in one span ([`BackwardBuffers`]), checked on the host. A
//! backend runs the list in order with its own launches and BLAS calls; `docs/backward.md`
//! derives the math, `common/backward.h` has the kernels.
//!
//! # Steps (`M = B·N²` positions, `F = 4H + G`; gpumode's differences in brackets)
//! ```text
//!  1 input_norm        z = LN_C(x), (μ, ρ)_x                    [M, C]
//!  2 GEMM              P = z·Wcatᵀ                              [M, F]
//!  3 gating            left, right                              [B, H, N²]
//!  4 GEMM (B·H)        t = contraction(left, right)             [B, H, N²]
//!  5 output_norm       u = LN_H(t), (μ, ρ)_t   [v = u⊙σ(P_G)]   [M, H]
//!  6 GEMM              s = u·Wzᵀ               [dWout = dyᵀ·v]
//!  7 output_gate       ds, dG                  [GEMM dv = dy·Wout; output_gate: du, dG]
//!  8 GEMM              dWz = dsᵀ·u; Σ ds → dbz [Σ dy → dbout]
//!  9 GEMM              du = ds·Wz
//! 10 output_norm_grad dt (over t); Σ du⊙t̂ → dγ_out, Σ du → dβ_out
//! 11 GEMM (B·H)        dleft, dright (over u and du)
//! 12 gating_grad       dcat[:, :4H] (dcat over P, column by column: output_gate writes dG over
//!                      P_G, gating_grad the rest over P's first 4H columns)
//! 13 GEMM              dWcat = dcatᵀ·z; Σ dcat → dbcat
//! 14 GEMM              dz = dcat·Wcat (over z)
//! 15 input_norm_grad   dx; Σ dz⊙x̂ → dγ_in, Σ dz → dβ_in
//! ```
//! Before them, the prepared f16 weights are converted for the GEMMs (`convert`), and gpumode's
//! 16-bit dy to f32. Where [`fuses_output_side`] (CUDA, af3, 16-bit I/O, C and H up to 128),
//! steps 5-10 are one kernel, [`BackwardKernel::OutputSide`] (`cuda/backward_output.cu`): dt over
//! t, dG over P_G, the column sums of γ, β and bz, and bf16 ds and u for the one GEMM left,
//! dWz = dsᵀ·u. Where [`vector_gating`] (CUDA, 16-bit I/O, H and F multiples of 8, N² of 64),
//! steps 3 and 12 are CUDA's 16-byte-vector kernels ([`BackwardKernel::GatingVec`],
//! [`BackwardKernel::GatingGradVec`], `cuda/backward_gating.cu`), with the same inputs and
//! outputs.
//!
//! # Precision and memory
//! The kernels compute in f32. With f32 I/O every intermediate is f32 and the GEMMs read and
//! write f32 (each backend says in what precision its BLAS computes them: TF32 on CUDA). With
//! 16-bit I/O (bf16 or f16 x, dy and dx, read and written as they are) the input side and the
//! contraction are 16-bit, with f32 accumulation in every GEMM:
//! - z, P, left, right and t, the forward's values, in f16, as the forward keeps them (LN_C
//!   bounds them; f16 rounds 8× finer than bf16): P = z·Wcatᵀ on the prepared f16 Wcat itself,
//!   t = contraction(left, right) in f16;
//! - dt and dcat, gradients, in bf16 (f32's range), with bf16 copies of z, left and right for the
//!   GEMMs that multiply them with a gradient (dWcat, dz on Wcat converted to bf16, and the
//!   contraction's backward, whose dleft and dright come out in f32);
//! - u, s/ds (v), du, dleft, dright, dz and the statistics in f32, the output side's GEMMs TF32:
//!   every bf16 rounding on a gradient's path adds about 2e-3 to its relative error.
//!
//! The column sums are f64 in a fixed order: the bias sums (skipped for biases the layer lacks)
//! in f64 from the start, per row block then across blocks; the LayerNorm-weight sums f32 per
//! warp inside the LayerNorm backward kernels, then f64. The weight gradients' sums over all `M`
//! positions run in about [`WEIGHT_CHUNKS`] chunks of one strided batch, their f32 partials
//! added in f64. Every intermediate is a whole tensor, the later ones over earlier ones that are
//! dead by then: about `(C + F + 5H + max(C, H))·4` bytes per position with f32 I/O and
//! `(C + 4H + max(C, H))·4 + (F + H)·2` with 16-bit (6 KiB and 4.5 KiB at C = H = 128; gpumode
//! adds an f32 copy of a 16-bit dy), nothing chunked; x, dy and dx are the caller's.

#![forbid(unsafe_code)]

#[cfg(doc)]
use super::backward_params::WEIGHT_CHUNKS;
use super::backward_params::{
    acc_smem, chunk_rows, io_code, mid_bytes, output_norm_grad_smem, BackwardParams, ColumnSums, Convert, Outputs,
    GATING_SMEM, GATING_VEC_ROWS, GATING_VEC_SMEM, MAX_ROW_BLOCKS, OUTPUT_SIDE_ROWS, OUTPUT_SIDE_SMEM, PARTIALS_SMEM,
    ROWS_PER_BLOCK, THREADS, TILE, WARPS,
};
use super::caller_workspace::SpanCarver;
use super::gemm::GemmSpec;
use crate::problem::{Direction, Formulation, Precision, Problem};

/// One backward's device tensors, as addresses into one span (each 256-byte aligned, in the order
/// of [`BackwardBuffers::new`]). What each holds is in the module docs' step list.
#[derive(Clone)]
pub(crate) struct BackwardBuffers {
    /// The kernels' intermediates, in the fields of their argument struct (`z` … `du` and
    /// `partial`, the f64 partial sums of the column sums; dcat goes over p, dz over z and its
    /// bf16 copy); its other fields are zero.
    pub(crate) tensors: BackwardParams,
    /// The weights converted for the GEMMs: Wcat `[F, C]` (f32, or bf16 with 16-bit I/O, for
    /// dz = dcat·Wcat) and Wout `[C, H]` (f32).
    pub(crate) widened: [u64; 2],
    /// gpumode's 16-bit dy converted to f32 `[M, C]` for its GEMMs (else 0).
    pub(crate) dy_f32: u64,
    /// The weight gradients' per-chunk f32 sums, `[chunks + 1, widest weight]`.
    pub(crate) weight_partial: u64,
    /// The weight gradients, at [`Outputs`]' offsets (f32).
    pub(crate) sums: u64,
    /// The GEMMs' workspace, where the backend's BLAS takes one from the caller (else 0).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // rocBLAS keeps its own
    pub(crate) gemm_ws: u64,
    /// Every buffer a step writes, `(address, bytes)`: what poisoning fills with NaN.
    pub(crate) written: Vec<(u64, u64)>,
    /// The bytes the buffers span from the first.
    pub(crate) bytes: u64,
}

impl BackwardBuffers {
    /// The buffers of `problem`'s backward laid out from `base`, with `gemm_ws` bytes of GEMM
    /// workspace at the end (0: none).
    pub(crate) fn new(problem: &Problem, gemm_ws: u64, base: u64) -> BackwardBuffers {
        let cfg = problem.config;
        let m = problem.shape.rows();
        let (c, h, f) = (cfg.c, cfg.h, cfg.fused_proj_width());
        let widest = (f * c).max(c * h);
        let chunks = m / chunk_rows(m) + 1;
        let out = Outputs::new(c, h, f);
        let mut span = SpanCarver::default();
        let mut written = Vec::new();
        let mut a = |elements: usize, size: usize| {
            let bytes = (elements * size) as u64;
            let at = base + span.carve(bytes, |at| at);
            written.push((at, bytes));
            at
        };
        let e = mid_bytes(problem.io);
        let sixteen = problem.io != Precision::F32Io;
        // z, left and right: f32, or with 16-bit I/O f16 and a bf16 copy side by side in the same
        // bytes. z's block holds the f32 dz at the end (dead once dWcat has read z).
        let (z, left, right) = (a(m * c, 4), a(m * h, 4), a(m * h, 4));
        let copy = |at: u64, elements: usize| if sixteen { at + (elements * 2) as u64 } else { 0 };
        let mut tensors = BackwardParams {
            z,
            z_bf16: copy(z, m * c),
            stats_x: a(2 * m, 4),
            p: a(m * f, e),
            left,
            right,
            t: a(m * h, e),
            u: a(m * h, 4),
            left_bf16: copy(left, m * h),
            right_bf16: copy(right, m * h),
            stats_t: a(2 * m, 4),
            e: a(m * c.max(h), 4),
            du: a(m * h, 4),
            dz: z,
            ..BackwardParams::default()
        };
        let (widened, weight_partial, sums) = ([a(f * c, e), a(c * h, 4)], a(chunks * widest, 4), a(out.len, 4));
        tensors.partial = a((MAX_ROW_BLOCKS * f.max(2 * c).max(2 * h)).max(widest), 8);
        // gpumode's dy feeds TF32 GEMMs: a 16-bit dy needs an f32 copy.
        let gpumode = cfg.formulation == Formulation::GpuMode;
        let dy_f32 = if gpumode && sixteen { a(m * c, 4) } else { 0 };
        tensors.dcat = tensors.p;
        let gemm_ws = if gemm_ws > 0 { base + span.carve(gemm_ws, |at| at) } else { 0 };
        BackwardBuffers { tensors, widened, dy_f32, weight_partial, sums, gemm_ws, written, bytes: span.end() }
    }
}

/// The prepared weights a backward reads (device addresses; 0: an absent bias) and which linear
/// layers have a bias, in [`Weights::linears`](crate::Weights::linears) order.
#[derive(Copy, Clone, Debug)]
pub(crate) struct BackwardWeights {
    /// The f16 fused input projections `[F, C]` and the output projection `[C, H]`.
    pub(crate) w: [u64; 2],
    /// The LayerNorms' f32 weight and bias: the input's `[C]`, then the output's `[H]`.
    pub(crate) norms: [u64; 4],
    /// The f32 biases of the fused input projections `[F]` and of the output projection `[C]`.
    pub(crate) bias: [u64; 2],
    pub(crate) biases: [bool; 6],
}

/// How many blocks of a kernel are resident at once on a device: `shared` bytes of shared
/// memory (LDS) per multiprocessor (CU), `units` of them, at most 8 blocks of [`THREADS`] each;
/// whether the backend runs the output side as one kernel ([`BackwardKernel::OutputSide`],
/// CUDA's, where a block may take [`OUTPUT_SIDE_SMEM`]), and whether it has the 16-byte-vector
/// gating kernels ([`BackwardKernel::GatingVec`], CUDA's).
#[derive(Copy, Clone, Debug)]
pub(crate) struct Residency {
    pub(crate) shared: usize,
    pub(crate) units: usize,
    pub(crate) output_side: bool,
    pub(crate) vector_gating: bool,
}

impl Residency {
    /// Blocks of a LayerNorm backward kernel (blocks that loop over positions, each with its
    /// accumulators): as many as fit at once with `smem` bytes each, at most `work` and at most
    /// [`MAX_ROW_BLOCKS`] (the partial sums' rows).
    fn blocks(self, smem: usize, work: usize) -> usize {
        let per_unit = (self.shared / smem.max(1)).clamp(1, 8);
        (per_unit * self.units.max(1)).min(MAX_ROW_BLOCKS).min(work).max(1)
    }
}

/// Whether `problem`'s output side runs as CUDA's one kernel ([`BackwardKernel::OutputSide`]):
/// where the device has it, for af3 with 16-bit I/O, C and H multiples of 16 up to 128 (its
/// tiles), N² a multiple of its 64-position tile (no tile crosses a batch), and `dy` 16-byte
/// aligned (it is read 16 bytes at a time).
pub(crate) fn fuses_output_side(problem: &Problem, dy: u64, device: Residency) -> bool {
    let (cfg, n) = (problem.config, problem.shape.n);
    device.output_side
        && cfg.formulation == Formulation::Af3
        && problem.io != Precision::F32Io
        && cfg.c % 16 == 0
        && cfg.c <= 128
        && cfg.h % 16 == 0
        && cfg.h <= 128
        && (n * n) % OUTPUT_SIDE_ROWS == 0
        && dy % 16 == 0
}

/// Whether `problem`'s two gating steps run as CUDA's 16-byte-vector kernels
/// ([`BackwardKernel::GatingVec`], [`BackwardKernel::GatingGradVec`]): where the device has them,
/// with 16-bit I/O (P in f16, dcat in bf16), H and `F = 4H + G` multiples of 8 (P's rows and
/// their gated columns 16-byte aligned), and N² a multiple of their 64-position tile (no tile
/// crosses a batch).
pub(crate) fn vector_gating(problem: &Problem, device: Residency) -> bool {
    let (cfg, n) = (problem.config, problem.shape.n);
    device.vector_gating
        && problem.io != Precision::F32Io
        && cfg.h % 8 == 0
        && cfg.fused_proj_width() % 8 == 0
        && (n * n) % GATING_VEC_ROWS == 0
}

/// The kernels of `common/backward.h`, CUDA's fused output side (`cuda/backward_output.cu`) and
/// CUDA's vector gating kernels (`cuda/backward_gating.cu`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum BackwardKernel {
    InputNorm,
    Gating,
    OutputNorm,
    OutputGate,
    OutputNormGrad,
    GatingGrad,
    InputNormGrad,
    ColumnPartials,
    ColumnFinish,
    Convert,
    /// CUDA only: LN_H, the output projection and gate, and their backward in one kernel, for
    /// af3 with 16-bit I/O ([`fuses_output_side`]); one entry point for bf16 and f16.
    OutputSide,
    /// CUDA only: [`BackwardKernel::Gating`] and [`BackwardKernel::GatingGrad`] with 16-bit I/O
    /// in 16-byte vectors and 64-position tiles ([`vector_gating`]); the same values.
    GatingVec,
    GatingGradVec,
}

impl BackwardKernel {
    /// Every portable kernel (both backends'), in declaration order.
    pub(crate) const ALL: [BackwardKernel; 10] = [
        BackwardKernel::InputNorm,
        BackwardKernel::Gating,
        BackwardKernel::OutputNorm,
        BackwardKernel::OutputGate,
        BackwardKernel::OutputNormGrad,
        BackwardKernel::GatingGrad,
        BackwardKernel::InputNormGrad,
        BackwardKernel::ColumnPartials,
        BackwardKernel::ColumnFinish,
        BackwardKernel::Convert,
    ];

    /// Whether the kernel has a second entry point for 16-bit I/O (`<entry>_16`, its own kernel so
    /// that one precision's code does not add to the other's registers): the seven per-position
    /// kernels, whose argument is a `BackwardParams`.
    pub(crate) fn has_16(self) -> bool {
        !matches!(
            self,
            BackwardKernel::ColumnPartials
                | BackwardKernel::ColumnFinish
                | BackwardKernel::Convert
                | BackwardKernel::OutputSide
                | BackwardKernel::GatingVec
                | BackwardKernel::GatingGradVec
        )
    }

    /// Every entry point, `(kernel, 16-bit)`: the ten kernels' f32 ones in [`BackwardKernel::ALL`]'s
    /// order, then the seven 16-bit ones. A backend keeps them in an array in this order
    /// ([`BackwardKernel::index`]).
    pub(crate) fn entries() -> impl Iterator<Item = (BackwardKernel, bool)> {
        let sixteen = BackwardKernel::ALL.into_iter().filter(|k| k.has_16()).map(|k| (k, true));
        BackwardKernel::ALL.into_iter().map(|k| (k, false)).chain(sixteen)
    }

    /// CUDA's own kernels, in their order after [`BackwardKernel::entries`]'.
    const CUDA_ONLY: [BackwardKernel; 3] =
        [BackwardKernel::OutputSide, BackwardKernel::GatingVec, BackwardKernel::GatingGradVec];

    /// CUDA's entry points: [`BackwardKernel::entries`], then those of its own kernels.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn cuda_entries() -> impl Iterator<Item = (BackwardKernel, bool)> {
        BackwardKernel::entries().chain(BackwardKernel::CUDA_ONLY.into_iter().map(|k| (k, false)))
    }

    /// The place of an entry point in [`BackwardKernel::cuda_entries`]' order, which begins with
    /// [`BackwardKernel::entries`]' (a kernel without a 16-bit one has its f32 one there).
    pub(crate) fn index(self, sixteen: bool) -> usize {
        // The kernels with a 16-bit entry point come first in `ALL`.
        if let Some(at) = BackwardKernel::CUDA_ONLY.iter().position(|&k| k == self) {
            BackwardKernel::entries().count() + at
        } else if sixteen && self.has_16() {
            BackwardKernel::ALL.len() + self as usize
        } else {
            self as usize
        }
    }

    /// The name of an entry point.
    pub(crate) fn entry_name(self, sixteen: bool) -> String {
        if sixteen && self.has_16() {
            format!("{}_16", self.entry())
        } else {
            self.entry().to_string()
        }
    }

    /// The kernel's f32 entry point.
    pub(crate) fn entry(self) -> &'static str {
        match self {
            BackwardKernel::InputNorm => "backward_input_norm",
            BackwardKernel::Gating => "backward_gating",
            BackwardKernel::OutputNorm => "backward_output_norm",
            BackwardKernel::OutputGate => "backward_output_gate",
            BackwardKernel::OutputNormGrad => "backward_output_norm_grad",
            BackwardKernel::GatingGrad => "backward_gating_grad",
            BackwardKernel::InputNormGrad => "backward_input_norm_grad",
            BackwardKernel::ColumnPartials => "backward_column_partials",
            BackwardKernel::ColumnFinish => "backward_column_finish",
            BackwardKernel::Convert => "backward_convert",
            BackwardKernel::OutputSide => "backward_output_side",
            BackwardKernel::GatingVec => "backward_gating_vec",
            BackwardKernel::GatingGradVec => "backward_gating_grad_vec",
        }
    }

    /// The kernel file (stage) that holds it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn stage(self) -> &'static str {
        match self {
            BackwardKernel::OutputSide => "backward_output",
            BackwardKernel::GatingVec | BackwardKernel::GatingGradVec => "backward_gating",
            _ => "backward",
        }
    }

    /// Whether its dynamic shared memory grows with C or H (a tile of t, or per-warp sums) past
    /// what a block gets without opting in: `TM_BWD_T_SMEM(H)`, `TM_BWD_T_ACC_SMEM(H)`,
    /// `TM_BWD_ACC_SMEM(C)`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // HIP's kernels take their LDS as declared
    pub(crate) fn large_smem(self) -> bool {
        matches!(
            self,
            BackwardKernel::OutputNorm
                | BackwardKernel::OutputNormGrad
                | BackwardKernel::InputNormGrad
                | BackwardKernel::OutputSide
        )
    }
}

/// The one argument struct a kernel takes.
// The per-position kernels' struct is 264 bytes, the others' under 50: a backward's list holds a
// few dozen steps, built once per call, so boxing the large one would only add allocations.
#[allow(clippy::large_enum_variant)]
#[derive(Copy, Clone)]
pub(crate) enum KernelArgs {
    Backward(BackwardParams),
    ColumnSums(ColumnSums),
    Convert(Convert),
}

/// The element type of a GEMM's operands, or of its result; it accumulates in f32 either way (on
/// tensor cores: TF32 for f32 operands).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum GemmElem {
    F32,
    F16,
    Bf16,
}

impl GemmElem {
    pub(crate) fn bytes(self) -> usize {
        match self {
            GemmElem::F32 => 4,
            GemmElem::F16 | GemmElem::Bf16 => 2,
        }
    }
}

/// One operation of a backward, every address resolved.
#[derive(Copy, Clone)]
pub(crate) enum BackwardStep {
    /// A launch of `grid` blocks of [`THREADS`] threads with `smem` bytes of dynamic shared memory,
    /// of the kernel's 16-bit entry point when `sixteen` ([`BackwardKernel::has_16`]).
    Launch { kernel: BackwardKernel, sixteen: bool, grid: usize, smem: usize, args: KernelArgs },
    /// A row-major GEMM `D = op(U)·op(V)` ([`GemmSpec::row_major`]: A = V, B = U), U and V in
    /// `inputs`, D in `output`.
    Gemm { spec: GemmSpec, u: u64, v: u64, d: u64, inputs: GemmElem, output: GemmElem },
    /// The steps before this one are the named stage (a backend's timeline may mark it).
    Mark(#[cfg_attr(not(feature = "cuda"), allow(dead_code))] &'static str),
}

/// The backward of `problem` as steps, on the caller's `x`, `mask` (0: none), `dy` and `dx`
/// (`[M, C]` in `problem.io`, the mask `[M]` f32), the weights `w` and the buffers `b`: the
/// weight gradients land in `b.sums` at [`Outputs`]' offsets.
pub(crate) fn steps(
    problem: &Problem,
    w: &BackwardWeights,
    (x, mask, dy, dx): (u64, u64, u64, u64),
    b: &BackwardBuffers,
    device: Residency,
) -> Vec<BackwardStep> {
    let cfg = problem.config;
    let (c, h, f) = (cfg.c, cfg.h, cfg.fused_proj_width());
    let out = Outputs::new(c, h, f);
    let (n, m) = (problem.shape.n, problem.shape.rows());
    let (n2, bh) = (n * n, problem.shape.batch * h);
    let af3 = cfg.formulation == Formulation::Af3;
    let p = BackwardParams {
        x,
        dy,
        mask,
        norm_in_w: w.norms[0],
        norm_in_b: w.norms[1],
        norm_out_w: w.norms[2],
        norm_out_b: w.norms[3],
        proj_bias: w.bias[0],
        out_bias: w.bias[1],
        dx,
        rows: m as i64,
        n2: n2 as i64,
        c: c as i32,
        h: h as i32,
        f: f as i32,
        af3: i32::from(af3),
        eps: problem.eps,
        blocks: 0,
        io: io_code(problem.io),
        w_out: w.w[1],
        ..b.tensors
    };
    // z, P, left, right and t (`fw`), and dt and dcat (`b16`), and the GEMMs on them: f32, or with
    // 16-bit I/O f16 and bf16; a GEMM of a gradient and z, left or right reads its bf16 copy. The
    // output side stays f32 (TF32 GEMMs).
    let sixteen = problem.io != Precision::F32Io;
    let (fw, b16) = if sixteen { (GemmElem::F16, GemmElem::Bf16) } else { (GemmElem::F32, GemmElem::F32) };
    let copy = |value: u64, bf16: u64| if sixteen { bf16 } else { value };
    let (z_g, left_g, right_g) = (copy(p.z, p.z_bf16), copy(p.left, p.left_bf16), copy(p.right, p.right_bf16));
    // Wcat as P's GEMM reads it (with 16-bit I/O, the prepared f16 one itself).
    let [w_cat, w_out] = b.widened;
    let w_cat_f = if sixteen { w.w[0] } else { w_cat };
    let code = |g: GemmElem| match g {
        GemmElem::F32 => io_code(Precision::F32Io),
        GemmElem::F16 => io_code(Precision::F16Io),
        GemmElem::Bf16 => io_code(Precision::Bf16Io),
    };
    let (f32_, f32_code) = (GemmElem::F32, code(GemmElem::F32));
    let threads = THREADS as usize;
    let t_smem = h * (TILE + 1) * 4;
    let out_grad_smem = output_norm_grad_smem(h);
    let out_grad_blocks = device.blocks(out_grad_smem, m.div_ceil(TILE));
    let in_grad_blocks = device.blocks(acc_smem(c), m.div_ceil(WARPS));
    let warp_rows = m.div_ceil(ROWS_PER_BLOCK);
    let tiles = m.div_ceil(TILE);
    let rm = GemmSpec::row_major;
    let mut s = Vec::new();
    let launch = |s: &mut Vec<BackwardStep>, kernel: BackwardKernel, grid, smem, p: BackwardParams| {
        let sixteen = sixteen && kernel.has_16();
        s.push(BackwardStep::Launch { kernel, sixteen, grid, smem, args: KernelArgs::Backward(p) })
    };
    let gemm = |s: &mut Vec<BackwardStep>, spec, u, v, d, inputs, output| {
        s.push(BackwardStep::Gemm { spec, u, v, d, inputs, output })
    };
    let column_sums = |s: &mut Vec<BackwardStep>, sums: ColumnSums, partials_grid: Option<usize>| {
        if let Some(grid) = partials_grid {
            let args = KernelArgs::ColumnSums(sums);
            s.push(BackwardStep::Launch {
                kernel: BackwardKernel::ColumnPartials,
                sixteen: false,
                grid,
                smem: PARTIALS_SMEM as usize,
                args,
            });
        }
        let (grid, args) = ((sums.cols as usize).div_ceil(threads), KernelArgs::ColumnSums(sums));
        s.push(BackwardStep::Launch { kernel: BackwardKernel::ColumnFinish, sixteen: false, grid, smem: 0, args });
    };
    // Σ over `rows` rows of `a` (in `dtype`, leading dimension `ld`) of `cols` columns into
    // `sums[to..]`.
    let column_sum_of =
        |s: &mut Vec<BackwardStep>, (a, dtype): (u64, i32), rows: usize, cols: usize, ld: usize, to: usize| {
            let row_blocks = rows.div_ceil(256).clamp(1, MAX_ROW_BLOCKS);
            let sums = ColumnSums {
                a,
                partial: p.partial,
                out: b.sums + (to * 4) as u64,
                rows: rows as i64,
                cols: cols as i32,
                ld: ld as i32,
                row_blocks: row_blocks as i32,
                dtype,
            };
            column_sums(s, sums, Some(row_blocks * cols.div_ceil(32)));
        };
    let column_sum = |s: &mut Vec<BackwardStep>, a: (u64, i32), cols: usize, ld: usize, to: usize| {
        column_sum_of(s, a, m, cols, ld, to)
    };
    // Per-block sums of `cols` columns (from `partial` + `skip` f64s) into `to`: the LayerNorm
    // backward kernels' [γ | β], 2w columns.
    let finish_at = |s: &mut Vec<BackwardStep>, blocks: usize, cols: usize, skip: usize, to: usize| {
        let sums = ColumnSums {
            a: 0,
            partial: p.partial + (skip * 8) as u64,
            out: b.sums + (to * 4) as u64,
            rows: 0,
            cols: cols as i32,
            ld: 0,
            row_blocks: blocks as i32,
            dtype: f32_code,
        };
        column_sums(s, sums, None);
    };
    let finish = |s: &mut Vec<BackwardStep>, blocks: usize, w: usize, to: usize| finish_at(s, blocks, 2 * w, 0, to);
    // dW[wa, wb] = Σ_r U[r, :wa]ᵀ·V[r, :wb] over all M rows (U, V position-major with leading
    // dimensions lu, lv, both in `inputs`), in chunks of `rows`
    // positions: one strided batch of GEMMs for the whole chunks and one GEMM for the rest, each
    // into its own f32 partial, summed in f64.
    let weight_grad = |s: &mut Vec<BackwardStep>,
                       (u, wa, lu): (u64, usize, usize),
                       (v, wb, lv): (u64, usize, usize),
                       inputs: GemmElem,
                       to| {
        let e = inputs.bytes();
        let rows = chunk_rows(m);
        let (whole, rest) = (m / rows, m % rows);
        let part = b.weight_partial;
        let spec = rm(wa, wb, rows, (true, lu), (false, lv), wb);
        let batched = GemmSpec {
            batch: whole,
            stride_a: if whole > 1 { rows * lv } else { 0 },
            stride_b: if whole > 1 { rows * lu } else { 0 },
            stride_d: if whole > 1 { wa * wb } else { 0 },
            ..spec
        };
        gemm(s, batched, u, v, part, inputs, f32_);
        if rest > 0 {
            let (at_u, at_v) = ((whole * rows * lu * e) as u64, (whole * rows * lv * e) as u64);
            let tail = rm(wa, wb, rest, (true, lu), (false, lv), wb);
            gemm(s, tail, u + at_u, v + at_v, part + (whole * wa * wb * 4) as u64, inputs, f32_);
        }
        column_sum_of(s, (part, f32_code), whole + usize::from(rest > 0), wa * wb, wa * wb, to)
    };
    let f16_code = io_code(Precision::F16Io);
    // The fused output side reads the prepared f16 Wz itself; the separate steps an f32 copy.
    let fused = fuses_output_side(problem, dy, device);
    let mut converts = vec![(w.w[0], f16_code, w_cat, code(b16), f * c)];
    if !fused {
        converts.push((w.w[1], f16_code, w_out, f32_code, c * h));
    }
    // gpumode's dy feeds two TF32 GEMMs: a 16-bit dy through an f32 copy.
    let dy_f32 = if b.dy_f32 != 0 { b.dy_f32 } else { dy };
    if b.dy_f32 != 0 {
        converts.push((dy, p.io, b.dy_f32, f32_code, m * c));
    }
    for (src, from, dst, to, len) in converts {
        let args = KernelArgs::Convert(Convert { src, dst, n: len as i64, from, to });
        let grid = len.div_ceil(threads);
        s.push(BackwardStep::Launch { kernel: BackwardKernel::Convert, sixteen: false, grid, smem: 0, args });
    }
    let outgoing = problem.direction == Direction::Outgoing;
    s.push(BackwardStep::Mark("start"));

    // 1-5: the forward, recomputed, keeping what the backward reads.
    launch(&mut s, BackwardKernel::InputNorm, warp_rows, 0, p);
    gemm(&mut s, rm(m, f, c, (false, c), (true, c), f), p.z, w_cat_f, p.p, fw, fw);
    s.push(BackwardStep::Mark("LN_C and the input projection"));
    // The gating steps' kernels: CUDA's vector ones where they apply, else the portable ones.
    let vec_tiles = m / GATING_VEC_ROWS;
    let (gating, gating_grad, gating_grid, gating_smem) = if vector_gating(problem, device) {
        (BackwardKernel::GatingVec, BackwardKernel::GatingGradVec, vec_tiles, GATING_VEC_SMEM)
    } else {
        (BackwardKernel::Gating, BackwardKernel::GatingGrad, tiles, GATING_SMEM as usize)
    };
    launch(&mut s, gating, gating_grid, gating_smem, p);
    s.push(BackwardStep::Mark("gating"));
    // Outgoing t = L·Rᵀ, incoming t = Lᵀ·R, per (b, h).
    let square = |u_t: bool, v_t: bool| rm(n, n, n, (u_t, n), (v_t, n), n).batched(bh, n2);
    gemm(&mut s, square(!outgoing, outgoing), p.left, p.right, p.t, fw, fw);
    s.push(BackwardStep::Mark("contraction"));
    let out_bias = w.biases[5];
    if fused {
        // 5-10 in one kernel: dt over t, dG over P_G, and bf16 ds (in e) and u for dWz.
        let per_unit = (device.shared / OUTPUT_SIDE_SMEM).clamp(1, 2);
        let grid = (per_unit * device.units.max(1)).min(m / OUTPUT_SIDE_ROWS).clamp(1, MAX_ROW_BLOCKS);
        let fused = BackwardParams { blocks: grid as i32, ..p };
        s.push(BackwardStep::Launch {
            kernel: BackwardKernel::OutputSide,
            sixteen: false,
            grid,
            smem: OUTPUT_SIDE_SMEM,
            args: KernelArgs::Backward(fused),
        });
        finish(&mut s, grid, h, out.norm_out_w);
        if out_bias {
            finish_at(&mut s, grid, c, grid * 2 * h, out.b_out);
        }
        weight_grad(&mut s, (p.e, c, c), (p.u, h, h), GemmElem::Bf16, out.w_out);
        s.push(BackwardStep::Mark("output side (fused)"));
    } else {
        launch(&mut s, BackwardKernel::OutputNorm, tiles, t_smem, p);
        s.push(BackwardStep::Mark("LN_H"));
        // 6-9: the output projection and gate.
        if af3 {
            gemm(&mut s, rm(m, c, h, (false, h), (true, h), c), p.u, w_out, p.e, f32_, f32_);
            launch(&mut s, BackwardKernel::OutputGate, (m * c).div_ceil(threads), 0, p);
            weight_grad(&mut s, (p.e, c, c), (p.u, h, h), f32_, out.w_out);
            if out_bias {
                column_sum(&mut s, (p.e, f32_code), c, c, out.b_out);
            }
            gemm(&mut s, rm(m, h, c, (false, c), (false, h), h), p.e, w_out, p.du, f32_, f32_);
        } else {
            weight_grad(&mut s, (dy_f32, c, c), (p.e, h, h), f32_, out.w_out);
            if out_bias {
                column_sum(&mut s, (dy, p.io), c, c, out.b_out);
            }
            gemm(&mut s, rm(m, h, c, (false, c), (false, h), h), dy_f32, w_out, p.du, f32_, f32_);
            launch(&mut s, BackwardKernel::OutputGate, (m * h).div_ceil(threads), 0, p);
        }
        s.push(BackwardStep::Mark("output projection and gate backward"));

        // 10: LN_H.
        let blocks = BackwardParams { blocks: out_grad_blocks as i32, ..p };
        launch(&mut s, BackwardKernel::OutputNormGrad, out_grad_blocks, out_grad_smem, blocks);
        finish(&mut s, out_grad_blocks, h, out.norm_out_w);
        s.push(BackwardStep::Mark("LN_H backward"));
    }

    // 11: the contraction. Outgoing dL = dT·R, dR = dTᵀ·L; incoming dL = R·dTᵀ, dR = L·dT.
    // dleft and dright go where u and du were (dead after LN_H's backward).
    let dt = p.t;
    let (dleft, dright) = (p.u, p.du);
    if outgoing {
        gemm(&mut s, square(false, false), dt, right_g, dleft, b16, f32_);
        gemm(&mut s, square(true, false), dt, left_g, dright, b16, f32_);
    } else {
        gemm(&mut s, square(false, true), right_g, dt, dleft, b16, f32_);
        gemm(&mut s, square(false, false), left_g, dt, dright, b16, f32_);
    }
    s.push(BackwardStep::Mark("contraction backward"));

    // 12-15: the input projections and LN_C.
    let grads = BackwardParams { left: dleft, right: dright, ..p };
    launch(&mut s, gating_grad, gating_grid, gating_smem, grads);
    s.push(BackwardStep::Mark("gating backward"));
    weight_grad(&mut s, (p.dcat, f, f), (z_g, c, c), b16, out.w_cat);
    if w.biases[..5].iter().any(|&b| b) {
        column_sum(&mut s, (p.dcat, code(b16)), f, f, out.b_cat);
    }
    s.push(BackwardStep::Mark("input weight gradients"));
    gemm(&mut s, rm(m, c, f, (false, f), (false, c), c), p.dcat, w_cat, p.dz, b16, f32_);
    s.push(BackwardStep::Mark("dz = dcat·Wcat"));
    let blocks = BackwardParams { blocks: in_grad_blocks as i32, ..p };
    launch(&mut s, BackwardKernel::InputNormGrad, in_grad_blocks, acc_smem(c), blocks);
    finish(&mut s, in_grad_blocks, c, out.norm_in_w);
    s.push(BackwardStep::Mark("LN_C backward"));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Config, Shape};

    /// Every address a step reads or writes lies inside one buffer (the caller's tensors, the
    /// prepared weights, or a buffer of the span), every GEMM's operands and result included;
    /// the column sums write each weight gradient the layer has exactly once and nothing else of
    /// `sums`; the LayerNorm backward kernels' block counts match their grids. The backends run
    /// exactly this list, so its addresses are right before any device runs them.
    #[test]
    fn steps_stay_inside_their_buffers_and_write_every_gradient_once() {
        // Each tensor far from the others.
        let [x, mask_at, dy, dx, w_in, w_out, span] = std::array::from_fn::<u64, 7, _>(|i| (i as u64 + 1) << 40);
        let (f32_, bf16, f16) = (Precision::F32Io, Precision::Bf16Io, Precision::F16Io);
        for (f, batch, n, c, h, dir, biases, masked, io) in [
            (Formulation::Af3, 1, 9, 16, 24, Direction::Outgoing, true, true, f32_),
            (Formulation::Af3, 2, 7, 24, 8, Direction::Incoming, false, false, f32_),
            (Formulation::GpuMode, 1, 12, 32, 16, Direction::Incoming, false, true, f32_),
            (Formulation::GpuMode, 3, 5, 8, 40, Direction::Outgoing, true, false, f32_),
            // Enough positions for whole chunks and a rest in the weight gradients' sums.
            (Formulation::Af3, 1, 130, 8, 8, Direction::Outgoing, true, false, f32_),
            // 16-bit I/O: the input side and the contraction 16-bit; gpumode's dy converted to f32.
            (Formulation::Af3, 1, 130, 8, 8, Direction::Outgoing, true, false, bf16),
            (Formulation::Af3, 2, 7, 24, 8, Direction::Incoming, false, true, f16),
            (Formulation::GpuMode, 3, 5, 8, 40, Direction::Outgoing, true, false, bf16),
            // CUDA's fused output side: af3, 16-bit, C and H multiples of 16, N² of 64.
            (Formulation::Af3, 1, 16, 32, 16, Direction::Outgoing, true, true, bf16),
            (Formulation::Af3, 2, 8, 16, 48, Direction::Incoming, false, false, f16),
        ] {
            let cfg = Config::new(f, c, h).unwrap();
            let problem = Problem::new(cfg, Shape::new(batch, n), dir, masked).unwrap().with_io(io);
            let (xe, e) = (io.io_bytes(), mid_bytes(io));
            let what = format!("{problem:?} biases={biases}");
            let (m, fw) = (problem.shape.rows(), cfg.fused_proj_width());
            let out = Outputs::new(c, h, fw);
            let b = BackwardBuffers::new(&problem, 4096, span);
            let biases6 = [biases, false, biases, false, false, biases];
            // Distinct addresses for the LayerNorm parameters and biases, so that a swap shows.
            let (norms, bias) = ([11, 12, 13, 14].map(|k: u64| k << 40), [15u64 << 40, 16 << 40]);
            let w = BackwardWeights { w: [w_in, w_out], norms, bias, biases: biases6 };
            let mask = if masked { mask_at } else { 0 };
            let mut regions = vec![
                (x, (m * c * xe) as u64),
                (mask_at, if masked { (m * 4) as u64 } else { 0 }),
                (dy, (m * c * xe) as u64),
                (dx, (m * c * xe) as u64),
                (w_in, (fw * c * 2) as u64),
                (w_out, (c * h * 2) as u64),
            ];
            regions.extend(b.written.iter().copied());
            let inside = |addr: u64, len: u64, name: &str| {
                let ok = regions.iter().any(|&(at, size)| addr >= at && addr + len <= at + size);
                assert!(len == 0 || ok, "{what}: {name} [{addr:#x}, +{len}) outside every buffer");
            };
            let matrix = |rows: usize, cols: usize, ld: usize| ((cols.max(1) - 1) * ld + rows) as u64;
            let mut sums_written = vec![0u32; out.len];
            let device = Residency { shared: 233472, units: 4, output_side: true, vector_gating: true };
            let fused = fuses_output_side(&problem, dy, device);
            assert_eq!(fused, f == Formulation::Af3 && io != f32_ && c % 16 == 0 && n % 8 == 0, "{what}");
            let vec = vector_gating(&problem, device);
            assert_eq!(vec, io != f32_ && h % 8 == 0 && fw % 8 == 0 && n % 8 == 0, "{what}");
            let (mut fused_launches, mut gating_kernels) = (0, Vec::new());
            for step in steps(&problem, &w, (x, mask, dy, dx), &b, device) {
                match step {
                    BackwardStep::Gemm { spec, u, v, d, inputs, output } => {
                        let (si, so) = (inputs.bytes() as u64, output.bytes() as u64);
                        // With f32 I/O every GEMM is f32.
                        assert!(io != f32_ || (si, so) == (4, 4), "{what}: a 16-bit GEMM with f32 I/O");
                        let batched = |one: u64, stride: usize, e| e * ((spec.batch as u64 - 1) * stride as u64 + one);
                        let ((ar, ac), (br, bc)) = (spec.a_dims(), spec.b_dims());
                        inside(v, batched(matrix(ar, ac, spec.lda), spec.stride_a, si), "GEMM V");
                        inside(u, batched(matrix(br, bc, spec.ldb), spec.stride_b, si), "GEMM U");
                        inside(d, batched(matrix(spec.m, spec.n, spec.ldd), spec.stride_d, so), "GEMM D");
                    }
                    BackwardStep::Launch { kernel, sixteen, grid, smem, args } => {
                        assert_eq!(sixteen, kernel.has_16() && io != f32_, "{what}: {kernel:?}'s entry point");
                        let most = if kernel == BackwardKernel::OutputSide { OUTPUT_SIDE_SMEM } else { 65536 };
                        assert!(grid >= 1 && smem <= most, "{what}: {kernel:?} grid {grid} smem {smem}");
                        match args {
                            KernelArgs::Convert(a) => {
                                let size = |code: i32| if code == 0 { 4 } else { 2 };
                                inside(a.src, a.n as u64 * size(a.from), "convert src");
                                inside(a.dst, a.n as u64 * size(a.to), "convert dst");
                                assert_eq!(grid, (a.n as usize).div_ceil(THREADS as usize), "{what}");
                            }
                            KernelArgs::ColumnSums(a) => {
                                let cols = a.cols as usize;
                                inside(a.out, cols as u64 * 4, "column sums out");
                                inside(a.partial, (a.row_blocks as usize * cols * 8) as u64, "partials");
                                if kernel == BackwardKernel::ColumnPartials {
                                    let size = if a.dtype == 0 { 4 } else { 2 };
                                    inside(a.a, size * matrix(cols, a.rows as usize, a.ld as usize), "column sums a");
                                } else {
                                    let at = ((a.out - b.sums) / 4) as usize;
                                    for k in &mut sums_written[at..at + cols] {
                                        *k += 1;
                                    }
                                }
                            }
                            KernelArgs::Backward(p) => {
                                if matches!(
                                    kernel,
                                    BackwardKernel::OutputNormGrad
                                        | BackwardKernel::InputNormGrad
                                        | BackwardKernel::OutputSide
                                ) {
                                    assert_eq!(p.blocks as usize, grid, "{what}: {kernel:?}");
                                    assert!(grid <= MAX_ROW_BLOCKS, "{what}");
                                }
                                if matches!(
                                    kernel,
                                    BackwardKernel::Gating
                                        | BackwardKernel::GatingGrad
                                        | BackwardKernel::GatingVec
                                        | BackwardKernel::GatingGradVec
                                ) {
                                    // One block per tile, every position covered.
                                    let rows = if vec { GATING_VEC_ROWS } else { TILE };
                                    assert_eq!(grid, m.div_ceil(rows), "{what}: {kernel:?}");
                                    gating_kernels.push(kernel);
                                }
                                if kernel == BackwardKernel::OutputSide {
                                    // Its per-block sums: [grid][2H], then [grid][C].
                                    fused_launches += 1;
                                    inside(p.partial, (grid * (2 * h + c) * 8) as u64, "output side's partial");
                                    inside(p.w_out, (c * h * 2) as u64, "w_out");
                                    assert_eq!(p.w_out, w_out, "{what}");
                                    assert!(grid <= m / OUTPUT_SIDE_ROWS, "{what}");
                                }
                                let weights = [p.norm_in_w, p.norm_in_b, p.norm_out_w, p.norm_out_b];
                                assert_eq!((weights, [p.proj_bias, p.out_bias]), (norms, bias), "{what}: {kernel:?}");
                                assert_eq!((p.x, p.mask, p.dy, p.dx), (x, mask, dy, dx), "{what}: {kernel:?}");
                                assert_eq!(p.io, io_code(io), "{what}: {kernel:?}");
                                for (addr, len, name) in [
                                    (p.x, m * c * xe, "x"),
                                    (p.dx, m * c * xe, "dx"),
                                    (p.z, m * c * e, "z"),
                                    (p.z_bf16, if io == f32_ { 0 } else { m * c * 2 }, "z_bf16"),
                                    (p.stats_x, 2 * m * 4, "stats_x"),
                                    (p.p, m * fw * e, "p"),
                                    (p.left, m * h * e, "left"),
                                    (p.right, m * h * e, "right"),
                                    (p.t, m * h * e, "t"),
                                    (p.u, m * h * 4, "u"),
                                    (p.left_bf16, if io == f32_ { 0 } else { m * h * 2 }, "left_bf16"),
                                    (p.right_bf16, if io == f32_ { 0 } else { m * h * 2 }, "right_bf16"),
                                    (p.stats_t, 2 * m * 4, "stats_t"),
                                    (p.e, m * c.max(h) * 4, "e"),
                                    (p.du, m * h * 4, "du"),
                                    (p.dz, m * c * 4, "dz"),
                                    (p.partial, MAX_ROW_BLOCKS * fw.max(2 * c).max(2 * h) * 8, "partial"),
                                ] {
                                    inside(addr, len as u64, name);
                                }
                            }
                        }
                    }
                    BackwardStep::Mark(_) => {}
                }
            }
            assert_eq!(fused_launches, usize::from(fused), "{what}");
            let want = if vec {
                [BackwardKernel::GatingVec, BackwardKernel::GatingGradVec]
            } else {
                [BackwardKernel::Gating, BackwardKernel::GatingGrad]
            };
            assert_eq!(gating_kernels, want, "{what}");
            let mut want = vec![0u32; out.len];
            let input_bias = w.biases[..5].iter().any(|&b| b);
            for (at, len, on) in [
                (out.w_cat, fw * c, true),
                (out.b_cat, fw, input_bias),
                (out.norm_in_w, 2 * c, true),
                (out.w_out, c * h, true),
                (out.b_out, c, biases),
                (out.norm_out_w, 2 * h, true),
            ] {
                want[at..at + len].fill(u32::from(on));
            }
            assert_eq!(sums_written, want, "{what}: the gradients the column sums write");
        }
    }

    /// The backends keep the entry points in arrays in `entries()`' order, indexed by `index`,
    /// each loaded by its own name.
    #[test]
    fn every_entry_point_has_its_index_and_a_distinct_name() {
        let all: Vec<_> = BackwardKernel::cuda_entries().collect();
        assert_eq!((BackwardKernel::entries().count(), all.len()), (17, 20));
        assert_eq!(all[17..], BackwardKernel::CUDA_ONLY.map(|k| (k, false)));
        for (i, &(k, sixteen)) in all.iter().enumerate() {
            assert_eq!(k.index(sixteen), i, "{k:?} {sixteen}");
            if !BackwardKernel::CUDA_ONLY.contains(&k) {
                assert_eq!(k.index(false), k as usize, "{k:?}");
            }
        }
        let names: std::collections::BTreeSet<_> = all.iter().map(|&(k, s)| k.entry_name(s)).collect();
        assert_eq!(names.len(), all.len());
        assert_eq!(BackwardKernel::Convert.index(true), BackwardKernel::Convert as usize);
    }

    /// The span's bytes: the buffers in order, each 256-byte aligned, then the GEMM workspace
    /// where there is one; every buffer but the workspace is poisoned.
    #[test]
    fn buffers_are_laid_out_in_order_in_the_span() {
        let cfg = Config::new(Formulation::Af3, 16, 8).unwrap();
        let problem = Problem::new(cfg, Shape::new(1, 6), Direction::Outgoing, false).unwrap();
        let with = BackwardBuffers::new(&problem, 1000, 0);
        let without = BackwardBuffers::new(&problem, 0, 4096);
        assert_eq!(with.written.len(), 15);
        assert_eq!(with.gemm_ws, without.bytes);
        assert_eq!(with.bytes, without.bytes + 1024);
        assert_eq!(without.gemm_ws, 0);
        for pair in without.written.windows(2) {
            let ((a, bytes), (next, _)) = (pair[0], pair[1]);
            assert!(a % 256 == 0 && a + bytes <= next && next - a - bytes < 256, "{pair:?}");
        }
        assert_eq!(without.tensors.z, 4096);
        assert_eq!(without.written[14].0, without.tensors.partial);
    }
}
