// Stage 1c, gating epilogue of the chunked input projection. For a chunk of positions it reads
// the projection P = z·Wᵀ (+ bias) with columns [lp | lg | rp | rg | og] and writes
//   left  = lp ⊙ mask ⊙ σ(lg)     right = rp ⊙ mask ⊙ σ(rg)     (af3: a, b — the same form)
//   gate  = σ(og)                 (width G: H for gpumode, C for af3)
// left/right go to the contraction layout [B, H, N, N]: positions are transposed through shared
// memory so that both the reads (along h) and the writes (along positions) are coalesced, 16
// bytes per access when H, G and N² are multiples of 8 (every published shape), else 2 bytes.
#pragma once

#define INPUT_GATING_THREADS 256
static_assert(INPUT_GATING_THREADS == TM_STAGE_THREADS, "common/smem.h");

extern "C" __global__ void TM_LAUNCH_BOUNDS(INPUT_GATING_THREADS) input_gating(const TmInputParams p) {
  extern __shared__ float tm_dyn_smem[];
  const int H = p.proj_h, G = p.proj_g, P = 4 * H + G, TR = p.tile_rows;
  tm_half* sl = (tm_half*)tm_dyn_smem;              // [H][TR + 1]
  tm_half* sr = sl + TM_INPUT_GATING_TILE(H, TR);    // [H][TR + 1]; TM_INPUT_GATING_SMEM(H, TR) in all
  const tm_i64 first = (tm_i64)tm_bid() * TR;  // chunk-local position of this block's tile
  if (first >= p.rows) return;
  const int nr = (int)((p.rows - first) < TR ? (p.rows - first) : TR);
  const int tid = (int)tm_tid(), nt = (int)tm_bdim();
  const float* bias = p.proj_bias;
  const tm_i64 nn = (tm_i64)p.n * p.n;
  const bool vec_in = (H % 8 == 0) && (G % 8 == 0) && (P % 8 == 0);

  if (vec_in) {
    const int h8 = H / 8;
    for (int idx = tid; idx < nr * h8; idx += nt) {
      const int r = idx / h8, h0 = (idx - r * h8) * 8;
      const tm_half* pr = p.proj + (first + r) * (tm_i64)P + h0;
      const float m = p.mask ? p.mask[p.row0 + first + r] : 1.0f;
      const tm_u128 vlp = *(const tm_u128*)pr, vlg = *(const tm_u128*)(pr + H);
      const tm_u128 vrp = *(const tm_u128*)(pr + 2 * H), vrg = *(const tm_u128*)(pr + 3 * H);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int w = e >> 1;
        float lp = (e & 1) ? tm_hi(vlp.v[w]) : tm_lo(vlp.v[w]);
        float lg = (e & 1) ? tm_hi(vlg.v[w]) : tm_lo(vlg.v[w]);
        float rp = (e & 1) ? tm_hi(vrp.v[w]) : tm_lo(vrp.v[w]);
        float rg = (e & 1) ? tm_hi(vrg.v[w]) : tm_lo(vrg.v[w]);
        if (bias) {
          lp += bias[h0 + e];
          lg += bias[H + h0 + e];
          rp += bias[2 * H + h0 + e];
          rg += bias[3 * H + h0 + e];
        }
        sl[(h0 + e) * (TR + 1) + r] = tm_f2h(lp * m * tm_sigmoid(lg));
        sr[(h0 + e) * (TR + 1) + r] = tm_f2h(rp * m * tm_sigmoid(rg));
      }
    }
    const int g8 = G / 8;
    for (int idx = tid; idx < nr * g8; idx += nt) {
      const int r = idx / g8, g0 = (idx - r * g8) * 8;
      const tm_i64 local = first + r;
      const tm_u128 v = *(const tm_u128*)(p.proj + local * (tm_i64)P + 4 * H + g0);
      float o[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        o[e] = (e & 1) ? tm_hi(v.v[e >> 1]) : tm_lo(v.v[e >> 1]);
        if (bias) o[e] += bias[4 * H + g0 + e];
      }
      tm_u128 out;
#pragma unroll
      for (int w = 0; w < 4; ++w) out.v[w] = tm_pack2(tm_sigmoid(o[2 * w]), tm_sigmoid(o[2 * w + 1]));
      *(tm_u128*)(p.gate + (p.row0 + local - p.buf_row0) * (tm_i64)G + g0) = out;
    }
  } else {
    for (int idx = tid; idx < nr * H; idx += nt) {
      const int r = idx / H, h = idx - r * H;
      const tm_half* pr = p.proj + (first + r) * (tm_i64)P;
      const float m = p.mask ? p.mask[p.row0 + first + r] : 1.0f;
      float lp = tm_h2f(pr[h]), lg = tm_h2f(pr[H + h]), rp = tm_h2f(pr[2 * H + h]), rg = tm_h2f(pr[3 * H + h]);
      if (bias) {
        lp += bias[h];
        lg += bias[H + h];
        rp += bias[2 * H + h];
        rg += bias[3 * H + h];
      }
      sl[h * (TR + 1) + r] = tm_f2h(lp * m * tm_sigmoid(lg));
      sr[h * (TR + 1) + r] = tm_f2h(rp * m * tm_sigmoid(rg));
    }
    for (int idx = tid; idx < nr * G; idx += nt) {
      const int r = idx / G, g = idx - r * G;
      const tm_i64 local = first + r;
      float og = tm_h2f(p.proj[local * (tm_i64)P + 4 * H + g]);
      if (bias) og += bias[4 * H + g];
      p.gate[(p.row0 + local - p.buf_row0) * (tm_i64)G + g] = tm_f2h(tm_sigmoid(og));
    }
  }
  tm_sync();
  const tm_i64 row_first = p.row0 + first;
  const tm_i64 b0 = row_first / nn, rem0 = row_first - b0 * nn;
  if (nr == TR && TR % 8 == 0 && nn % 8 == 0 && rem0 % 8 == 0 && rem0 + TR <= nn) {
    // The whole tile lies in one batch and starts 8-aligned: runs of 8 positions, 16 bytes each.
    const int runs = TR / 8;
    for (int idx = tid; idx < 2 * H * runs; idx += nt) {
      const int side = idx / (H * runs), rest = idx - side * H * runs;
      const int h = rest / runs, run = rest - h * runs;
      const tm_half* src = (side ? sr : sl) + h * (TR + 1) + run * 8;
      tm_u128 o;
#pragma unroll
      for (int w = 0; w < 4; ++w) o.v[w] = (unsigned)src[2 * w] | ((unsigned)src[2 * w + 1] << 16);
      *(tm_u128*)((side ? p.right : p.left) + (b0 * H + h) * nn + rem0 + run * 8) = o;
    }
  } else {
    for (int idx = tid; idx < H * nr; idx += nt) {
      const int h = idx / nr, r = idx - h * nr;
      const tm_i64 row = row_first + r;
      const tm_i64 b = row / nn, rem = row - b * nn;
      const tm_i64 dst = (b * H + h) * nn + rem;
      p.left[dst] = sl[h * (TR + 1) + r];
      p.right[dst] = sr[h * (TR + 1) + r];
    }
  }
}
