// The one host-device interface of the portable stages: a plain struct passed by value to every
// stage kernel. Mirrored by `KernelParams` in src/backend/params.rs (#[repr(C)], size-asserted on
// both sides). Pointers are device addresses; unused ones are null.
//
// Layouts (M = B*N*N positions, row m = (b*N + i)*N + j):
//   x, y       [M, C] f32 (bf16 or f16 where io_dtype says)    z  [rows, C] f16 (one chunk of positions)
//   proj       [rows, P] f16, P = 4H + G, columns [left_proj | left_gate | right_proj | right_gate | out_gate]
//   left/right [B, H, N, N] f16   (the contraction layout: one N x N matrix per (b, h))
//   gate       [M, G] f16, sigmoid already applied (G = H for gpumode, C for af3); rows from buf_row0
//   t          [B, H, N, N] f16   a [M, H] f16 (output-projection operand)
#pragma once

#define TM_IO_F32 0
#define TM_IO_BF16 1
#define TM_IO_F16 2

typedef struct TrimulParams {
  const float* x;
  const float* mask;
  const float* norm_in_w;
  const float* norm_in_b;
  const float* proj_bias;
  const float* norm_out_w;
  const float* norm_out_b;
  tm_half* z;
  tm_half* proj;
  tm_half* left;
  tm_half* right;
  tm_half* gate;
  const tm_half* t;
  tm_half* a;
  float* y;
  tm_i64 row0;   // first position of this chunk
  tm_i64 rows;   // positions in this chunk
  int batch, n, c, h, g, p;
  int af3;        // 0: gpumode (gate before the output projection), 1: af3 (after)
  int tile_rows;  // positions per block in input_gating
  float eps;
  int io_dtype;  // x and y: TM_IO_F32, TM_IO_BF16 or TM_IO_F16 (the fused CUDA kernels, input_norm,
                // HIP's output_projection)
  // Fused input projection (cuda/input_projection.cu): weights reordered and zero-padded at
  // prepare time, [4*h_pad + g_pad, k_pad] f16, and the bias in the same order (f32, or null).
  const tm_half* w_in;
  const float* w_in_bias;
  int k_pad, h_pad, g_pad, reserved2;
  // Chunked plans (src/memory.rs). `gate` and `a` hold positions buf_row0 .. buf_row0 + rows
  // only (0 in the one-pass plan, where they hold every position). The fused input kernel runs
  // its column chunks [chunk_begin, chunk_end) (chunk_end 0: all), and `left`/`right` hold the
  // hidden channels lr_h0 .. lr_h0 + lr_h as [B, lr_h, N, N] (lr_h 0: all H).
  tm_i64 buf_row0;
  int chunk_begin, chunk_end, lr_h0, lr_h;
  // Fused output stage (cuda/output_projection.cu): Wout [C, H] f16 and its bias [C] (or null).
  const tm_half* w_out;
  const float* out_bias;
} TrimulParams;

#if defined(__cplusplus) && __cplusplus >= 201103L
static_assert(sizeof(TrimulParams) == 248, "TrimulParams layout must match src/backend/params.rs");
#endif
