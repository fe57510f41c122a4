// Block sizes and dynamic shared memory of every stage kernel, in one place. The kernels
// static_assert their own layouts against these names (or carve their shared memory with them),
// and build.rs turns this file into Rust constants and const fns (src/backend/params.rs,
// `geometry`), which the hosts launch with: a tile changed on one side only fails the build.
//
// Format (build.rs reads it): one `#define NAME value` or `#define NAME(ARG, ...) value` per line,
// the value integer arithmetic (+ - * / and parentheses) on literals, arguments, earlier names and
// TM_MAX, so that each value is also a Rust expression (on usize).
#pragma once

#define TM_MAX(a, b) ((a) > (b) ? (a) : (b))

// ---- the portable stages (common/*.h, CUDA and HIP)
#define TM_STAGE_THREADS 256
// input_norm: one 32-lane group per position.
#define TM_INPUT_NORM_ROWS_PER_BLOCK (TM_STAGE_THREADS / 32)
// input_gating: left and right tiles [H][TR + 1] f16 for TR positions of H channels.
#define TM_INPUT_GATING_TILE(H, TR) ((H) * ((TR) + 1))
#define TM_INPUT_GATING_SMEM(H, TR) (2 * TM_INPUT_GATING_TILE(H, TR) * 2)
// output_norm: the t tile [H][TP + 1] f32, then mean and rstd [TP] f32.
#define TM_OUTPUT_NORM_TILE(H, TP) ((H) * ((TP) + 1))
#define TM_OUTPUT_NORM_SMEM(H, TP) (4 * (TM_OUTPUT_NORM_TILE(H, TP) + 2 * (TP)))

// ---- HIP's fused output stage (hip/output_projection.h): 64 positions per block; the f16 A
// tile [64][H + 4], mean and rstd [64] f32, the f16 t tile [H][64 + 2].
#define TM_HIP_OP_ROWS 64
#define TM_HIP_OP_SMEM(H) (2 * TM_HIP_OP_ROWS * ((H) + 4) + 2 * 4 * TM_HIP_OP_ROWS + 2 * (H) * (TM_HIP_OP_ROWS + 2))

// ---- HIP's fused input stage (hip/input_projection.h): 64 positions per block; z [64][C + 4] f16.
#define TM_HIP_IP_ROWS 64
#define TM_HIP_IP_SMEM(C) (2 * TM_HIP_IP_ROWS * ((C) + 4))

// ---- CUDA's fused input projection (cuda/input_projection.cu)
#define TM_IP_ROWS 128  // positions per block of the mma.sync builds and the 128-position wgmma builds
#define TM_IP_MAX_K 512  // largest padded C (z stays resident in shared memory)
// The epilogue's staging for `ROWS` positions: the gating tiles [2][32][ROWS + 8] or the
// [ROWS][128 + 8] tile (halves), whichever is larger.
#define TM_IP_STAGING(ROWS) TM_MAX(2 * 32 * ((ROWS) + 8) * 2, (ROWS) * (128 + 8) * 2)
// mma.sync builds: z [128][K_PAD + 8] f16, the weight ring [2][128][64 + 8] f16, the staging, the
// mask [128] f32.
#define TM_IP_SMEM(K_PAD) (TM_IP_ROWS * ((K_PAD) + 8) * 2 + 2 * 128 * (64 + 8) * 2 + TM_IP_STAGING(TM_IP_ROWS) + TM_IP_ROWS * 4)
// wgmma builds of ROWS positions: unpadded swizzled tiles, plus 1024 bytes to align them.
#define TM_IP_SM90_SMEM(ROWS, K_PAD) ((ROWS) * (K_PAD) * 2 + 2 * 128 * 64 * 2 + TM_IP_STAGING(ROWS) + (ROWS) * 4 + 1024)
// The warp-specialised persistent build: weights 5 x 32 KB, z 2 x 16 KB, staging 4 x 8 KB, masks
// 2 x 256 bytes, LN_C's weight and bias 1024 bytes, 1024 bytes to align the swizzled tiles.
#define TM_WS_THREADS 1024
#define TM_WS_ROWS 64
#define TM_WS_SMEM (5 * 32768 + 2 * 16384 + 4 * 8192 + 2 * 256 + 1024 + 1024)
// The register-operand build (16-bit x): a producer and two consumer warpgroups; weights 5 x 32
// KB, x 2 x 16 KB, staging 4 x 8 KB, masks 2 x 256 bytes, LN_C's weight and bias 1024 bytes,
// 1024 bytes to align the swizzled tiles.
#define TM_RS_THREADS 384
#define TM_RS_SMEM (5 * 32768 + 2 * 16384 + 4 * 8192 + 2 * 256 + 1024 + 1024)

// ---- CUDA's fused output stage (cuda/output_projection.cu): 64 positions per block.
#define TM_OP_ROWS 64
// sa [64][136] and sw [128][136] (halves), mean and rstd [64], LN_H weight and bias [128] (f32).
#define TM_OP_SMEM ((TM_OP_ROWS + 128) * 136 * 2 + 2 * TM_OP_ROWS * 4 + 2 * 128 * 4)
// af3 or 16-bit y: the staging tile sg [64][136] (halves) of the gate and y, after the above.
#define TM_OP_SMEM_STAGING (TM_OP_ROWS * 136 * 2)
// The resident kernel: TM_OP_SMEM plus the next tile's t [128][72] (halves).
#define TM_OP_RESIDENT_SMEM (TM_OP_SMEM + 128 * 72 * 2)
// The kernel that makes the gate from x (OpxSmem): Wout and the gate weights (2 x 32 KB,
// swizzled), z / LN_H(t) (16 KB), the t tile [128][72] halves, the statistics' partial sums
// [8][64][2], mean and rstd [64] and five [128] f32 vectors, plus 1024 bytes to align the tiles.
#define TM_OP_XGATE_SMEM (2 * 32768 + 16384 + 128 * 72 * 2 + (8 * TM_OP_ROWS * 2 + 2 * TM_OP_ROWS + 5 * 128) * 4 + 1024)
