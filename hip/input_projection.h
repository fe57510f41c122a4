// Stage 1 fused on AMD matrix cores: the input LayerNorm, the five input projections and the
// gating in one pass (in one-pass plans every hidden channel and the gate of a position at once):
//   z     = LN_C(x; norm_in)                                   (f16, in LDS only)
//   left  = (z·Wlpᵀ + blp) ⊙ mask ⊙ σ(z·Wlgᵀ + blg)             [B, H, N, N] f16
//   right = (z·Wrpᵀ + brp) ⊙ mask ⊙ σ(z·Wrgᵀ + brg)             [B, H, N, N] f16
//   gate  = σ(z·Wogᵀ + bog)                                    [M, G] f16 (G = H gpumode, C af3)
// with W = w_in [P, C] f16, rows [lp; lg; rp; rg; og] (P = 4H + G), and proj_bias [P] f32 or null:
// what input_norm + the projection GEMM + input_gating compute, without writing and re-reading z
// and the [M, P] projection (the projection stays in f32 registers here; the staged path rounds it
// to f16, so the two agree to f16 rounding, not bit for bit).
//
// A launch may do part of that (the chunked plans, crate::plan): work items [chunk_begin,
// chunk_end) only (chunk_end 0: all), where items 0 .. ceil(H/32) are the hidden tiles of 32
// channels and the next ceil(G/32) the gate tiles of 32 columns; and left/right may hold only the
// hidden channels lr_h0 .. lr_h0 + lr_h, as [B, lr_h, N, N] (lr_h 0: all H). A hidden pass runs
// the tiles covering its channels, the output stage's gate pass the gate tiles alone; W, its bias
// and the gate keep their full layouts.
//
// A block owns OP_BM = 64 consecutive positions (first = row0 + 64·block):
//   1. LN_C per position, one 32-lane group per position, two passes over x's row in f32 (as
//      input_norm), z -> LDS sz[64][C + 4] f16 (the +4 keeps rows 8-byte aligned and spreads the
//      banks the MFMA operand reads hit);
//   2. work items, dealt to the 4 waves in turn: a hidden tile of 32 channels h0.. (both 32-position
//      halves: 8 accumulators, lp/lg/rp/rg × 2) computes D[h][position] = W·zᵀ, so that each lane
//      holds one position and 16 channels and a store of one channel by the 32 lanes is 64
//      consecutive bytes of left/right; a gate tile of 32 columns g0.. (2 accumulators) computes
//      D[position][g] = z·Wᵀ, so that the 32 lanes store 32 consecutive gate columns of a position.
//      The operand loads are the same in both orientations: a lane reads 4 consecutive channels of
//      z (one row of sz) and of one W row (8 bytes from global memory); only the MFMA's A and B swap.
//   3. epilogues in f32: bias, σ, mask, products, then f16 stores.
// Requirements checked by the host: C % 4 == 0 (8-byte W loads), LDS TM_HIP_IP_SMEM(C) <= 64 KiB
// (C <= 508), 256 threads per block; left/right hold the window's channels of every position, the
// gate the launch's positions from buf_row0. H and G need not be multiples of 32 (partial tiles
// are masked).
// Operand layouts: see hip/mfma.h.
#pragma once
#include "common/pair_io.h"

#define INPUT_PROJECTION_THREADS 256
#define IP_BM 64
#define IP_WAVES (INPUT_PROJECTION_THREADS / 64)
static_assert(INPUT_PROJECTION_THREADS == TM_STAGE_THREADS && IP_BM == TM_HIP_IP_ROWS, "common/smem.h");
constexpr int ip_lds_bytes(int C) { return 2 * IP_BM * (C + 4); }
static_assert(ip_lds_bytes(4) == TM_HIP_IP_SMEM(4) && ip_lds_bytes(508) == TM_HIP_IP_SMEM(508), "common/smem.h");

// Step 1 for x in precision IO: z of the block's positions into sz (rows past the end zero).
template <int IO>
TM_INLINE void input_projection_norm(const TmInputParams& p, tm_half* sz, tm_i64 first, int np) {
  const int C = p.c, SZ = C + 4, c4n = C / 4;
  const unsigned lane = tm_tid() & 31u, group = tm_tid() >> 5, groups = tm_bdim() >> 5;
  const float inv_c = 1.0f / (float)C;
  for (int r = (int)group; r < IP_BM; r += (int)groups) {  // whole groups: the shuffles stay full
    tm_half* zr = sz + r * SZ;
    if (r >= np) {
      for (int c = (int)lane; c < C; c += 32) zr[c] = 0;
      continue;
    }
    const tm_i64 at = (first + r) * (tm_i64)C;
    const void* TM_RESTRICT xr = IO == TM_IO_F32 ? (const void*)(p.x + at) : (const void*)((const tm_half*)p.x + at);
    float s = 0.f;
    for (int c4 = (int)lane; c4 < c4n; c4 += 32) {
      const tm_f4 v = tm_row_x4<IO>(xr, c4);
      s += (v.v[0] + v.v[1]) + (v.v[2] + v.v[3]);
    }
    const float mean = tm_group32_sum(s) * inv_c;
    float q = 0.f;
    for (int c4 = (int)lane; c4 < c4n; c4 += 32) {
      const tm_f4 v = tm_row_x4<IO>(xr, c4);
#pragma unroll
      for (int e = 0; e < 4; ++e) q += (v.v[e] - mean) * (v.v[e] - mean);
    }
    const float rstd = tm_rsqrt(tm_group32_sum(q) * inv_c + p.eps);
    for (int c4 = (int)lane; c4 < c4n; c4 += 32) {
      const tm_f4 v = tm_row_x4<IO>(xr, c4);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 4 * c4 + e;
        zr[c] = tm_f2h((v.v[e] - mean) * rstd * p.norm_in_w[c] + p.norm_in_b[c]);
      }
    }
  }
}

extern "C" __global__ void TM_LAUNCH_BOUNDS(INPUT_PROJECTION_THREADS) input_projection(const TmInputParams p) {
  extern __shared__ float tm_dyn_smem[];
  const int C = p.c, H = p.h, G = p.g, SZ = C + 4;
  tm_half* sz = (tm_half*)tm_dyn_smem;  // [BM][C + 4]
  const tm_i64 first = p.row0 + (tm_i64)tm_bid() * IP_BM;
  const tm_i64 end = p.row0 + p.rows;
  if (first >= end) return;  // the whole block leaves together
  const int np = (int)((end - first) < IP_BM ? (end - first) : IP_BM);
  const tm_i64 nn = (tm_i64)p.n * p.n;
  const tm_half* TM_RESTRICT w = p.w_in;
  const float* TM_RESTRICT bias = p.proj_bias;

  // 1. One branch per launch on the precision (uniform across the grid).
  if (p.io_dtype == TM_IO_BF16) {
    input_projection_norm<TM_IO_BF16>(p, sz, first, np);
  } else if (p.io_dtype == TM_IO_F16) {
    input_projection_norm<TM_IO_F16>(p, sz, first, np);
  } else {
    input_projection_norm<TM_IO_F32>(p, sz, first, np);
  }
  tm_sync();

  // 2. Everything that decides whether an MFMA runs depends on the wave only, so all 64 lanes are
  // active at every v_mfma (the instruction reads operands from the whole wave).
  const unsigned wave = tm_tid() >> 6, lane = tm_tid() & 63u;
  const int l32 = (int)(lane & 31u);    // the W row / z row this lane feeds, and its D column
  const int kq = (int)(lane >> 5) * 4;  // first of the 4 reduction indices this lane holds
  const int hidden_tiles = (H + 31) / 32, gate_tiles = (G + 31) / 32;
  const int item_end = p.chunk_end > 0 ? p.chunk_end : hidden_tiles + gate_tiles;
  const int lr0 = p.lr_h > 0 ? p.lr_h0 : 0, lr_n = p.lr_h > 0 ? p.lr_h : H;  // left/right's window
  const tm_half* z0 = sz + l32 * SZ + kq;         // positions 0..31
  const tm_half* z1 = sz + (32 + l32) * SZ + kq;  // positions 32..63
  for (int item = p.chunk_begin + (int)wave; item < item_end; item += IP_WAVES) {
    if (item < hidden_tiles) {
      // Hidden channels h0 + l32 of the four gated projections: this lane's W rows.
      const int h0 = 32 * item, h = h0 + l32;
      const bool h_ok = h < H;
      const tm_half* wr = w + (tm_i64)(h_ok ? h : 0) * C + kq;
      const tm_i64 step = (tm_i64)H * C;  // from one projection's rows to the next's
      tm_float16 lp0 = {}, lg0 = {}, rp0 = {}, rg0 = {}, lp1 = {}, lg1 = {}, rp1 = {}, rg1 = {};
      for (int k0 = 0; k0 < C; k0 += 8) {
        // A lane whose 4 channels lie past C (C % 8 == 4) or whose row is past H feeds zeros.
        const bool k_ok = k0 + kq < C;
        const tm_half4 zero = {};
        const tm_half4 b0 = k_ok ? tm_load_half4(z0 + k0) : zero;
        const tm_half4 b1 = k_ok ? tm_load_half4(z1 + k0) : zero;
        const bool ok = h_ok && k_ok;
        const tm_half4 alp = ok ? tm_load_half4(wr + k0) : zero;
        const tm_half4 alg = ok ? tm_load_half4(wr + step + k0) : zero;
        const tm_half4 arp = ok ? tm_load_half4(wr + 2 * step + k0) : zero;
        const tm_half4 arg = ok ? tm_load_half4(wr + 3 * step + k0) : zero;
        lp0 = tm_mfma_32x32x8_f16(alp, b0, lp0);
        lg0 = tm_mfma_32x32x8_f16(alg, b0, lg0);
        rp0 = tm_mfma_32x32x8_f16(arp, b0, rp0);
        rg0 = tm_mfma_32x32x8_f16(arg, b0, rg0);
        lp1 = tm_mfma_32x32x8_f16(alp, b1, lp1);
        lg1 = tm_mfma_32x32x8_f16(alg, b1, lg1);
        rp1 = tm_mfma_32x32x8_f16(arp, b1, rp1);
        rg1 = tm_mfma_32x32x8_f16(arg, b1, rg1);
      }
      // 3. Element e of this lane is D row (channel) h0 + 8*(e/4) + 4*(lane/32) + e%4 and
      // column (position) l32 of its half.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 32 * half + l32;
        if (r >= np) continue;
        const tm_i64 row = first + r;
        const tm_i64 b = row / nn, rem = row - b * nn;
        const float m = p.mask ? p.mask[row] : 1.0f;
#pragma unroll
        for (int e = 0; e < 16; ++e) {
          const int hc = h0 + tm_mfma_d_row(e, lane);
          if (hc >= H || hc < lr0 || hc >= lr0 + lr_n) continue;
          float vlp = half ? lp1[e] : lp0[e], vlg = half ? lg1[e] : lg0[e];
          float vrp = half ? rp1[e] : rp0[e], vrg = half ? rg1[e] : rg0[e];
          if (bias) {
            vlp += bias[hc];
            vlg += bias[H + hc];
            vrp += bias[2 * H + hc];
            vrg += bias[3 * H + hc];
          }
          const tm_i64 dst = (b * lr_n + (hc - lr0)) * nn + rem;
          p.left[dst] = tm_f2h(vlp * m * tm_sigmoid(vlg));
          p.right[dst] = tm_f2h(vrp * m * tm_sigmoid(vrg));
        }
      }
    } else {
      // Gate columns g0 + l32: z is the A operand here (D[position][column]).
      const int g0 = 32 * (item - hidden_tiles), g = g0 + l32;
      const bool g_ok = g < G;
      const tm_half* wr = w + (tm_i64)(4 * H + (g_ok ? g : 0)) * C + kq;
      tm_float16 og0 = {}, og1 = {};
      for (int k0 = 0; k0 < C; k0 += 8) {
        const bool k_ok = k0 + kq < C;
        const tm_half4 zero = {};
        const tm_half4 a0 = k_ok ? tm_load_half4(z0 + k0) : zero;
        const tm_half4 a1 = k_ok ? tm_load_half4(z1 + k0) : zero;
        const tm_half4 bw = (g_ok && k_ok) ? tm_load_half4(wr + k0) : zero;
        og0 = tm_mfma_32x32x8_f16(a0, bw, og0);
        og1 = tm_mfma_32x32x8_f16(a1, bw, og1);
      }
      if (g_ok) {
        const float bg = bias ? bias[4 * H + g] : 0.f;
#pragma unroll
        for (int e = 0; e < 16; ++e) {
          const int i = tm_mfma_d_row(e, lane);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = 32 * half + i;
            if (r < np) {
              const float v = (half ? og1[e] : og0[e]) + bg;
              p.gate[(first + r - p.buf_row0) * (tm_i64)G + g] = tm_f2h(tm_sigmoid(v));
            }
          }
        }
      }
    }
  }
}
