//! The host side of `common/params.h`: the one struct every stage kernel takes by value, shared
//! by the CUDA and HIP backends. Field order, types and size must match the C header; both sides
//! assert the size (176 bytes).

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
    pub reserved: i32,
}

const _: () = assert!(std::mem::size_of::<KernelParams>() == 176);

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
