// Stage 3a, output LayerNorm over the hidden width, reading the contraction result t in its
// [B, H, N, N] layout and writing the output-projection operand a in [M, H]:
//   gpumode: a = LN_H(t) ⊙ gate          af3: a = LN_H(t)
// A block takes tile_rows consecutive positions: it loads t[b, :, position] for all h into
// shared memory (coalesced along positions), computes the statistics per position in f32 (two
// passes), and writes a coalesced along h.
#pragma once

#define OUTPUT_NORM_THREADS 256

extern "C" __global__ void TM_LAUNCH_BOUNDS(OUTPUT_NORM_THREADS) output_norm(const TrimulParams p) {
  extern __shared__ float tm_dyn_smem[];
  const int H = p.h, TP = p.tile_rows;
  float* st = tm_dyn_smem;             // [H][TP + 1]
  float* smean = st + H * (TP + 1);    // [TP]
  float* srstd = smean + TP;           // [TP]
  const tm_i64 first = p.row0 + (tm_i64)tm_bid() * TP;
  const tm_i64 end = p.row0 + p.rows;
  if (first >= end) return;
  const int np = (int)((end - first) < TP ? (end - first) : TP);
  const unsigned tid = tm_tid(), nt = tm_bdim();
  const tm_i64 nn = (tm_i64)p.n * p.n;

  for (int idx = tid; idx < H * TP; idx += nt) {
    const int h = idx / TP, r = idx - h * TP;
    if (r < np) {
      const tm_i64 row = first + r;
      const tm_i64 b = row / nn, rem = row - b * nn;
      st[h * (TP + 1) + r] = tm_h2f(p.t[(b * H + h) * nn + rem]);
    }
  }
  tm_sync();
  for (int r = tid; r < np; r += nt) {
    float s = 0.f;
    for (int h = 0; h < H; ++h) s += st[h * (TP + 1) + r];
    const float mean = s / (float)H;
    float q = 0.f;
    for (int h = 0; h < H; ++h) {
      const float d = st[h * (TP + 1) + r] - mean;
      q += d * d;
    }
    smean[r] = mean;
    srstd[r] = tm_rsqrt(q / (float)H + p.eps);
  }
  tm_sync();
  for (int idx = tid; idx < np * H; idx += nt) {
    const int r = idx / H, h = idx - r * H;
    const tm_i64 row = first + r;
    float v = (st[h * (TP + 1) + r] - smean[r]) * srstd[r] * p.norm_out_w[h] + p.norm_out_b[h];
    if (!p.af3) v *= tm_h2f(p.gate[row * (tm_i64)p.g + h]);
    p.a[row * (tm_i64)H + h] = tm_f2h(v);
  }
}
