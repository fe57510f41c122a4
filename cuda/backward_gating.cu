// The gated projections' two position-wise steps of the backward with 16-bit I/O, in 16-byte
// vectors (CUDA). The step list's portable kernels (common/backward.h: backward_gating_16 and
// backward_gating_grad_16) give each lane one channel of 32 positions: 2-byte loads of P, 64-byte
// stores of the hidden-major tensors, and per element the index arithmetic of both layouts; ncu
// measured them at 83% and 70% of issue slots for 56% and 51% of DRAM bandwidth
// (docs/perf/NOTES.md, twenty-seventh session). Here a thread takes 8 channels of one position
// (one 16-byte vector of each of P's four gated columns) and 8 positions of one channel (one
// 16-byte vector of each hidden-major tensor), with the transpose between the two in shared
// memory:
//
//   backward_gating_vec       left = pL⊙σ(qL)⊙m, right = pR⊙σ(qR)⊙m   (P = z·Wcatᵀ, + bcat)
//                             into left, right (f16) and their bf16 copies, hidden-major
//   backward_gating_grad_vec  dpX = dX⊙σ(qX)⊙m, dqX = dX⊙pX⊙m⊙σ(qX)(1 − σ(qX)), X = L, R, from
//                             dleft, dright (f32, hidden-major, in `left`/`right`'s place) into
//                             dcat's first 4H columns (bf16, over P)
//
// the same values as the portable kernels compute (same operations in the same order, f32).
// Tiles of 64 positions (128 bytes of a hidden-major row in 16 bits), channels 64 at a time.
// Requirements checked by the host (backward_steps.rs, `vector_gating`): 16-bit I/O, H and F
// multiples of 8 (P's rows and their gated columns 16-byte aligned), N² a multiple of 64 (a tile
// never crosses a batch).
#include "common/compat.h"
#include "common/backward.h"
#include "cuda/mma.h"

#define BG_BM 64              // positions per tile
#define BG_HC 64              // channels per chunk
#define BG_LD (BG_BM + 1)     // floats per shared row: 2-way bank conflicts at most, both ways
#define BG_THREADS 256
// Shared memory: two [BG_HC][BG_LD] float tiles (left and right, or dleft and dright).
// Mirrored by GATING_VEC_SMEM in src/backend/backward_params.rs.
#define BG_SMEM (2 * BG_HC * BG_LD * 4)
static_assert(BG_SMEM == 33280, "GATING_VEC_SMEM in src/backend/backward_params.rs");
static_assert(BG_THREADS == TM_BWD_THREADS, "one block size for every backward kernel");

// Channels [h, h + 8) of a bias vector (8 zeros without one): two 16-byte loads.
__device__ __forceinline__ void bg_bias8(const float* b, int h, float (&out)[8]) {
  float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
  if (b) {
    lo = *(const float4*)(b + h);
    hi = *(const float4*)(b + h + 4);
  }
  out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
  out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
}

// The four gated columns' biases of channels [h, h + 8) (zeros without biases).
__device__ __forceinline__ void bg_biases(const TmBackwardParams& p, int h, float (&bias)[4][8]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) bg_bias8(p.proj_bias ? p.proj_bias + k * p.h : nullptr, h, bias[k]);
}

// The tile's positions with 8 channels of one position per thread (the 8 vectors of a position's
// chunk on 8 lanes): f(i, row, v, h, bias) for each position i this thread takes, its channels
// h = h0 + 8v .. h + 7 and their biases, where those channels are among the chunk's hn.
template <class F>
__device__ __forceinline__ void bg_each_position(const TmBackwardParams& p, tm_i64 r0, int h0, int hn, F f) {
  const int tid = (int)threadIdx.x;
  const int v = tid & 7, h = h0 + 8 * v;
  if (8 * v < hn) {
    float bias[4][8];
    bg_biases(p, h, bias);
    for (int i = tid >> 3; i < BG_BM; i += BG_THREADS / 8) f(i, r0 + i, v, h, bias);
  }
}

// A block's tile of BG_BM positions: its two shared tiles, its first position, and the
// hidden-major index of channel 0 there (a tile never crosses a batch).
struct BgTile {
  float* sl;
  float* sr;
  tm_i64 r0, hid0;
};

__device__ __forceinline__ BgTile bg_tile(const TmBackwardParams& p) {
  extern __shared__ float bg_smem[];
  const tm_i64 r0 = (tm_i64)blockIdx.x * BG_BM, b = r0 / p.n2;
  return BgTile{bg_smem, bg_smem + BG_HC * BG_LD, r0, b * p.h * p.n2 + (r0 - b * p.n2)};
}

// Eight f16 values of a 16-byte vector, widened.
__device__ __forceinline__ void bg_widen8(uint4 v, float (&out)[8]) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = tm_lo(w[k]);
    out[2 * k + 1] = tm_hi(w[k]);
  }
}

extern "C" __global__ void __launch_bounds__(BG_THREADS) backward_gating_vec(const TmBackwardParams p) {
  const BgTile tile = bg_tile(p);
  float *sl = tile.sl, *sr = tile.sr;
  const int tid = (int)threadIdx.x, H = p.h;
  const tm_i64 F = p.f, n2 = p.n2, r0 = tile.r0, hid0 = tile.hid0;
  const tm_half* P = (const tm_half*)p.p;
  for (int h0 = 0; h0 < H; h0 += BG_HC) {
    const int hn = H - h0 < BG_HC ? H - h0 : BG_HC;
    bg_each_position(p, r0, h0, hn, [&](int i, tm_i64 row, int v, int h, const float (&bias)[4][8]) {
      const tm_half* pr = P + row * F + h;
      const uint4 raw[4] = {ld_u4(pr), ld_u4(pr + H), ld_u4(pr + 2 * H), ld_u4(pr + 3 * H)};
      const float m = p.mask ? p.mask[row] : 1.f;
      float pl[8], ql[8], pq[8], qr[8];
      bg_widen8(raw[0], pl), bg_widen8(raw[1], ql), bg_widen8(raw[2], pq), bg_widen8(raw[3], qr);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        sl[(8 * v + k) * BG_LD + i] = (pl[k] + bias[0][k]) * tm_sigmoid(ql[k] + bias[1][k]) * m;
        sr[(8 * v + k) * BG_LD + i] = (pq[k] + bias[2][k]) * tm_sigmoid(qr[k] + bias[3][k]) * m;
      }
    });
    __syncthreads();
    // 8 positions of one channel per thread: a channel's 64 positions on 8 lanes.
    const int w = tid & 7;
    for (int c = tid >> 3; c < 2 * hn; c += BG_THREADS / 8) {
      const int side = c >= hn, hl = c - side * hn;
      const float* s = (side ? sr : sl) + hl * BG_LD + 8 * w;
      unsigned f16[4], bf16[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        f16[k] = mma_pack_h2(s[2 * k], s[2 * k + 1]);
        bf16[k] = mma_pack_bf2(s[2 * k], s[2 * k + 1]);
      }
      const tm_i64 at = hid0 + (tm_i64)(h0 + hl) * n2 + 8 * w;
      st_u4((tm_half*)(side ? p.right : p.left) + at, make_uint4(f16[0], f16[1], f16[2], f16[3]));
      st_u4((side ? p.right_bf16 : p.left_bf16) + at, make_uint4(bf16[0], bf16[1], bf16[2], bf16[3]));
    }
    __syncthreads();
  }
}

extern "C" __global__ void __launch_bounds__(BG_THREADS) backward_gating_grad_vec(const TmBackwardParams p) {
  const BgTile tile = bg_tile(p);
  float *sl = tile.sl, *sr = tile.sr;
  const int tid = (int)threadIdx.x, H = p.h;
  const tm_i64 F = p.f, n2 = p.n2, r0 = tile.r0, hid0 = tile.hid0;
  for (int h0 = 0; h0 < H; h0 += BG_HC) {
    const int hn = H - h0 < BG_HC ? H - h0 : BG_HC;
    // dleft and dright of the chunk: 4 positions (16 bytes of f32) per thread, a channel's 64
    // positions on 16 lanes.
    const int q = tid & 15;
    for (int c = tid >> 4; c < 2 * hn; c += BG_THREADS / 16) {
      const int side = c >= hn, hl = c - side * hn;
      const uint4 d = ld_u4((const float*)(side ? p.right : p.left) + hid0 + (tm_i64)(h0 + hl) * n2 + 4 * q);
      float* s = (side ? sr : sl) + hl * BG_LD + 4 * q;
      s[0] = __uint_as_float(d.x), s[1] = __uint_as_float(d.y), s[2] = __uint_as_float(d.z),
      s[3] = __uint_as_float(d.w);
    }
    __syncthreads();
    bg_each_position(p, r0, h0, hn, [&](int i, tm_i64 row, int v, int h, const float (&bias)[4][8]) {
      // dcat is written over P: each thread reads its four vectors of P before writing the
      // same places (the loads and stores are volatile, so they stay in that order).
      tm_half* pr = (tm_half*)p.p + row * F + h;
      tm_half* dr = (tm_half*)p.dcat + row * F + h;
      const float m = p.mask ? p.mask[row] : 1.f;
#pragma unroll
      for (int side = 0; side < 2; ++side) {
        float pv[8], qg[8];
        bg_widen8(ld_u4(pr + 2 * side * H), pv);
        bg_widen8(ld_u4(pr + (2 * side + 1) * H), qg);
        const float* s = side ? sr : sl;
        unsigned dp[4], dq[4];
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
          float a[2], g[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float d = s[(8 * v + k + j) * BG_LD + i] * m;
            const float sg = tm_sigmoid(qg[k + j] + bias[2 * side + 1][k + j]);
            a[j] = d * sg;
            g[j] = d * (pv[k + j] + bias[2 * side][k + j]) * sg * (1.f - sg);
          }
          dp[k / 2] = mma_pack_bf2(a[0], a[1]);
          dq[k / 2] = mma_pack_bf2(g[0], g[1]);
        }
        st_u4(dr + 2 * side * H, make_uint4(dp[0], dp[1], dp[2], dp[3]));
        st_u4(dr + (2 * side + 1) * H, make_uint4(dq[0], dq[1], dq[2], dq[3]));
      }
    });
    __syncthreads();
  }
}
