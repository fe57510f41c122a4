// The backward's output side in one kernel (af3, 16-bit I/O): LN_H recomputed from t, the output
// projection s = u·Wzᵀ + bz, the output gate's backward, du = ds·Wz and LN_H's backward, for 64
// positions at a time, with both GEMMs on the tensor cores from shared memory. It replaces the
// step list's output_norm, the s GEMM, output_gate, the du GEMM and output_norm_grad, and with
// them the f32 u, s/ds and du that went through DRAM between those steps (docs/backward.md, "The
// CUDA backward"). With g = σ(P_G + bg):
//
//   u  = LN_H(t) = t̂⊙γ + β                        [64, H], f16 in shared memory; bf16 out (dWz)
//   s  = u·Wzᵀ + bz                                mma.sync m16n8k16, f32 accumulators
//   ds = dy⊙g,  dG = dy⊙s⊙g(1 − g)                 ds bf16 out (dWz), dG bf16 over P_G
//   du = ds·Wz                                     from ds·2^k in f16 (below), f32 accumulators
//   dt = ρ·(ĝ − mean(ĝ) − t̂·mean(ĝ⊙t̂)), ĝ = du⊙γ   bf16, hidden-major, over t
//
// and the column sums Σ du⊙t̂, Σ du (γ's and β's gradients) and Σ ds (bz's), per block in f32 over
// its tiles, then in f64 into `partial` (backward_column_finish adds the blocks). dWz = Σ dsᵀ·u is
// the caller's GEMM on the bf16 ds and u this kernel writes.
//
// Precision. u is f16 as the forward's output kernel has it (|t̂| < √H, so u keeps f16's 11 bits
// of significand). ds is a gradient, with no range f16 is sure to hold, and its rounding to bf16 on
// the way to du cost 2e-3 of every upstream gradient's accuracy (docs/perf/NOTES.md, twenty-sixth
// session): du's GEMM reads ds scaled by 2^k, k chosen per tile so that the tile's largest |dy|
// (≥ |ds|, as 0 < g < 1) lies in [2^14, 2^15), in f16 (11 bits, as TF32 has, with 29 binades below
// the tile's largest value), and multiplies the result by 2^-k. The scale follows |dy|, not |ds|:
// where a tile's gates are nearly closed (g below about 1e-5 throughout), its scaled ds stays far
// under 2^15 and the smallest values lose bits in f16's subnormals (du is then tiny anyway). dWz's
// GEMM reads ds and u in bf16: two roundings, about 2^-9 relative, on dWz alone.
//
// Layout: 256 threads, 8 warps as 2 (rows) x 4 (columns) of 32 x 32 output tiles in both GEMMs;
// blocks loop over the 64-position tiles (Wz is loaded once per block). Requirements checked by
// the host (backward_steps.rs, `fuses_output_side`): H, C multiples of 16 and at most 128, N² a
// multiple of 64 (a tile never crosses a batch), dy 16-byte aligned.
#include "common/compat.h"
#include "common/backward.h"
#include "cuda/mma.h"

#define BO_BM 64
#define BO_LD (128 + 8)  // halves per shared row: the padding keeps ldmatrix conflict-free
#define BO_THREADS 256
// Shared memory: Wz [128][BO_LD], then t, u, gate and dy tiles [BO_BM][BO_LD] (halves), then the
// per-position statistics, the row sums of the LayerNorm backward [4][BO_BM][2], the warps'
// largest |dy|, the warps' column sums [8][3][32] and the per-channel parameters γ, β, bz, bg
// [4][128] (floats). Mirrored by OUTPUT_SIDE_SMEM in src/backend/backward_params.rs.
#define BO_SMEM ((128 + 4 * BO_BM) * BO_LD * 2 + (2 * BO_BM + 8 * BO_BM + 8 + 8 * 96 + 4 * 128) * 4)
static_assert(BO_SMEM == 112160, "OUTPUT_SIDE_SMEM in src/backend/backward_params.rs");
static_assert(BO_THREADS == TM_BWD_THREADS, "one block size for every backward kernel");

// A 16-bit value of precision T (TM_IO_BF16 or TM_IO_F16) as f32.
template <int T>
__device__ __forceinline__ float bo_ld16(tm_half v) {
  return T == TM_IO_BF16 ? tm_bf2f(v) : tm_h2f(v);
}


// Adds a tile's column sums, two adjacent columns per lane (lane's 2·(lane % 4) + j), over the 8
// row groups of the warp and into the warp's sums at `at` (columns 8·nt + 2·quad + j).
__device__ __forceinline__ void bo_add_columns(float* at, float v0, float v1) {
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    v0 += __shfl_xor_sync(0xffffffffu, v0, o);
    v1 += __shfl_xor_sync(0xffffffffu, v1, o);
  }
  const int lane = threadIdx.x & 31;
  if (lane < 4) {
    at[2 * lane] += v0;
    at[2 * lane + 1] += v1;
  }
}

// HC, CC: H and C when known at compile time (128, the models' width: the loops unroll and the
// index math loses its divisions), else 0.
template <int IO, int HC, int CC>
__device__ __forceinline__ void bo_run(const TmBackwardParams& p) {
  extern __shared__ __align__(16) unsigned char bo_smem[];
  tm_half* sw = (tm_half*)bo_smem;
  tm_half* sa = sw + 128 * BO_LD;    // t, then dt (bf16)
  tm_half* su = sa + BO_BM * BO_LD;  // u, then ds·2^k (f16)
  tm_half* sg = su + BO_BM * BO_LD;  // P_G, then dG (bf16)
  tm_half* sd = sg + BO_BM * BO_LD;  // dy, then ds (bf16)
  float* srstd = (float*)(sd + BO_BM * BO_LD) + BO_BM;
  float* sred = srstd + BO_BM;    // [4 column warps][BO_BM][2]
  float* smax = sred + 8 * BO_BM;  // [8 warps]
  // This warp's column sums over its tiles, for its 32 columns 32·wc + i: γ's (Σ du⊙t̂), β's
  // (Σ du) and bz's (Σ ds). Each tile's are added over the warp's rows by shuffles first, so
  // that they need no registers between tiles.
  const int C = CC ? CC : p.c, H = HC ? HC : p.h, F = 4 * H + C;
  const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* wsum = smax + 8 + warp * 96;
  // γ, β of LN_H ([H]), bz and the gate's bias bg ([C]), zeros for absent biases.
  float* s_gam = wsum - warp * 96 + 8 * 96;
  float* s_bet = s_gam + 128;
  float* s_bz = s_bet + 128;
  float* s_bg = s_bz + 128;
  for (int i = tid; i < 128; i += BO_THREADS) {
    s_gam[i] = i < H ? p.norm_out_w[i] : 0.f;
    s_bet[i] = i < H ? p.norm_out_b[i] : 0.f;
    s_bz[i] = i < C && p.out_bias ? p.out_bias[i] : 0.f;
    s_bg[i] = i < C && p.proj_bias ? p.proj_bias[4 * H + i] : 0.f;
  }
  const int wr = warp >> 2, wc = warp & 3, quad = lane & 3;
  const unsigned sw_u = mma_smem_addr(sw), su_u = mma_smem_addr(su);
  const tm_half* w_out = (const tm_half*)p.w_out;

  // Wz's rows [C, 128) zero: the s GEMM's unused columns stay finite.
#pragma unroll 1
  for (int i = tid; i < 128 * (H / 8); i += BO_THREADS) {
    const int row = i / (H / 8), col = (i - row * (H / 8)) * 8;
    tm_half* dst = sw + row * BO_LD + col;
    if (row < C) {
      mma_cp_async16(mma_smem_addr(dst), w_out + row * H + col);
    } else {
      *(uint4*)dst = make_uint4(0, 0, 0, 0);
    }
  }
  asm volatile("cp.async.commit_group;");

  for (int i = lane; i < 96; i += 32) wsum[i] = 0.f;

  // The gate's pre-activations and dy of the tile at `first` into sg and sd, through cp.async.
  auto load_gate_dy = [&](tm_i64 first) {
#pragma unroll 1
    for (int i = tid; i < BO_BM * (C / 8); i += BO_THREADS) {
      const int r = i / (C / 8), col = (i - r * (C / 8)) * 8;
      mma_cp_async16(mma_smem_addr(sg + r * BO_LD + col), (const tm_half*)p.p + (first + r) * F + 4 * H + col);
      mma_cp_async16(mma_smem_addr(sd + r * BO_LD + col), (const tm_half*)p.dy + (first + r) * C + col);
    }
    asm volatile("cp.async.commit_group;");
  };
  const tm_i64 tiles = p.rows / BO_BM;
  if ((tm_i64)blockIdx.x < tiles) load_gate_dy((tm_i64)blockIdx.x * BO_BM);
  for (tm_i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const tm_i64 first = tile * BO_BM, b = first / p.n2, pos0 = first - b * p.n2;
    // 1. t by hand (transposed); the gate's pre-activations and dy are on their way (cp.async,
    // issued during the previous tile).
    // Two channels per thread, so that each position's pair goes to shared memory as one 4-byte
    // store, and 16 positions per channel: 32 bytes, a whole sector.
#pragma unroll 1
    for (int i = tid; i < (H / 2) * (BO_BM / 16); i += BO_THREADS) {
      const int h = 2 * (i % (H / 2)), q = i / (H / 2);
      const tm_half* src = (const tm_half*)p.t + (b * H + h) * p.n2 + pos0 + q * 16;
      const uint4 v[4] = {*(const uint4*)src, *(const uint4*)(src + 8), *(const uint4*)(src + p.n2),
                          *(const uint4*)(src + p.n2 + 8)};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const unsigned w0[4] = {v[half].x, v[half].y, v[half].z, v[half].w};
        const unsigned w1[4] = {v[2 + half].x, v[2 + half].y, v[2 + half].z, v[2 + half].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          tm_half* row = sa + (q * 16 + half * 8 + 2 * k) * BO_LD + h;
          *(unsigned*)row = (w0[k] & 0xffffu) | (w1[k] << 16);
          *(unsigned*)(row + BO_LD) = (w0[k] >> 16) | (w1[k] & 0xffff0000u);
        }
      }
    }
    asm volatile("cp.async.wait_all;");
    __syncthreads();

    // 2. Per position (4 threads each): mean and 1/σ of t (two passes), then t̂ over t (f16: LN_H's
    // backward reads it twice), u into su (f16) and out in bf16; the tile's largest |dy| meanwhile.
    {
      const int r = tid >> 2, part = tid & 3;
      tm_half* row = sa + r * BO_LD;
      float s = 0.f;
      for (int h0 = part * 8; h0 < H; h0 += 32) {
        const uint4 v = *(const uint4*)(row + h0);
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) s += tm_h2f((tm_half)(w[k] & 0xffffu)) + tm_h2f((tm_half)(w[k] >> 16));
      }
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      const float mean = s / (float)H;
      float q = 0.f;
      for (int h0 = part * 8; h0 < H; h0 += 32) {
        const uint4 v = *(const uint4*)(row + h0);
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float d0 = tm_h2f((tm_half)(w[k] & 0xffffu)) - mean, d1 = tm_h2f((tm_half)(w[k] >> 16)) - mean;
          q += d0 * d0 + d1 * d1;
        }
      }
      q += __shfl_xor_sync(0xffffffffu, q, 1);
      q += __shfl_xor_sync(0xffffffffu, q, 2);
      const float rstd = tm_rsqrt(q / (float)H + p.eps);
      if (part == 0) srstd[r] = rstd;
      for (int h0 = part * 8; h0 < H; h0 += 32) {
        const uint4 v = *(const uint4*)(row + h0);
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        unsigned uh[4], ub[4], th[4];
        const float4 ga = *(const float4*)(s_gam + h0), gb = *(const float4*)(s_gam + h0 + 4);
        const float4 ba = *(const float4*)(s_bet + h0), bb = *(const float4*)(s_bet + h0 + 4);
        const float gam[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
        const float bet[8] = {ba.x, ba.y, ba.z, ba.w, bb.x, bb.y, bb.z, bb.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float t0 = (tm_h2f((tm_half)(w[k] & 0xffffu)) - mean) * rstd;
          const float t1 = (tm_h2f((tm_half)(w[k] >> 16)) - mean) * rstd;
          const float u0 = t0 * gam[2 * k] + bet[2 * k], u1 = t1 * gam[2 * k + 1] + bet[2 * k + 1];
          th[k] = mma_pack_h2(t0, t1);
          uh[k] = mma_pack_h2(u0, u1);
          ub[k] = mma_pack_bf2(u0, u1);
        }
        *(uint4*)(row + h0) = make_uint4(th[0], th[1], th[2], th[3]);
        *(uint4*)(su + r * BO_LD + h0) = make_uint4(uh[0], uh[1], uh[2], uh[3]);
        st_u4((tm_half*)p.u + (first + r) * H + h0, make_uint4(ub[0], ub[1], ub[2], ub[3]));
      }
      // |dy|'s largest value over the tile.
      float mx = 0.f;
#pragma unroll 1
      for (int i = tid; i < BO_BM * (C / 8); i += BO_THREADS) {
        const int rr = i / (C / 8), col = (i - rr * (C / 8)) * 8;
        const uint4 v = *(const uint4*)(sd + rr * BO_LD + col);
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          mx = fmaxf(mx, fmaxf(fabsf(bo_ld16<IO>((tm_half)(w[k] & 0xffffu))), fabsf(bo_ld16<IO>((tm_half)(w[k] >> 16)))));
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      if (lane == 0) smax[warp] = mx;
    }
    __syncthreads();

    // 3. s = u·Wzᵀ for the warp's 32 positions and 32 output columns.
    float acc[2][4][4];
    mma_zero(acc);
    if (wc * 32 < C) {
      for (int k0 = 0; k0 < H; k0 += 16) mma_warp_k16<4>(acc, su_u, BO_LD, wr * 32, k0, sw_u, BO_LD, wc * 32, k0);
    }
    // ds's scale 2^k: the tile's largest |dy| into [2^14, 2^15) (k = 0 for zeros, infinities, NaN).
    float mx = smax[0];
#pragma unroll
    for (int w = 1; w < 8; ++w) mx = fmaxf(mx, smax[w]);
    int ex = 0;
    if (mx > 0.f && mx <= 3.4e38f) frexpf(mx, &ex);
    // 15 − ex lies in [−113, 163]: the lower end must stay (a bf16 dy reaches 2^128, and a tighter
    // bound let ds·2^k overflow f16); the upper is cut to 126 (2^k and 2^−k normal floats), which
    // only leaves a tile whose |dy| is all below 2^−111 in f16's subnormals.
    const int k2 = mx > 0.f && mx <= 3.4e38f ? max(-126, min(126, 15 - ex)) : 0;
    const float scale = __int_as_float((127 + k2) << 23), unscale = __int_as_float((127 - k2) << 23);
    __syncthreads();  // every warp is done reading u: su takes the scaled ds

    // 4. The gate's backward from registers; dG and ds (bf16) over the gate and dy, ds·2^k (f16)
    // into su.
    if (wc * 32 < C) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int c = wc * 32 + nt * 8 + 2 * quad;
        float sz0 = 0.f, sz1 = 0.f;
        if (c < C) {
        const float2 bz = *(const float2*)(s_bz + c), bg = *(const float2*)(s_bg + c);
        const float bz0 = bz.x, bz1 = bz.y, bg0 = bg.x, bg1 = bg.y;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = wr * 32 + mt * 16 + (lane >> 2) + 8 * half;
            unsigned* gcell = (unsigned*)(sg + r * BO_LD + c);
            unsigned* dcell = (unsigned*)(sd + r * BO_LD + c);
            const unsigned gw = *gcell, dw = *dcell;
            const float g0 = tm_sigmoid(tm_h2f((tm_half)(gw & 0xffffu)) + bg0);
            const float g1 = tm_sigmoid(tm_h2f((tm_half)(gw >> 16)) + bg1);
            const float dy0 = bo_ld16<IO>((tm_half)(dw & 0xffffu)), dy1 = bo_ld16<IO>((tm_half)(dw >> 16));
            const float s0 = acc[mt][nt][2 * half] + bz0, s1 = acc[mt][nt][2 * half + 1] + bz1;
            const float ds0 = dy0 * g0, ds1 = dy1 * g1;
            *gcell = mma_pack_bf2(dy0 * s0 * g0 * (1.f - g0), dy1 * s1 * g1 * (1.f - g1));
            *dcell = mma_pack_bf2(ds0, ds1);
            *(unsigned*)(su + r * BO_LD + c) = mma_pack_h2(ds0 * scale, ds1 * scale);
            sz0 += ds0;
            sz1 += ds1;
          }
        }
        bo_add_columns(wsum + 64 + nt * 8, sz0, sz1);
      }
    }
    __syncthreads();

    // 5. dG and ds out as 16-byte runs.
#pragma unroll 1
    for (int i = tid; i < BO_BM * (C / 8); i += BO_THREADS) {
      const int r = i / (C / 8), col = (i - r * (C / 8)) * 8;
      st_u4((tm_half*)p.dcat + (first + r) * F + 4 * H + col, *(const uint4*)(sg + r * BO_LD + col));
      st_u4((tm_half*)p.e + (first + r) * C + col, *(const uint4*)(sd + r * BO_LD + col));
    }

    // 6. du = ds·Wz (Wz in sw read k-major), then LN_H's backward per position: the row sums of ĝ
    // and ĝ⊙t̂ over the quad, then over the four column warps through sred.
    mma_zero(acc);
    const bool has_h = wc * 32 < H;
    if (has_h) {
      for (int k0 = 0; k0 < C; k0 += 16) mma_warp_k16_kn<4>(acc, su_u, BO_LD, wr * 32, k0, sw_u, BO_LD, k0, wc * 32);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wr * 32 + mt * 16 + (lane >> 2) + 8 * half;
        float sg_ = 0.f, sgh = 0.f;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int h = wc * 32 + nt * 8 + 2 * quad;
          if (!has_h || h >= H) continue;
          const unsigned tw = *(const unsigned*)(sa + r * BO_LD + h);
          const float2 g2 = *(const float2*)(s_gam + h);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float du = acc[mt][nt][2 * half + j] * unscale;
            acc[mt][nt][2 * half + j] = du;
            const float th = tm_h2f((tm_half)(j ? tw >> 16 : tw & 0xffffu));
            const float g = du * (j ? g2.y : g2.x);
            sg_ += g;
            sgh += g * th;
          }
        }
        sg_ += __shfl_xor_sync(0xffffffffu, sg_, 1);
        sg_ += __shfl_xor_sync(0xffffffffu, sg_, 2);
        sgh += __shfl_xor_sync(0xffffffffu, sgh, 1);
        sgh += __shfl_xor_sync(0xffffffffu, sgh, 2);
        if (quad == 0) {
          sred[(wc * BO_BM + r) * 2] = sg_;
          sred[(wc * BO_BM + r) * 2 + 1] = sgh;
        }
      }
    __syncthreads();
    // Every thread is past step 5: sg and sd take the next tile's gate and dy.
    if (tile + gridDim.x < tiles) load_gate_dy((tile + gridDim.x) * BO_BM);
    if (has_h) {
      const int warps_h = (H + 31) / 32;
      float tg[4][2], tb[4][2];  // this tile's column sums of du⊙t̂ and du
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) tg[nt][0] = tg[nt][1] = tb[nt][0] = tb[nt][1] = 0.f;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = wr * 32 + mt * 16 + (lane >> 2) + 8 * half;
          float mg = 0.f, mgh = 0.f;
          for (int w = 0; w < warps_h; ++w) {
            mg += sred[(w * BO_BM + r) * 2];
            mgh += sred[(w * BO_BM + r) * 2 + 1];
          }
          mg /= (float)H;
          mgh /= (float)H;
          const float rstd = srstd[r];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const int h = wc * 32 + nt * 8 + 2 * quad;
            if (h >= H) continue;
            unsigned* cell = (unsigned*)(sa + r * BO_LD + h);
            const unsigned tw = *cell;
            const float2 g2 = *(const float2*)(s_gam + h);
            float dt[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const float du = acc[mt][nt][2 * half + j];
              const float th = tm_h2f((tm_half)(j ? tw >> 16 : tw & 0xffffu));
              dt[j] = rstd * (du * (j ? g2.y : g2.x) - mg - th * mgh);
              tg[nt][j] += du * th;
              tb[nt][j] += du;
            }
            *cell = mma_pack_bf2(dt[0], dt[1]);
          }
        }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        bo_add_columns(wsum + nt * 8, tg[nt][0], tg[nt][1]);
        bo_add_columns(wsum + 32 + nt * 8, tb[nt][0], tb[nt][1]);
      }
    }
    __syncthreads();

    // 7. dt out, hidden-major: 8 positions of two channels per thread, as t came in.
#pragma unroll 1
    for (int i = tid; i < (H / 2) * (BO_BM / 16); i += BO_THREADS) {
      const int h = 2 * (i % (H / 2)), q = i / (H / 2);
      tm_half* dst = (tm_half*)p.t + (b * H + h) * p.n2 + pos0 + q * 16;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        unsigned w0[4], w1[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const tm_half* row = sa + (q * 16 + half * 8 + 2 * k) * BO_LD + h;
          const unsigned a = *(const unsigned*)row, c = *(const unsigned*)(row + BO_LD);
          w0[k] = (a & 0xffffu) | (c << 16);
          w1[k] = (a >> 16) | (c & 0xffff0000u);
        }
        st_u4(dst + half * 8, make_uint4(w0[0], w0[1], w0[2], w0[3]));
        st_u4(dst + p.n2 + half * 8, make_uint4(w1[0], w1[1], w1[2], w1[3]));
      }
    }
    __syncthreads();  // the next tile overwrites sa, sg and sd
  }

  // The two row warps' column sums added in f64 into this block's rows of `partial`: [blocks][2H]
  // (γ, then β), then [blocks][C] (bz).
  __syncthreads();
  const float* ws = smax + 8;
  double* part_ln = p.partial + (tm_i64)blockIdx.x * 2 * H;
  double* part_bz = p.partial + (tm_i64)gridDim.x * 2 * H + (tm_i64)blockIdx.x * C;
  for (int i = tid; i < 2 * H + C; i += BO_THREADS) {
    // Column col of kind k (0 γ, 1 β, 2 bz) is at warp (row warp, col / 32), place 32·k + col % 32.
    const int k = i < H ? 0 : i < 2 * H ? 1 : 2, col = i - k * H;
    const int at = (col >> 5) * 96 + k * 32 + (col & 31);
    const double v = (double)ws[at] + (double)ws[4 * 96 + at];
    if (i < 2 * H) {
      part_ln[i] = v;
    } else {
      part_bz[i - 2 * H] = v;
    }
  }
}

extern "C" __global__ void __launch_bounds__(BO_THREADS, 2) backward_output_side(const TmBackwardParams p) {
  if (p.h == 128 && p.c == 128) {
    p.io == TM_IO_F16 ? bo_run<TM_IO_F16, 128, 128>(p) : bo_run<TM_IO_BF16, 128, 128>(p);
  } else {
    p.io == TM_IO_F16 ? bo_run<TM_IO_F16, 0, 0>(p) : bo_run<TM_IO_BF16, 0, 0>(p);
  }
}
