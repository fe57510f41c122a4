// Stage 3a, output LayerNorm over the hidden width, reading the contraction result t in its
// [B, H, N, N] layout and writing the output-projection operand a in [M, H] (gate and a start at
// position buf_row0 in the row-chunked plan):
//   gpumode: a = LN_H(t) ⊙ gate          af3: a = LN_H(t)
// A block takes tile_rows consecutive positions: it loads t[b, :, position] for all h into
// shared memory (16-byte loads along positions when the tile sits inside one batch), computes
// the statistics per position in f32 (two passes, four threads per position), and writes a
// (and reads the gate) 16 bytes at a time along h.
#pragma once

#define OUTPUT_NORM_THREADS 256
static_assert(OUTPUT_NORM_THREADS == TM_STAGE_THREADS, "common/smem.h");

extern "C" __global__ void TM_LAUNCH_BOUNDS(OUTPUT_NORM_THREADS) output_norm(const TmOutputParams p) {
  extern __shared__ float tm_dyn_smem[];
  const int H = p.h, TP = p.tile_rows;
  float* st = tm_dyn_smem;                           // [H][TP + 1]
  float* smean = st + TM_OUTPUT_NORM_TILE(H, TP);    // [TP]
  float* srstd = smean + TP;                         // [TP]; TM_OUTPUT_NORM_SMEM(H, TP) in all
  const tm_i64 first = p.row0 + (tm_i64)tm_bid() * TP;
  const tm_i64 end = p.row0 + p.rows;
  if (first >= end) return;
  const int np = (int)((end - first) < TP ? (end - first) : TP);
  const int tid = (int)tm_tid(), nt = (int)tm_bdim();
  const tm_i64 nn = (tm_i64)p.n * p.n;
  const tm_i64 b0 = first / nn, rem0 = first - b0 * nn;

  if (np == TP && TP % 8 == 0 && nn % 8 == 0 && first % 8 == 0 && rem0 + TP <= nn) {
    const int runs = TP / 8;
    for (int idx = tid; idx < H * runs; idx += nt) {
      const int h = idx / runs, run = idx - h * runs;
      const tm_u128 v = *(const tm_u128*)(p.t + (b0 * H + h) * nn + rem0 + run * 8);
      float* dst = st + h * (TP + 1) + run * 8;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dst[2 * e] = tm_lo(v.v[e]);
        dst[2 * e + 1] = tm_hi(v.v[e]);
      }
    }
  } else {
    for (int idx = tid; idx < H * TP; idx += nt) {
      const int h = idx / TP, r = idx - h * TP;
      if (r < np) {
        const tm_i64 row = first + r;
        const tm_i64 b = row / nn, rem = row - b * nn;
        st[h * (TP + 1) + r] = tm_h2f(p.t[(b * H + h) * nn + rem]);
      }
    }
  }
  tm_sync();
  // Four adjacent threads per position; the loop bound is uniform so every shuffle is full.
  for (int base = 0; base < TP; base += nt / 4) {
    const int r = base + (tid >> 2), part = tid & 3;
    const bool live = r < np;
    float s = 0.f;
    if (live)
      for (int h = part; h < H; h += 4) s += st[h * (TP + 1) + r];
    s += tm_shfl_xor(s, 1);
    s += tm_shfl_xor(s, 2);
    const float mean = s / (float)H;
    float q = 0.f;
    if (live)
      for (int h = part; h < H; h += 4) {
        const float d = st[h * (TP + 1) + r] - mean;
        q += d * d;
      }
    q += tm_shfl_xor(q, 1);
    q += tm_shfl_xor(q, 2);
    if (live && part == 0) {
      smean[r] = mean;
      srstd[r] = tm_rsqrt(q / (float)H + p.eps);
    }
  }
  tm_sync();
  if (H % 8 == 0 && (p.formulation == TM_AF3 || p.g % 8 == 0)) {
    const int hr = H / 8;
    for (int idx = tid; idx < np * hr; idx += nt) {
      const int r = idx / hr, h0 = (idx - r * hr) * 8;
      const tm_i64 row = first + r;
      const float mean = smean[r], rstd = srstd[r];
      float v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[e] = (st[(h0 + e) * (TP + 1) + r] - mean) * rstd * p.norm_out_w[h0 + e] + p.norm_out_b[h0 + e];
      }
      if (p.formulation != TM_AF3) {
        const tm_u128 g = *(const tm_u128*)(p.gate + (row - p.buf_row0) * (tm_i64)p.g + h0);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          v[2 * e] *= tm_lo(g.v[e]);
          v[2 * e + 1] *= tm_hi(g.v[e]);
        }
      }
      tm_u128 o;
#pragma unroll
      for (int e = 0; e < 4; ++e) o.v[e] = tm_pack2(v[2 * e], v[2 * e + 1]);
      *(tm_u128*)(p.a + (row - p.buf_row0) * (tm_i64)H + h0) = o;
    }
  } else {
    for (int idx = tid; idx < np * H; idx += nt) {
      const int r = idx / H, h = idx - r * H;
      const tm_i64 row = first + r;
      float v = (st[h * (TP + 1) + r] - smean[r]) * srstd[r] * p.norm_out_w[h] + p.norm_out_b[h];
      if (p.formulation != TM_AF3) v *= tm_h2f(p.gate[(row - p.buf_row0) * (tm_i64)p.g + h]);
      p.a[(row - p.buf_row0) * (tm_i64)H + h] = tm_f2h(v);
    }
  }
}
