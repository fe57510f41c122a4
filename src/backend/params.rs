//! The host side of `common/params.h`: the structs the stage kernels take by value, shared by
//! the CUDA and HIP backends. A common part ([`CommonParams`], `TmParams`) that every kernel reads,
//! built once per forward by [`CommonParams::new`], and one struct per kernel family that extends
//! it with that family's buffers: [`InputParams`] (`TmInputParams`: input_norm, input_gating, the
//! fused CUDA input projection) and [`OutputParams`] (`TmOutputParams`: output_norm, output_gate,
//! the fused output projections). Field order, types and sizes match the C header; both sides
//! assert the sizes, and `src/backend/hip/host_tests.rs` checks every field's offset.
//!
//! Launch geometry and shared-memory sizes come from `common/smem.h` (see [`geometry`]).

use crate::error::{Error, Result};
use crate::problem::{Formulation, Precision, Problem};

/// `io_dtype` values (`TM_IO_*` in `common/params.h`).
pub const IO_F32: i32 = 0;
pub const IO_BF16: i32 = 1;
pub const IO_F16: i32 = 2;

/// The `io_dtype` of a precision mode.
pub fn io_dtype(p: Precision) -> i32 {
    match p {
        Precision::Bf16Io => IO_BF16,
        Precision::F16Io => IO_F16,
        _ => IO_F32,
    }
}

/// `formulation` values (`TM_GPUMODE`, `TM_AF3` in `common/params.h`).
const TM_GPUMODE: i32 = 0;
const TM_AF3: i32 = 1;

/// The kernels' `formulation` of `f`: the one place [`Formulation`] becomes a number.
const fn formulation_code(f: Formulation) -> i32 {
    match f {
        Formulation::GpuMode => TM_GPUMODE,
        Formulation::Af3 => TM_AF3,
    }
}

/// `v` as a kernel's `int`, or an [`Error::Shape`] naming it.
pub fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Shape(format!("{what} = {v} exceeds the kernels' 32-bit int")))
}

/// `v` as a kernel's `tm_i64`, or an [`Error::Shape`] naming it.
pub fn to_i64(v: usize, what: &str) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::Shape(format!("{what} = {v} exceeds the kernels' 64-bit int")))
}

/// The call's pair tensors and the layer's prepared weights, as device addresses (0 = none):
/// what [`CommonParams::new`] puts beside the problem.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Addresses {
    /// x and y in the I/O precision; the mask `[M]` f32.
    pub x: u64,
    pub mask: u64,
    pub y: u64,
    pub norm_in_w: u64,
    pub norm_in_b: u64,
    pub norm_out_w: u64,
    pub norm_out_b: u64,
    /// The output projection `Wout` `[C, H]` f16 and its bias `[C]` f32.
    pub w_out: u64,
    pub out_bias: u64,
}

/// Mirror of `TmParams` in `common/params.h`: the part every kernel reads. Made only by
/// [`CommonParams::new`] (then [`CommonParams::over`] and [`CommonParams::with_fused`]), which
/// check every narrowing; read through its accessors. Pointers are device addresses (0 = null).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct CommonParams {
    x: u64,
    mask: u64,
    y: u64,
    norm_in_w: u64,
    norm_in_b: u64,
    norm_out_w: u64,
    norm_out_b: u64,
    /// Fused input projection weights `[4·h_pad + g_pad, k_pad]` f16 (see [`FusedInputLayout`])
    /// and their bias in the same order (f32, or 0).
    w_in: u64,
    w_in_bias: u64,
    w_out: u64,
    out_bias: u64,
    row0: i64,
    rows: i64,
    batch: i32,
    n: i32,
    c: i32,
    h: i32,
    /// Output-gate width: H (gpumode) or C (af3).
    g: i32,
    /// `TM_GPUMODE` or `TM_AF3` ([`formulation_code`]).
    formulation: i32,
    eps: f32,
    /// Element type of `x` and `y`: [`IO_F32`], [`IO_BF16`] or [`IO_F16`] (the fused CUDA
    /// kernels, input_norm and HIP's output_projection read and write all three; every other
    /// stage takes f32 only).
    io_dtype: i32,
    k_pad: i32,
    h_pad: i32,
    g_pad: i32,
    /// Rows of each `N × N` matrix of left, right and t the buffers hold (0: all N): a rank's
    /// rows in the sharded forward, its pointers moved back by its first row (`common/params.h`).
    /// The fused CUDA kernels read it; every other kernel needs 0.
    mat_rows: i32,
}

/// Mirror of `TmInputParams` in `common/params.h`: the common part and the input stage's buffers.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct InputParams {
    pub common: CommonParams,
    pub z: u64,
    pub proj: u64,
    /// `proj`'s bias `[4·proj_h + proj_g]` f32 (added by input_gating), or 0.
    pub proj_bias: u64,
    pub left: u64,
    pub right: u64,
    pub gate: u64,
    /// First position `gate` holds (0 in the one-pass plan: every position).
    pub buf_row0: i64,
    /// input_gating: the channels of left and right and the gate columns this launch gates
    /// (`proj` has `4·proj_h + proj_g` columns).
    pub proj_h: i32,
    pub proj_g: i32,
    /// input_gating: positions per block.
    pub tile_rows: i32,
    /// Column chunks of the fused input kernel to run: `[chunk_begin, chunk_end)`, 0 = all.
    pub chunk_begin: i32,
    pub chunk_end: i32,
    /// `left`/`right` hold hidden channels `lr_h0 .. lr_h0 + lr_h` as `[B, lr_h, N, N]` (0 = all).
    pub lr_h0: i32,
    pub lr_h: i32,
    pub reserved: i32,
}

/// Mirror of `TmOutputParams` in `common/params.h`: the common part and the output stage's
/// buffers.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct OutputParams {
    pub common: CommonParams,
    pub t: u64,
    pub a: u64,
    pub gate: u64,
    /// First position `gate` and `a` hold (0 in the one-pass plan).
    pub buf_row0: i64,
    /// output_norm: positions per block.
    pub tile_rows: i32,
    /// output_gate: blocks in its grid (the stride of its grid-stride loop).
    pub gate_blocks: i32,
}

const _: () = assert!(std::mem::size_of::<CommonParams>() == 152);
const _: () = assert!(std::mem::offset_of!(CommonParams, row0) == 88);
const _: () = assert!(std::mem::offset_of!(CommonParams, batch) == 104);
const _: () = assert!(std::mem::offset_of!(CommonParams, formulation) == 124);
const _: () = assert!(std::mem::offset_of!(CommonParams, k_pad) == 136);
const _: () = assert!(std::mem::size_of::<InputParams>() == 152 + 88);
const _: () = assert!(std::mem::offset_of!(InputParams, z) == 152);
const _: () = assert!(std::mem::size_of::<OutputParams>() == 152 + 40);
const _: () = assert!(std::mem::offset_of!(OutputParams, t) == 152);

/// Every field of the three structs with its offset, as `(C struct, field, offset)`, for the test
/// that compiles `static_assert`s of them against `common/params.h`
/// (`src/backend/hip/host_tests.rs`).
#[cfg(all(test, feature = "rocm"))]
pub fn field_offsets() -> Vec<(&'static str, &'static str, usize)> {
    use std::mem::offset_of;
    macro_rules! fields {
        ($c:literal, $t:ty, $($f:ident),*) => { vec![$(($c, stringify!($f), offset_of!($t, $f))),*] };
    }
    let mut v = fields! {
        "TmParams", CommonParams, x, mask, y, norm_in_w, norm_in_b, norm_out_w, norm_out_b, w_in, w_in_bias, w_out,
        out_bias, row0, rows, batch, n, c, h, g, formulation, eps, io_dtype, k_pad, h_pad, g_pad, mat_rows
    };
    v.extend(fields! {
        "TmInputParams", InputParams, z, proj, proj_bias, left, right, gate, buf_row0, proj_h, proj_g, tile_rows,
        chunk_begin, chunk_end, lr_h0, lr_h, reserved
    });
    v.extend(fields! { "TmOutputParams", OutputParams, t, a, gate, buf_row0, tile_rows, gate_blocks });
    v
}

/// A struct a stage kernel takes as its one argument by value (the kernel's family's struct).
pub trait StageParams: Copy + private::Sealed {}
impl StageParams for InputParams {}
impl StageParams for OutputParams {}
mod private {
    pub trait Sealed {}
    impl Sealed for super::InputParams {}
    impl Sealed for super::OutputParams {}
}

impl CommonParams {
    /// The common part of every launch of `problem`'s forward, over all its positions: the shape,
    /// formulation, eps and I/O precision, each narrowing checked, and the addresses `at`.
    pub fn new(problem: &Problem, at: Addresses) -> Result<Self> {
        let cfg = &problem.config;
        // The kernels compute proj's width 4H + G in 32 bits (input_gating).
        to_i32(cfg.fused_proj_width(), "P = 4H + G")?;
        Ok(CommonParams {
            x: at.x,
            mask: at.mask,
            y: at.y,
            norm_in_w: at.norm_in_w,
            norm_in_b: at.norm_in_b,
            norm_out_w: at.norm_out_w,
            norm_out_b: at.norm_out_b,
            w_in: 0,
            w_in_bias: 0,
            w_out: at.w_out,
            out_bias: at.out_bias,
            row0: 0,
            rows: to_i64(problem.shape.rows(), "B·N·N")?,
            batch: to_i32(problem.shape.batch, "B")?,
            n: to_i32(problem.shape.n, "N")?,
            c: to_i32(cfg.c, "C")?,
            h: to_i32(cfg.h, "H")?,
            g: to_i32(cfg.gate_width(), "G")?,
            formulation: formulation_code(cfg.formulation),
            eps: problem.eps,
            io_dtype: io_dtype(problem.io),
            k_pad: 0,
            h_pad: 0,
            g_pad: 0,
            mat_rows: 0,
        })
    }

    /// The same for positions `row0 .. row0 + rows`.
    pub fn over(self, row0: usize, rows: usize) -> Result<Self> {
        Ok(CommonParams { row0: to_i64(row0, "first position")?, rows: to_i64(rows, "positions")?, ..self })
    }

    /// The same with the fused input kernel's weights `w` (`[4·h_pad + g_pad, k_pad]` f16 in
    /// `layout`'s order) and their bias (or 0).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the fused input kernel is CUDA's
    pub fn with_fused(self, layout: &FusedInputLayout, w: u64, bias: u64) -> Result<Self> {
        Ok(CommonParams {
            w_in: w,
            w_in_bias: bias,
            k_pad: to_i32(layout.k_pad, "padded C")?,
            h_pad: to_i32(layout.h_pad, "padded H")?,
            g_pad: to_i32(layout.g_pad, "padded G")?,
            ..self
        })
    }

    /// The same with HIP's fused input kernel's weights: the prepared `[4H + G, C]` f16 block
    /// as it is (no padding: `k_pad`, `h_pad` and `g_pad` are C, H and G).
    #[cfg_attr(not(feature = "rocm"), allow(dead_code))] // HIP's input_projection
    pub fn with_input_weights(self, w: u64) -> Result<Self> {
        Ok(CommonParams { w_in: w, w_in_bias: 0, k_pad: self.c, h_pad: self.h, g_pad: self.g, ..self })
    }

    /// The same with left, right and t holding `rows` rows of each `N × N` matrix (the sharded
    /// forward's compact buffers: the caller moves their pointers back by the first row's
    /// `r0·N` elements).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA sharded forward's
    pub fn with_matrix_rows(self, rows: usize) -> Result<Self> {
        Ok(CommonParams { mat_rows: to_i32(rows, "rows of a rank's matrices")?, ..self })
    }

    /// The formulation [`CommonParams::new`] was given.
    pub fn formulation(&self) -> Formulation {
        if self.formulation == TM_AF3 {
            Formulation::Af3
        } else {
            Formulation::GpuMode
        }
    }

    /// The element type of x and y ([`IO_F32`], [`IO_BF16`] or [`IO_F16`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA launches
    pub fn io_dtype(&self) -> i32 {
        self.io_dtype
    }

    /// x (the tests check the steps' addresses) and y.
    #[cfg(test)]
    pub fn x(&self) -> u64 {
        self.x
    }
    pub fn y(&self) -> u64 {
        self.y
    }

    /// N, C, H and the output-gate width G.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn n(&self) -> usize {
        self.n as usize
    }
    pub fn c(&self) -> usize {
        self.c as usize
    }
    pub fn h(&self) -> usize {
        self.h as usize
    }
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn g(&self) -> usize {
        self.g as usize
    }

    /// First position and number of positions of the launch.
    pub fn row0(&self) -> usize {
        self.row0 as usize
    }
    pub fn rows(&self) -> usize {
        self.rows as usize
    }
}

/// Launch geometry and shared-memory sizes of the kernels, generated by build.rs from
/// `common/smem.h` (the kernels assert their layouts against the same file): names and formulas
/// as written there, on `usize`.
#[allow(non_snake_case, dead_code, unused_parens, clippy::all)]
pub mod geometry {
    include!(concat!(env!("OUT_DIR"), "/smem.rs"));
}

/// Threads per block of every portable stage (the `*_THREADS` constants of `common/*.h`).
pub const STAGE_THREADS: u32 = geometry::TM_STAGE_THREADS as u32;
/// Positions per block of `input_norm` (one 32-lane group per position).
pub const INPUT_NORM_ROWS_PER_BLOCK: u32 = geometry::TM_INPUT_NORM_ROWS_PER_BLOCK as u32;

/// Positions per block for `input_gating`: two `[H][TR+1]` f16 tiles within 40 KiB of shared memory.
pub fn gating_tile_rows(h: usize) -> usize {
    (40 * 1024 / (4 * h)).saturating_sub(1).clamp(1, 64)
}

/// Dynamic shared memory of `input_gating` for a tile of `tr` positions.
pub fn gating_smem_bytes(h: usize, tr: usize) -> usize {
    geometry::TM_INPUT_GATING_SMEM(h, tr)
}

/// Positions per block for `output_norm`: an `[H][TP+1]` f32 tile within 40 KiB.
pub fn output_norm_tile_rows(h: usize) -> usize {
    (40 * 1024 / (4 * h + 8)).saturating_sub(1).clamp(1, 64)
}

/// Dynamic shared memory of `output_norm` for a tile of `tp` positions.
pub fn output_norm_smem_bytes(h: usize, tp: usize) -> usize {
    geometry::TM_OUTPUT_NORM_SMEM(h, tp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_their_shared_memory() {
        for h in [1, 7, 64, 128, 256, 1000, 4096] {
            let tr = gating_tile_rows(h);
            assert!(gating_smem_bytes(h, tr) <= 48 * 1024, "h={h} tr={tr}");
            let tp = output_norm_tile_rows(h);
            assert!(output_norm_smem_bytes(h, tp) <= 48 * 1024, "h={h} tp={tp}");
        }
        assert_eq!(gating_tile_rows(128), 64);
        assert_eq!(output_norm_tile_rows(128), 64);
    }

    /// `common/smem.h` gives every launch the shared memory and block sizes the hand-kept Rust
    /// copies it replaced gave (their formulas, copied here as they were).
    #[test]
    fn geometry_equals_the_sizes_launched_before() {
        use geometry::*;
        let staging = |rows: usize| (2 * 32 * (rows + 8) * 2).max(rows * (128 + 8) * 2);
        for k_pad in (64..=512).step_by(64) {
            assert_eq!(TM_IP_SMEM(k_pad), 128 * (k_pad + 8) * 2 + 2 * 128 * (64 + 8) * 2 + staging(128) + 128 * 4);
            for rows in [64, 128] {
                let old = rows * k_pad * 2 + 2 * 128 * 64 * 2 + staging(rows) + rows * 4 + 1024;
                assert_eq!(TM_IP_SM90_SMEM(rows, k_pad), old);
            }
        }
        for h in 1..=256 {
            assert_eq!(TM_HIP_OP_SMEM(h), 2 * 64 * (h + 4) + 2 * 4 * 64 + 2 * h * (64 + 2));
            for tr in 1..=64 {
                assert_eq!(gating_smem_bytes(h, tr), 2 * h * (tr + 1) * 2);
                assert_eq!(output_norm_smem_bytes(h, tr), 4 * (h * (tr + 1) + 2 * tr));
            }
        }
        assert_eq!(TM_WS_SMEM, 5 * 32768 + 2 * 16384 + 4 * 8192 + 2 * 256 + 1024 + 1024);
        assert_eq!(TM_OP_SMEM, (64 + 128) * 136 * 2 + 2 * 64 * 4 + 2 * 128 * 4);
        assert_eq!(TM_OP_SMEM_STAGING, 64 * 136 * 2);
        assert_eq!(TM_OP_RESIDENT_SMEM, TM_OP_SMEM + 128 * 72 * 2);
        assert_eq!(TM_OP_XGATE_SMEM, 2 * 32768 + 16384 + 128 * 72 * 2 + (8 * 64 * 2 + 2 * 64 + 5 * 128) * 4 + 1024);
        assert_eq!((TM_STAGE_THREADS, TM_INPUT_NORM_ROWS_PER_BLOCK, TM_IP_ROWS, TM_IP_MAX_K), (256, 8, 128, 512));
        assert_eq!((TM_WS_THREADS, TM_WS_ROWS, TM_OP_ROWS, TM_HIP_OP_ROWS), (1024, 64, 64, 64));
    }

    /// The builder names the value that does not fit the kernels' ints.
    #[test]
    fn builder_checks_narrowing() {
        use crate::problem::{Config, Direction, Shape};
        let problem = |c: usize, n: usize| {
            Problem::new(Config::new(Formulation::Af3, c, 8).unwrap(), Shape::new(1, n), Direction::Outgoing, false)
                .unwrap()
        };
        let p = CommonParams::new(&problem(16, 4), Addresses { x: 1, y: 2, ..Addresses::default() }).unwrap();
        assert_eq!((p.c(), p.h(), p.g(), p.rows(), p.formulation()), (16, 8, 16, 16, Formulation::Af3));
        assert_eq!(p.formulation, TM_AF3);
        let over = p.over(4, 8).unwrap();
        assert_eq!((over.row0(), over.rows(), over.y()), (4, 8, 2));
        assert!(matches!(to_i32(1 << 31, "H"), Err(Error::Shape(m)) if m.contains("H = 2147483648")));
        assert_eq!(to_i32((1 << 31) - 1, "H").unwrap(), i32::MAX);
    }
}

/// The weight order of the fused input-projection kernel (`cuda/input_projection.cu`).
///
/// Columns come in chunks of 128. The first `h_pad / 32` chunks are gating chunks: chunk `j`
/// holds 4 blocks of 8 channels, each block's 32 rows ordered `[lp(8) | lg(8) | rp(8) | rg(8)]`
/// for channels `8·(4j + block) ..+8`, so one thread's accumulators hold the value and gate of
/// the same channel. The remaining `g_pad / 128` chunks hold the output gate's rows. Padding
/// rows (channels ≥ H, gate rows ≥ G) and columns (k ≥ C) are zero.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FusedInputLayout {
    pub c: usize,
    pub h: usize,
    pub g: usize,
    pub k_pad: usize,
    pub h_pad: usize,
    pub g_pad: usize,
}

/// Largest padded C the fused input kernel keeps resident in shared memory.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the fused input kernel is CUDA's
pub const FUSED_INPUT_MAX_K: usize = geometry::TM_IP_MAX_K;
/// Positions per block of the fused input kernel.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub const FUSED_INPUT_ROWS: usize = geometry::TM_IP_ROWS;
// The plans chunk rows for the fused kernels in multiples of one block.
const _: () = assert!(FUSED_INPUT_ROWS == crate::plan::layout::FUSED_ROW_STEP);

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl FusedInputLayout {
    /// The layout for `config`, or `None` when the fused kernel does not take this shape
    /// (C not a multiple of 4 or padded C above [`FUSED_INPUT_MAX_K`]).
    pub fn new(config: &crate::problem::Config) -> Option<Self> {
        let (c, h, g) = (config.c, config.h, config.gate_width());
        let k_pad = c.div_ceil(64) * 64;
        (c % 4 == 0 && k_pad <= FUSED_INPUT_MAX_K).then_some(FusedInputLayout {
            c,
            h,
            g,
            k_pad,
            h_pad: h.div_ceil(32) * 32,
            g_pad: g.div_ceil(128) * 128,
        })
    }

    pub fn rows(&self) -> usize {
        4 * self.h_pad + self.g_pad
    }

    /// What fused row `row` holds: `Some((section, index))` with section 0..4 = lp, lg, rp, rg
    /// and `index` the channel, or section 4 = out gate with `index` the gate row; `None` for
    /// padding.
    pub fn source(&self, row: usize) -> Option<(usize, usize)> {
        if row < 4 * self.h_pad {
            let (block, within) = (row / 32, row % 32);
            let (section, c8) = (within / 8, within % 8);
            let channel = block * 8 + c8;
            (channel < self.h).then_some((section, channel))
        } else {
            let gi = row - 4 * self.h_pad;
            (gi < self.g).then_some((4, gi))
        }
    }

    /// Reorders and pads the input-projection weights (`[out, C]` row-major each) and their
    /// biases into the kernel's `[rows, k_pad]` matrix and `[rows]` bias (None when no bias),
    /// each value halved: the kernel's MMA then yields x/2 for every projection and gate, which
    /// its tanh-form sigmoid takes directly (`cuda/input_projection.cu`). Halving is exact in f32
    /// and in the f16 the matrix is uploaded as (barring values below f16's normal range).
    pub fn pack(&self, w: &crate::weights::Weights) -> (Vec<f32>, Option<Vec<f32>>) {
        let sources = w.input_linears();
        let any_bias = sources.iter().any(|l| l.bias.is_some());
        let mut mat = vec![0f32; self.rows() * self.k_pad];
        let mut bias = any_bias.then(|| vec![0f32; self.rows()]);
        for row in 0..self.rows() {
            if let Some((section, idx)) = self.source(row) {
                let lin = sources[section];
                for (dst, &v) in mat[row * self.k_pad..row * self.k_pad + self.c]
                    .iter_mut()
                    .zip(&lin.weight[idx * self.c..(idx + 1) * self.c])
                {
                    *dst = 0.5 * v;
                }
                if let (Some(b), Some(src)) = (bias.as_mut(), lin.bias.as_ref()) {
                    b[row] = 0.5 * src[idx];
                }
            }
        }
        (mat, bias)
    }
}

#[cfg(test)]
mod fused_tests {
    use super::*;
    use crate::problem::{Config, Formulation};
    use crate::weights::Weights;

    fn halved(v: &[f32]) -> Vec<f32> {
        v.iter().map(|x| 0.5 * x).collect()
    }

    /// Emulates the kernel's epilogue index math for every (chunk, warp_n, block q, section,
    /// column) and checks it reads back exactly the weights of the channel it writes.
    #[test]
    fn kernel_epilogue_mapping_reads_matching_weights() {
        for (f, c, h) in
            [(Formulation::GpuMode, 128, 128), (Formulation::Af3, 64, 40), (Formulation::GpuMode, 384, 128)]
        {
            let cfg = Config::new(f, c, h).unwrap();
            let w = Weights::random(cfg, f == Formulation::Af3, 3).unwrap();
            let l = FusedInputLayout::new(&cfg).unwrap();
            let (mat, bias) = l.pack(&w);
            let sources = [&w.left_proj, &w.left_gate, &w.right_proj, &w.right_gate];
            let mut seen = vec![0usize; h];
            for chunk in 0..l.h_pad / 32 {
                for warp_n in 0..2 {
                    for q in 0..2 {
                        for col8 in 0..8 {
                            let ch = (warp_n * 2 + q) * 8 + col8; // as in the kernel
                            let hch = chunk * 32 + ch;
                            let base = warp_n * 64 + q * 32;
                            if hch >= h {
                                continue;
                            }
                            seen[hch] += 1;
                            for (s, src) in sources.iter().enumerate() {
                                let row = chunk * 128 + base + s * 8 + col8;
                                assert_eq!(
                                    &mat[row * l.k_pad..row * l.k_pad + c],
                                    &halved(&src.weight[hch * c..(hch + 1) * c])
                                );
                                assert!(mat[row * l.k_pad + c..(row + 1) * l.k_pad].iter().all(|&v| v == 0.0));
                                if let Some(b) = &bias {
                                    assert_eq!(b[row], 0.5 * src.bias.as_ref().unwrap()[hch]);
                                }
                            }
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "every channel exactly once");
            for gi in 0..cfg.gate_width() {
                let row = 4 * l.h_pad + gi;
                assert_eq!(&mat[row * l.k_pad..row * l.k_pad + c], &halved(&w.out_gate.weight[gi * c..(gi + 1) * c]));
            }
        }
        assert!(FusedInputLayout::new(&Config::new(Formulation::GpuMode, 768, 128).unwrap()).is_none());
        assert!(FusedInputLayout::new(&Config::new(Formulation::GpuMode, 66, 128).unwrap()).is_none());
    }
}

/// Segments of one `prepare_weights` launch (`TM_PREP_MAX_SEGMENTS` in
/// `common/prepare_weights.h`).
pub const PREP_MAX_SEGMENTS: usize = 24;
/// Threads per block of `prepare_weights`.
pub const PREP_THREADS: u32 = 256;
/// Segment kinds (`TM_SEG_*`): a plain converted copy, the fused input kernel's weight matrix,
/// its bias.
pub const SEG_PLAIN: i32 = 0;
pub const SEG_FUSED_W: i32 = 1;
pub const SEG_FUSED_B: i32 = 2;

/// Mirror of `TmPrepSegment` in `common/prepare_weights.h`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct PrepSegment {
    pub src: u64,
    pub dst: u64,
    pub count: i64,
    pub kind: i32,
    pub src_dtype: i32,
    pub dst_f16: i32,
    pub scale: f32,
}

/// Mirror of `TmPrepareParams` in `common/prepare_weights.h`: one launch of the device-side
/// weight preparation.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct PrepareParams {
    pub seg: [PrepSegment; PREP_MAX_SEGMENTS],
    pub fused_src: [u64; 5],
    pub fused_bias: [u64; 5],
    pub fused_dtype: [i32; 5],
    pub fused_bias_dtype: [i32; 5],
    pub segments: i32,
    pub grid: i32,
    pub c: i32,
    pub h: i32,
    pub g: i32,
    pub k_pad: i32,
    pub h_pad: i32,
    pub g_pad: i32,
}

const _: () = assert!(std::mem::size_of::<PrepareParams>() == 1112);
