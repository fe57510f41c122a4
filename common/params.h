// The host-device interface of the stage kernels, in the manner of flash-attention's
// Flash_fwd_params: a common part every kernel reads (TmParams) and one struct per kernel family
// that extends it with that family's buffers (TmInputParams for the input stage, TmOutputParams
// for the output stage). Every kernel takes its family's struct, one argument by value. Mirrored
// by src/backend/params.rs (CommonParams, InputParams, OutputParams: #[repr(C)], sizes asserted on
// both sides, every field's offset checked by src/backend/hip/host_tests.rs). Pointers are device
// addresses; unused ones are null. No field means two things.
//
// Layouts (M = B*N*N positions, row m = (b*N + i)*N + j):
//   x, y       [M, C] f32 (bf16 or f16 where io_dtype says)    z  [rows, C] f16 (one chunk of positions)
//   proj       [rows, P] f16, P = 4*proj_h + proj_g, columns [left_proj | left_gate | right_proj | right_gate | out_gate]
//   left/right [B, H, N, N] f16   (the contraction layout: one N x N matrix per (b, h); a rank's rows
//                                  only in the sharded forward: see mat_rows)
//   gate       [M, G] f16, sigmoid already applied (G = H for gpumode, C for af3); rows from buf_row0
//   t          [B, H, N, N] f16   a [M, H] f16 (output-projection operand)
#pragma once
#include "common/smem.h"

#define TM_IO_F32 0
#define TM_IO_BF16 1
#define TM_IO_F16 2

// `formulation` values (src/backend/params.rs converts crate::problem::Formulation to them).
#define TM_GPUMODE 0  // lucidrains / GPU MODE: the gate multiplies LN_H(t) before the output projection
#define TM_AF3 1      // AlphaFold3: the gate multiplies y after it

// The common part: the problem, the call's pair tensors, the layer's prepared weights and the
// positions a launch covers.
struct TmParams {
  const float* x;      // in the I/O precision (io_dtype)
  const float* mask;   // [M] f32, or null
  float* y;            // in the I/O precision (io_dtype)
  const float* norm_in_w;
  const float* norm_in_b;
  const float* norm_out_w;
  const float* norm_out_b;
  // The fused input projection's weights (cuda/input_projection.cu; the output stage that makes
  // the gate from x reads their gate rows): reordered and zero-padded at prepare time,
  // [4*h_pad + g_pad, k_pad] f16, and the bias in the same order (f32, or null).
  const tm_half* w_in;
  const float* w_in_bias;
  // The output projection Wout [C, H] f16 and its bias [C] f32 (or null): the fused output
  // kernels (cuda/output_projection.cu, hip/output_projection.h).
  const tm_half* w_out;
  const float* out_bias;
  tm_i64 row0;  // first position of this launch
  tm_i64 rows;  // positions in this launch
  int batch, n, c, h, g;  // the problem: B, N, C, H and the output-gate width G
  int formulation;        // TM_GPUMODE or TM_AF3
  float eps;
  int io_dtype;  // x and y: TM_IO_F32, TM_IO_BF16 or TM_IO_F16 (the fused CUDA kernels, input_norm,
                 // HIP's output_projection; every other stage takes f32)
  int k_pad, h_pad, g_pad;  // w_in's padding (0 without fused weights)
  // Rows of each N x N matrix that left, right and t hold (0: all N). A rank of the sharded
  // forward keeps only its own rows i in [r0, r0 + mat_rows), matrices mat_rows*N elements apart,
  // and passes those pointers moved back by r0*N elements, so that position (b, i, j) of matrix
  // (b, h) is still at (b*H + h)*stride + i*N + j. Read by the fused CUDA kernels only (the
  // sharded forward runs no other); every other kernel takes 0.
  int mat_rows;
};

// The input stage: input_norm, input_gating and the fused CUDA input projection.
struct TmInputParams : TmParams {
  tm_half* z;
  tm_half* proj;
  const float* proj_bias;  // proj's bias [P] f32 (the staged path adds it in input_gating), or null
  tm_half* left;
  tm_half* right;
  tm_half* gate;
  tm_i64 buf_row0;  // first position `gate` holds (0 in the one-pass plan: every position)
  // input_gating: the projection this launch gates, proj_h channels of left and right and proj_g
  // gate columns (a hidden pass of a chunked plan gates its channels alone, the gate pass its
  // gate alone).
  int proj_h, proj_g;
  int tile_rows;  // input_gating: positions per block
  // The fused input kernel runs its column chunks [chunk_begin, chunk_end) (chunk_end 0: all),
  // and `left`/`right` hold the hidden channels lr_h0 .. lr_h0 + lr_h as [B, lr_h, N, N] (lr_h 0:
  // all H).
  int chunk_begin, chunk_end, lr_h0, lr_h;
  int reserved;
};

// The output stage: output_norm, output_gate and the fused output projections.
struct TmOutputParams : TmParams {
  const tm_half* t;
  tm_half* a;
  const tm_half* gate;
  tm_i64 buf_row0;  // first position `gate` and `a` hold (0 in the one-pass plan)
  int tile_rows;    // output_norm: positions per block
  int gate_blocks;  // output_gate: blocks in its grid (the grid-stride loop's stride)
};

#if defined(__cplusplus) && __cplusplus >= 201103L
static_assert(sizeof(TmParams) == 152, "TmParams layout must match src/backend/params.rs");
static_assert(sizeof(TmInputParams) == 152 + 88, "TmInputParams layout must match src/backend/params.rs");
static_assert(sizeof(TmOutputParams) == 152 + 40, "TmOutputParams layout must match src/backend/params.rs");
// (Every field's offset is checked against the Rust mirror by src/backend/hip/host_tests.rs: NVRTC
// has no offsetof.)
#endif
