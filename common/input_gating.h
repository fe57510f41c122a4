// Stage 1c, gating epilogue of the fused input projection. For a chunk of positions it reads
// the projection P = z·Wᵀ (+ bias) with columns [lp | lg | rp | rg | og] and writes
//   left  = lp ⊙ mask ⊙ σ(lg)     right = rp ⊙ mask ⊙ σ(rg)     (af3: a, b — the same form)
//   gate  = σ(og)                 (width G: H for gpumode, C for af3)
// left/right go to the contraction layout [B, H, N, N]: positions are transposed through shared
// memory so that both the reads (along h) and the writes (along positions) are coalesced.
#pragma once

#define INPUT_GATING_THREADS 256

extern "C" __global__ void TM_LAUNCH_BOUNDS(INPUT_GATING_THREADS) input_gating(const TrimulParams p) {
  extern __shared__ float tm_dyn_smem[];
  const int H = p.h, G = p.g, P = p.p, TR = p.tile_rows;
  tm_half* sl = (tm_half*)tm_dyn_smem;       // [H][TR + 1]
  tm_half* sr = sl + H * (TR + 1);            // [H][TR + 1]
  const tm_i64 first = (tm_i64)tm_bid() * TR;  // chunk-local position of this block's tile
  if (first >= p.rows) return;
  const int nr = (int)((p.rows - first) < TR ? (p.rows - first) : TR);
  const unsigned tid = tm_tid(), nt = tm_bdim();
  const float* bias = p.proj_bias;

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
    p.gate[(p.row0 + local) * (tm_i64)G + g] = tm_f2h(tm_sigmoid(og));
  }
  tm_sync();
  const tm_i64 nn = (tm_i64)p.n * p.n;
  for (int idx = tid; idx < H * nr; idx += nt) {
    const int h = idx / nr, r = idx - h * nr;
    const tm_i64 row = p.row0 + first + r;
    const tm_i64 b = row / nn, rem = row - b * nn;
    const tm_i64 dst = (b * H + h) * nn + rem;
    p.left[dst] = sl[h * (TR + 1) + r];
    p.right[dst] = sr[h * (TR + 1) + r];
  }
}
