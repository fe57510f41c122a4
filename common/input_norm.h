// Stage 1a, input LayerNorm:  z = LN_C(x; norm_in.weight, norm_in.bias), stored as f16.
//
// One group of 32 lanes per position. Statistics in f32 with two passes over the row (mean,
// then the centred sum of squares), because Cauchy inputs make the one-pass E[x²] − E[x]²
// cancel catastrophically. The row (≤ 16 KB) is re-read from L1/L2, not from DRAM.
#pragma once

#define INPUT_NORM_THREADS 256
#define INPUT_NORM_ROWS_PER_BLOCK (INPUT_NORM_THREADS / 32)

extern "C" __global__ void TM_LAUNCH_BOUNDS(INPUT_NORM_THREADS) input_norm(const TrimulParams p) {
  const unsigned lane = tm_tid() & 31u;
  const tm_i64 local = (tm_i64)tm_bid() * INPUT_NORM_ROWS_PER_BLOCK + (tm_tid() >> 5);
  if (local >= p.rows) return;  // whole 32-lane groups exit together: the shuffles stay full
  const int C = p.c;
  const float* TM_RESTRICT xr = p.x + (p.row0 + local) * (tm_i64)C;
  tm_half* TM_RESTRICT zr = p.z + local * (tm_i64)C;
  const float inv_c = 1.0f / (float)C;

  float s = 0.f;
  for (int c = lane; c < C; c += 32) s += xr[c];
  const float mean = tm_group32_sum(s) * inv_c;
  float q = 0.f;
  for (int c = lane; c < C; c += 32) {
    const float d = xr[c] - mean;
    q += d * d;
  }
  const float rstd = tm_rsqrt(tm_group32_sum(q) * inv_c + p.eps);
  for (int c = lane; c < C; c += 32) {
    zr[c] = tm_f2h((xr[c] - mean) * rstd * p.norm_in_w[c] + p.norm_in_b[c]);
  }
}
