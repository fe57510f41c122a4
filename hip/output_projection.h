// Stage 3 fused on AMD matrix cores: output LayerNorm, gate and output projection in one pass.
//   gpumode: y = (LN_H(t) ⊙ gate) · Woutᵀ                gate [M, H]
//   af3:     y = gate ⊙ (LN_H(t) · Woutᵀ + bout)         gate [M, C], bout optional
// It replaces output_norm + the output GEMM (+ bias + output_gate) of the rocBLAS path and saves
// writing and re-reading the [M, H] operand `a`.
//
// A block owns OP_BM = 64 consecutive positions and every output channel:
//   1. t[b, :, position] for its positions -> LDS st[H][BM+2] (f16, coalesced along positions);
//   2. mean and rstd per position in f32, two passes (4 lanes per position, xor-shuffle 1, 2);
//   3. a = (t - mean)·rstd·w + b (⊙ gate for gpumode) -> LDS sa[BM][H+4] as f16, the row-major
//      A operand (positions are the MFMA rows i, hidden channels the reduction index k);
//   4. each of the 4 waves takes 32-channel column tiles c0 = 32·(wave + 4·s) and accumulates the
//      two 32x32 tiles (positions 0..31 and 32..63) over k in steps of 8 with
//      v_mfma_f32_32x32x8f16. B[k][j] = Wout[c0 + j][k] is read straight from global memory
//      (Wout [C, H] f16 row-major: 4 consecutive k of one row = one 8-byte load per lane).
//   5. epilogue per D element (i, j): y[first + i][c0 + j] (+ bout[c], ⊙ gate for af3), in the
//      launch's I/O precision (f32, or bf16/f16 rounded to nearest even).
// Requirements checked by the host (select_output_path): H % 8 == 0, LDS bytes
// TM_HIP_OP_SMEM(H) <= 64 KiB (H <= 248), 256 threads per block.
// Operand layouts: see hip/mfma.h.
#pragma once
#include "common/pair_io.h"

#define OUTPUT_PROJECTION_THREADS 256
#define OP_BM 64
#define OP_WAVES (OUTPUT_PROJECTION_THREADS / 64)
#define OP_ST_STRIDE (OP_BM + 2)  // f16 per row of st: +2 keeps h-strided reads off one bank
static_assert(OUTPUT_PROJECTION_THREADS == TM_STAGE_THREADS && OP_BM == TM_HIP_OP_ROWS, "common/smem.h");
// The LDS the layout below takes for H channels (sa, smean, srstd, st), which the host passes as
// TM_HIP_OP_SMEM(H): affine in H, so two widths check it for all.
constexpr int op_lds_bytes(int H) { return 2 * OP_BM * (H + 4) + 2 * 4 * OP_BM + 2 * H * OP_ST_STRIDE; }
static_assert(op_lds_bytes(8) == TM_HIP_OP_SMEM(8) && op_lds_bytes(248) == TM_HIP_OP_SMEM(248), "common/smem.h");

extern "C" __global__ void TM_LAUNCH_BOUNDS(OUTPUT_PROJECTION_THREADS)
    output_projection(const TmOutputParams p) {
  const tm_half* TM_RESTRICT wout = p.w_out;
  const float* TM_RESTRICT out_bias = p.out_bias;
  extern __shared__ float tm_dyn_smem[];
  const int H = p.h, C = p.c, G = p.g;
  const int SA = H + 4;  // f16 per row of sa; H % 4 == 0 keeps rows 8-byte aligned
  tm_half* sa = (tm_half*)tm_dyn_smem;         // [BM][H + 4]
  float* smean = (float*)(sa + OP_BM * SA);    // [BM]
  float* srstd = smean + OP_BM;                // [BM]
  tm_half* st = (tm_half*)(srstd + OP_BM);     // [H][BM + 2]

  const tm_i64 first = p.row0 + (tm_i64)tm_bid() * OP_BM;
  const tm_i64 end = p.row0 + p.rows;
  if (first >= end) return;  // the whole block leaves together
  const int np = (int)((end - first) < OP_BM ? (end - first) : OP_BM);
  const unsigned tid = tm_tid(), nt = tm_bdim();
  const tm_i64 nn = (tm_i64)p.n * p.n;

  // 1. t tile; rows past the end are zero so that step 2 stays finite for them.
  for (int idx = tid; idx < H * OP_BM; idx += nt) {
    const int h = idx / OP_BM, r = idx - h * OP_BM;
    tm_half v = 0;
    if (r < np) {
      const tm_i64 row = first + r;
      const tm_i64 b = row / nn, rem = row - b * nn;
      v = p.t[(b * H + h) * nn + rem];
    }
    st[h * OP_ST_STRIDE + r] = v;
  }
  tm_sync();

  // 2. statistics: 4 consecutive lanes per position (nt is a multiple of 4, so every lane of a
  // wave runs the same number of iterations and the shuffles see full groups).
  for (int r = tid >> 2; r < OP_BM; r += nt >> 2) {
    const int q = tid & 3;
    float s = 0.f;
    for (int h = q; h < H; h += 4) s += tm_h2f(st[h * OP_ST_STRIDE + r]);
    s += tm_shfl_xor(s, 1);
    s += tm_shfl_xor(s, 2);
    const float mean = s / (float)H;
    float v = 0.f;
    for (int h = q; h < H; h += 4) {
      const float d = tm_h2f(st[h * OP_ST_STRIDE + r]) - mean;
      v += d * d;
    }
    v += tm_shfl_xor(v, 1);
    v += tm_shfl_xor(v, 2);
    if (q == 0) {
      smean[r] = mean;
      srstd[r] = tm_rsqrt(v / (float)H + p.eps);
    }
  }
  tm_sync();

  // 3. the A operand, rounded to f16 as the rocBLAS path rounds `a`.
  for (int idx = tid; idx < OP_BM * H; idx += nt) {
    const int r = idx / H, h = idx - r * H;
    float v = 0.f;
    if (r < np) {
      v = (tm_h2f(st[h * OP_ST_STRIDE + r]) - smean[r]) * srstd[r] * p.norm_out_w[h] + p.norm_out_b[h];
      if (p.formulation != TM_AF3) v *= tm_h2f(p.gate[(first + r - p.buf_row0) * (tm_i64)G + h]);
    }
    sa[r * SA + h] = tm_f2h(v);
  }
  tm_sync();

  // 4. MFMA. Everything that decides whether an MFMA runs depends on the wave only, so all 64
  // lanes are active at every v_mfma (the instruction reads operands from the whole wave).
  const unsigned wave = tid >> 6, lane = tid & 63u;
  const int l32 = (int)(lane & 31u);   // A row i, B column j and D column j of this lane
  const int kq = (int)(lane >> 5) * 4; // first of the 4 reduction indices this lane holds
  const int tiles = (C + 31) / 32;
  for (int tile = (int)wave; tile < tiles; tile += OP_WAVES) {
    const int c = tile * 32 + l32;     // this lane's output channel (B column, D column)
    const bool c_ok = c < C;
    const tm_half* wrow = wout + (tm_i64)(c_ok ? c : 0) * H;
    tm_float16 acc0 = {}, acc1 = {};
    for (int k0 = 0; k0 < H; k0 += 8) {
      tm_half4 bf = tm_load_half4(wrow + k0 + kq);
      if (!c_ok) bf = (tm_half4){};
      const tm_half4 a0 = tm_load_half4(sa + l32 * SA + k0 + kq);         // positions 0..31
      const tm_half4 a1 = tm_load_half4(sa + (32 + l32) * SA + k0 + kq);  // positions 32..63
      acc0 = tm_mfma_32x32x8_f16(a0, bf, acc0);
      acc1 = tm_mfma_32x32x8_f16(a1, bf, acc1);
    }
    // 5. epilogue: element e of this lane is D row 8*(e/4) + 4*(lane/32) + e%4, column l32.
    if (c_ok) {
      const float bias = out_bias ? out_bias[c] : 0.f;
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        const int i = tm_mfma_d_row(e, lane);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 32 * half + i;
          if (r < np) {
            const tm_i64 row = first + r;
            float v = (half ? acc1[e] : acc0[e]) + bias;
            if (p.formulation == TM_AF3) v *= tm_h2f(p.gate[(row - p.buf_row0) * (tm_i64)G + c]);
            tm_store_y(p, row * (tm_i64)C + c, v);
          }
        }
      }
    }
  }
}
