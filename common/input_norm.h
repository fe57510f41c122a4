// Stage 1a, input LayerNorm:  z = LN_C(x; norm_in.weight, norm_in.bias), stored as f16; x in
// the launch's I/O precision.
//
// One group of 32 lanes per position. Statistics in f32 with two passes over the row (mean,
// then the centred sum of squares), because Cauchy inputs make the one-pass E[x²] − E[x]²
// cancel catastrophically. The row (≤ 16 KB) is re-read from L1/L2, not from DRAM.
#pragma once
#include "common/pair_io.h"

#define INPUT_NORM_THREADS 256
#define INPUT_NORM_ROWS_PER_BLOCK (INPUT_NORM_THREADS / 32)
static_assert(INPUT_NORM_THREADS == TM_STAGE_THREADS && INPUT_NORM_ROWS_PER_BLOCK == TM_INPUT_NORM_ROWS_PER_BLOCK,
              "common/smem.h");

// One position's row, x in precision IO.
template <int IO>
TM_INLINE void input_norm_row(const TmInputParams& p, tm_i64 local, unsigned lane) {
  const int C = p.c;
  const tm_i64 first = (p.row0 + local) * (tm_i64)C;  // the row's first element in x
  const void* TM_RESTRICT xr = IO == TM_IO_F32 ? (const void*)(p.x + first) : (const void*)((const tm_half*)p.x + first);
  tm_half* TM_RESTRICT zr = p.z + local * (tm_i64)C;
  const float inv_c = 1.0f / (float)C;

  if ((C & 3) == 0) {
    // 16-byte (f32 x) or 8-byte (16-bit x) loads and 8-byte stores (every published C is a
    // multiple of 4).
    const int c4n = C / 4;
    float s = 0.f;
    for (int c4 = lane; c4 < c4n; c4 += 32) {
      const tm_f4 v = tm_row_x4<IO>(xr, c4);
      s += (v.v[0] + v.v[1]) + (v.v[2] + v.v[3]);
    }
    const float mean = tm_group32_sum(s) * inv_c;
    float q = 0.f;
    for (int c4 = lane; c4 < c4n; c4 += 32) {
      const tm_f4 v = tm_row_x4<IO>(xr, c4);
#pragma unroll
      for (int e = 0; e < 4; ++e) q += (v.v[e] - mean) * (v.v[e] - mean);
    }
    const float rstd = tm_rsqrt(tm_group32_sum(q) * inv_c + p.eps);
    const tm_f4* w4 = (const tm_f4*)p.norm_in_w;
    const tm_f4* b4 = (const tm_f4*)p.norm_in_b;
    for (int c4 = lane; c4 < c4n; c4 += 32) {
      const tm_f4 v = tm_row_x4<IO>(xr, c4), w = w4[c4], b = b4[c4];
      tm_u64h o;
      o.v[0] = tm_pack2((v.v[0] - mean) * rstd * w.v[0] + b.v[0], (v.v[1] - mean) * rstd * w.v[1] + b.v[1]);
      o.v[1] = tm_pack2((v.v[2] - mean) * rstd * w.v[2] + b.v[2], (v.v[3] - mean) * rstd * w.v[3] + b.v[3]);
      ((tm_u64h*)zr)[c4] = o;
    }
    return;
  }
  float s = 0.f;
  for (int c = lane; c < C; c += 32) s += tm_row_x<IO>(xr, c);
  const float mean = tm_group32_sum(s) * inv_c;
  float q = 0.f;
  for (int c = lane; c < C; c += 32) {
    const float d = tm_row_x<IO>(xr, c) - mean;
    q += d * d;
  }
  const float rstd = tm_rsqrt(tm_group32_sum(q) * inv_c + p.eps);
  for (int c = lane; c < C; c += 32) {
    zr[c] = tm_f2h((tm_row_x<IO>(xr, c) - mean) * rstd * p.norm_in_w[c] + p.norm_in_b[c]);
  }
}

extern "C" __global__ void TM_LAUNCH_BOUNDS(INPUT_NORM_THREADS) input_norm(const TmInputParams p) {
  const unsigned lane = tm_tid() & 31u;
  const tm_i64 local = (tm_i64)tm_bid() * INPUT_NORM_ROWS_PER_BLOCK + (tm_tid() >> 5);
  if (local >= p.rows) return;  // whole 32-lane groups exit together: the shuffles stay full
  // One branch per launch on the precision (uniform across the grid).
  if (p.io_dtype == TM_IO_BF16) {
    input_norm_row<TM_IO_BF16>(p, local, lane);
  } else if (p.io_dtype == TM_IO_F16) {
    input_norm_row<TM_IO_F16>(p, local, lane);
  } else {
    input_norm_row<TM_IO_F32>(p, local, lane);
  }
}
