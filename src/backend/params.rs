//! The host side of `common/params.h`: the one struct every stage kernel takes by value, shared
//! by the CUDA and HIP backends. Field order, types and size must match the C header; both sides
//! assert the size (248 bytes).

/// `io_dtype` values (`TM_IO_*` in `common/params.h`).
pub const IO_F32: i32 = 0;
pub const IO_BF16: i32 = 1;
pub const IO_F16: i32 = 2;

/// The `io_dtype` of a precision mode.
pub fn io_dtype(p: crate::problem::Precision) -> i32 {
    match p {
        crate::problem::Precision::Bf16Io => IO_BF16,
        crate::problem::Precision::F16Io => IO_F16,
        _ => IO_F32,
    }
}

/// Mirror of `TrimulParams` in `common/params.h`. Pointers are device addresses (0 = null).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct KernelParams {
    pub x: u64,
    pub mask: u64,
    pub norm_in_w: u64,
    pub norm_in_b: u64,
    pub proj_bias: u64,
    pub norm_out_w: u64,
    pub norm_out_b: u64,
    pub z: u64,
    pub proj: u64,
    pub left: u64,
    pub right: u64,
    pub gate: u64,
    pub t: u64,
    pub a: u64,
    pub y: u64,
    /// First position of the chunk this launch covers.
    pub row0: i64,
    /// Positions in the chunk.
    pub rows: i64,
    pub batch: i32,
    pub n: i32,
    pub c: i32,
    pub h: i32,
    /// Output-gate width: H (gpumode) or C (af3).
    pub g: i32,
    /// Fused projection width 4H + G.
    pub p: i32,
    /// 1 for af3 (gate after the output projection), 0 for gpumode.
    pub af3: i32,
    /// Positions per block (input_gating, output_norm) or grid size (output_gate).
    pub tile_rows: i32,
    pub eps: f32,
    /// Element type of `x` and `y`: [`IO_F32`], [`IO_BF16`] or [`IO_F16`] (the fused CUDA
    /// kernels read and write all three; every other stage takes f32 only).
    pub io_dtype: i32,
    /// Fused input projection weights `[4·h_pad + g_pad, k_pad]` f16 (see `FusedInputLayout`).
    pub w_in: u64,
    /// Their bias in the same order, f32, or 0.
    pub w_in_bias: u64,
    pub k_pad: i32,
    pub h_pad: i32,
    pub g_pad: i32,
    pub reserved2: i32,
    /// First position held by the `gate` and `a` buffers (row-chunked output stage), else 0.
    pub buf_row0: i64,
    /// Column chunks of the fused input kernel to run: `[chunk_begin, chunk_end)`, 0 = all.
    pub chunk_begin: i32,
    pub chunk_end: i32,
    /// `left`/`right` hold hidden channels `lr_h0 .. lr_h0 + lr_h` as `[B, lr_h, N, N]` (0 = all).
    pub lr_h0: i32,
    pub lr_h: i32,
    /// Fused output stage: `Wout` `[C, H]` f16 and its bias `[C]` f32 (0 = none).
    pub w_out: u64,
    pub out_bias: u64,
}

const _: () = assert!(std::mem::size_of::<KernelParams>() == 248);

/// Threads per block of every portable stage (the `*_THREADS` constants of `common/*.h`).
pub const STAGE_THREADS: u32 = 256;
/// Positions per block of `input_norm` (one 32-lane group per position).
pub const INPUT_NORM_ROWS_PER_BLOCK: u32 = STAGE_THREADS / 32;

/// Positions per block for `input_gating`: two `[H][TR+1]` f16 tiles within 40 KiB of shared memory.
pub fn gating_tile_rows(h: usize) -> usize {
    (40 * 1024 / (4 * h)).saturating_sub(1).clamp(1, 64)
}

/// Dynamic shared memory of `input_gating` for a tile of `tr` positions.
pub fn gating_smem_bytes(h: usize, tr: usize) -> usize {
    2 * h * (tr + 1) * 2
}

/// Positions per block for `output_norm`: an `[H][TP+1]` f32 tile within 40 KiB.
pub fn output_norm_tile_rows(h: usize) -> usize {
    (40 * 1024 / (4 * h + 8)).saturating_sub(1).clamp(1, 64)
}

/// Dynamic shared memory of `output_norm` for a tile of `tp` positions.
pub fn output_norm_smem_bytes(h: usize, tp: usize) -> usize {
    4 * (h * (tp + 1) + 2 * tp)
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
pub const FUSED_INPUT_MAX_K: usize = 512;
/// Positions per block of the fused input kernel.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub const FUSED_INPUT_ROWS: usize = 128;
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
