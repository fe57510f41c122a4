// The backward pass's element-wise, LayerNorm and reduction kernels; the GEMMs between them are
// the BLAS library's (src/backend/cuda/backward.rs orders the steps; docs/backward.md derives
// every line). With `m` a position, `⊙` element-wise and `σ` the logistic function:
//
//   backward_input_norm       z = LN_C(x) = x̂⊙γ + β, and (μ, ρ) per position
//   backward_gating           left = pL⊙σ(qL)⊙mask, right = pR⊙σ(qR)⊙mask   (P = z·Wcatᵀ + bcat)
//   backward_output_norm      u = LN_H(t) = t̂⊙γ + β, (μ, ρ) per position; gpumode v = u⊙σ(P_G)
//   backward_output_gate      af3:     ds = dy⊙g, dG = dy⊙(s + bz)⊙g(1 − g),  g = σ(P_G)
//                             gpumode: du = dv⊙o, dG = dv⊙u⊙o(1 − o),      o = σ(P_G)
//   backward_output_norm_grad dt = ρ·(ĝ − mean(ĝ) − t̂·mean(ĝ⊙t̂)), ĝ = du⊙γ;  Σ du⊙t̂, Σ du
//   backward_gating_grad      dpX = dX⊙σ(qX)⊙mask, dqX = dX⊙pX⊙mask⊙σ(qX)(1 − σ(qX)), X = L, R
//   backward_input_norm_grad  dx = ρ·(ĝ − mean(ĝ) − x̂·mean(ĝ⊙x̂)), ĝ = dz⊙γ;  Σ dz⊙x̂, Σ dz
//   backward_convert          between precisions: the f16 prepared weights to f32 or bf16, gpumode's
//                             16-bit dy to f32
//   backward_column_partials, backward_column_finish
//                             Σ over positions of each column of an [M, W] matrix (the bias
//                             gradients) or of the LayerNorm kernels' partial sums, in f64, in a
//                             fixed order
//
// Precision: with f32 I/O everything is f32. With 16-bit I/O (`io`: bf16 or f16 x, dy and dx, read
// and written where they lie) the tensors of the input side and the contraction are 16-bit, those
// of the output side f32:
// - z, P, left, right and t, the forward's values, in f16 (TM_BWD_F), as the forward keeps them
//   (LN_C bounds them, and f16 rounds 8x finer than bf16);
// - dt and dcat, gradients, in bf16 (TM_BWD_G), for f32's range, with bf16 copies of z, left and
//   right for the GEMMs that multiply them with a gradient (a GEMM's operands share one type);
// - u, s/ds (v), du, dleft, dright, dz and the statistics in f32: each bf16 rounding on a
//   gradient's path adds about 2e-3 to its relative error, and with these in bf16 too, gradients
//   came within 1e-2 of the f64 reference only just (docs/perf/NOTES.md, twenty-sixth session).
//   (CUDA's fused output side for af3, cuda/backward_output.cu, which replaces output_norm,
//   output_gate and output_norm_grad there, keeps u in f16 and ds scaled into f16 in shared
//   memory instead: its header says why that holds the same accuracy.)
// Every kernel computes in f32. Position-major tensors are [M, W] row-major; left, right, t (then dt) are
// hidden-major [B, H, N²], the layout of the contraction's batched GEMMs. The kernels that move
// data between the two layouts take TM_BWD_TILE consecutive positions per block and go through
// shared memory, so that both the hidden-major side (consecutive positions) and the
// position-major side (consecutive channels) are read and written in whole 128-byte lines.
#pragma once
#include "common/params.h"

#define TM_BWD_THREADS 256
#define TM_BWD_WARPS (TM_BWD_THREADS / 32)
#define TM_BWD_TILE 32
// Rows of a warp-per-position kernel's block.
#define TM_BWD_ROWS_PER_BLOCK TM_BWD_WARPS
// Resident blocks per multiprocessor the tile kernels are compiled for (their registers capped to
// fit, 32; output_norm_grad spills 8 bytes): fully unrolled, the gating kernels took 64-76
// registers, three or four blocks per SM, and reached half of the DRAM bandwidth (ncu, H100);
// 6 blocks (40 registers) and then 8 each took a tenth off those kernels (docs/perf/NOTES.md).
#define TM_BWD_TILE_BLOCKS 8

// The one argument of the per-position kernels (mirrored by `BackwardParams` in
// src/backend/cuda/backward.rs: the same fields in the same order).
typedef struct {
  const void* x;            // [M, C] in `io`
  const void* dy;           // [M, C] in `io`
  const float* mask;        // [M]; null: no mask
  const float* norm_in_w;   // [C]
  const float* norm_in_b;   // [C]
  const float* norm_out_w;  // [H]
  const float* norm_out_b;  // [H]
  const float* proj_bias;   // [F]; null: no input bias
  const float* out_bias;    // [C]; null: no output bias
  void* z;                  // [M, C] LN_C(x), in TM_BWD_F(io)
  unsigned short* z_bf16;   // [M, C] z in bf16 where io is 16-bit (else null)
  float* stats_x;           // [M, 2] LN_C's mean and 1/σ
  void* p;                  // [M, F] z·Wcatᵀ (without bcat), in TM_BWD_F(io)
  void* left;               // [B, H, N²] in TM_BWD_F(io)
  void* right;              // [B, H, N²] in TM_BWD_F(io)
  void* t;                  // [B, H, N²] t in TM_BWD_F(io), then dt in TM_BWD_G(io)
  float* u;                 // [M, H] LN_H(t)
  unsigned short* left_bf16;   // left and right in bf16 where io is 16-bit (else null)
  unsigned short* right_bf16;
  float* stats_t;           // [M, 2] LN_H's mean and 1/σ
  float* e;                 // af3: [M, C] s = u·Wzᵀ, then ds; gpumode: [M, H] v
  float* du;                // [M, H] du (gpumode: dv first)
  void* dcat;               // [M, F] [dpL dqL dpR dqR dG] in TM_BWD_G(io); may be p itself (each
                            // element of P is read by the thread that then writes its gradient,
                            // and both are f32 or both 16-bit)
  float* dz;                // [M, C] dcat·Wcat
  void* dx;                 // [M, C] in `io`
  double* partial;          // [blocks, 2W] the LayerNorm backward kernels' per-block column sums
  tm_i64 rows;              // M = B·N²
  tm_i64 n2;                // N²
  int c;
  int h;
  int f;                    // 4H + G
  int af3;                  // 1: af3, 0: gpumode
  float eps;
  int blocks;               // grid of the LayerNorm backward kernels, which loop over positions
  int io;                   // TM_IO_F32, TM_IO_BF16 or TM_IO_F16: x, dy and dx
  int pad_;
  const void* w_out;        // [C, H] f16, the prepared output projection (backward_output_side)
} TmBackwardParams;

// The precisions of z, P, left, right and t, and of dt and dcat, for I/O precision IO: f32 with
// f32 I/O, else f16 and bf16.
#define TM_BWD_F(IO) ((IO) == TM_IO_F32 ? TM_IO_F32 : TM_IO_F16)
#define TM_BWD_G(IO) ((IO) == TM_IO_F32 ? TM_IO_F32 : TM_IO_BF16)

// Element i of a tensor in precision T (a TM_IO_ value), widened to f32.
template <int T>
TM_INLINE float tm_bwd_ld(const void* a, tm_i64 i) {
  if (T == TM_IO_F32) return ((const float*)a)[i];
  const unsigned short w = ((const unsigned short*)a)[i];
  return T == TM_IO_BF16 ? tm_bf2f(w) : tm_h2f(w);
}

// a[i] = v in precision T, rounded to nearest even where T is 16-bit.
template <int T>
TM_INLINE void tm_bwd_st(void* a, tm_i64 i, float v) {
  if (T == TM_IO_F32) {
    ((float*)a)[i] = v;
  } else {
    ((unsigned short*)a)[i] = T == TM_IO_BF16 ? tm_f2bf(v) : tm_f2h(v);
  }
}

// Elements [i, i + 4) of a tensor in precision T, i a multiple of 4 and the tensor 16-byte
// aligned: one 16-byte (f32) or 8-byte (16-bit) access.
template <int T>
TM_INLINE void tm_bwd_ld4(const void* a, tm_i64 i, float (&v)[4]) {
  if (T == TM_IO_F32) {
    const tm_f4 f = *(const tm_f4*)((const float*)a + i);
    for (int k = 0; k < 4; ++k) v[k] = f.v[k];
  } else {
    const tm_u64h w = *(const tm_u64h*)((const unsigned short*)a + i);
    for (int k = 0; k < 4; ++k) {
      const unsigned short e = (unsigned short)(w.v[k / 2] >> (16 * (k % 2)));
      v[k] = T == TM_IO_BF16 ? tm_bf2f(e) : tm_h2f(e);
    }
  }
}

template <int T>
TM_INLINE void tm_bwd_st4(void* a, tm_i64 i, const float (&v)[4]) {
  if (T == TM_IO_F32) {
    tm_f4 f;
    for (int k = 0; k < 4; ++k) f.v[k] = v[k];
    *(tm_f4*)((float*)a + i) = f;
  } else {
    tm_u64h w;
    for (int k = 0; k < 2; ++k) {
      const float lo = v[2 * k], hi = v[2 * k + 1];
      w.v[k] = T == TM_IO_BF16 ? (unsigned)tm_f2bf(lo) | ((unsigned)tm_f2bf(hi) << 16) : tm_pack2(lo, hi);
    }
    *(tm_u64h*)((unsigned short*)a + i) = w;
  }
}

// Whether a LayerNorm kernel over rows of width C (and a row-major [M, C] tensor at each of
// `a`, `b`) takes its narrow path: C a multiple of 4 up to 128, so that each lane of a 32-lane
// group owns 4 consecutive channels of every row (one vector access, its weights and its column
// sums in registers), and both tensors 16-byte aligned. Uniform across the grid.
TM_INLINE bool tm_bwd_narrow(int C, const void* a, const void* b) {
  return C % 4 == 0 && C <= 128 && (((unsigned long long)a | (unsigned long long)b) & 15u) == 0;
}

// Each per-position kernel has two entry points, `name` for f32 I/O and `name_16` for 16-bit I/O
// (bf16 and f16 differ only in how x, dy and dx are read and written), each its own kernel: with
// both precisions in one, the LN_H kernels spilled under their 32-register cap and ran a sixth
// slower in f32.

// The hidden-major index of (position `row`, channel `h`).
TM_INLINE tm_i64 tm_bwd_hidden(const TmBackwardParams& p, tm_i64 row, int h) {
  const tm_i64 b = row / p.n2;
  return (b * p.h + h) * p.n2 + (row - b * p.n2);
}

// Loads channels [h0, h0 + hn) of the tile's positions from a hidden-major tensor into
// `s[h − h0][r]` (row stride TM_BWD_TILE + 1: conflict-free both ways); zeros past the last
// position. Lane = position, warp = channel: each warp reads 32 consecutive positions.
template <int T>
TM_INLINE void tm_bwd_load_hidden(const TmBackwardParams& p, const void* TM_RESTRICT src, float* TM_RESTRICT s,
                                  tm_i64 first, int h0, int hn) {
  const int lane = (int)(tm_tid() & 31u), warp = (int)(tm_tid() >> 5);
  const tm_i64 row = first + lane, n2 = p.n2;
  // Channel h0 of this lane's position, once: the 64-bit division in tm_bwd_hidden, redone for
  // every element (the compiler kept it in the loop), was most of these kernels' instructions.
  const tm_i64 at = row < p.rows ? tm_bwd_hidden(p, row, h0) : 0;
  for (int hl = warp; hl < hn; hl += TM_BWD_WARPS) {
    s[hl * (TM_BWD_TILE + 1) + lane] = row < p.rows ? tm_bwd_ld<T>(src, at + hl * n2) : 0.f;
  }
}

// The reverse: `s[h − h0][r]` into the hidden-major tensor.
template <int T>
TM_INLINE void tm_bwd_store_hidden(const TmBackwardParams& p, void* TM_RESTRICT dst, const float* TM_RESTRICT s,
                                   tm_i64 first, int h0, int hn) {
  const int lane = (int)(tm_tid() & 31u), warp = (int)(tm_tid() >> 5);
  const tm_i64 row = first + lane, n2 = p.n2;
  if (row >= p.rows) return;
  const tm_i64 at = tm_bwd_hidden(p, row, h0);  // as in tm_bwd_load_hidden
  for (int hl = warp; hl < hn; hl += TM_BWD_WARPS) {
    tm_bwd_st<T>(dst, at + hl * n2, s[hl * (TM_BWD_TILE + 1) + lane]);
  }
}

TM_INLINE float tm_bwd_bias(const float* b, int i) { return b ? b[i] : 0.f; }

// A tile kernel thread's place: its lane and 32-lane group, and the tile's first position.
typedef struct {
  int lane, warp;
  tm_i64 first;
} TmBwdTile;

TM_INLINE TmBwdTile tm_bwd_tile() {
  TmBwdTile t;
  t.lane = (int)(tm_tid() & 31u);
  t.warp = (int)(tm_tid() >> 5);
  t.first = (tm_i64)tm_bid() * TM_BWD_TILE;
  return t;
}

// Dynamic shared memory of the two gating kernels: two [32][TILE + 1] float tiles.
#define TM_BWD_GATING_SMEM (2 * 32 * (TM_BWD_TILE + 1) * 4)

// One warp per position: z = LN_C(x), two-pass statistics in f32 (Cauchy rows cancel in E[x²]).
template <int IO>
TM_INLINE void tm_bwd_input_norm(const TmBackwardParams& p) {
  const int lane = (int)(tm_tid() & 31u);
  const tm_i64 row = (tm_i64)tm_bid() * TM_BWD_ROWS_PER_BLOCK + (tm_tid() >> 5);
  if (row >= p.rows) return;  // whole warps leave together
  const int C = p.c;
  const tm_i64 r0 = row * C;
  if (tm_bwd_narrow(C, p.x, p.z)) {
    // Lane owns channels [4·lane, 4·lane + 4): x read once, as one vector.
    const int c0 = 4 * lane;
    const bool on = c0 < C;
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (on) tm_bwd_ld4<IO>(p.x, r0 + c0, x);
    const float mean = tm_group32_sum(x[0] + x[1] + x[2] + x[3]) / (float)C;
    float q = 0.f;
    for (int k = 0; k < 4; ++k) q += on ? (x[k] - mean) * (x[k] - mean) : 0.f;
    const float rstd = tm_rsqrt(tm_group32_sum(q) / (float)C + p.eps);
    if (on) {
      float z[4];
      for (int k = 0; k < 4; ++k) z[k] = (x[k] - mean) * rstd * p.norm_in_w[c0 + k] + p.norm_in_b[c0 + k];
      tm_bwd_st4<TM_BWD_F(IO)>(p.z, r0 + c0, z);
      if (IO != TM_IO_F32) tm_bwd_st4<TM_IO_BF16>(p.z_bf16, r0 + c0, z);
    }
    if (lane == 0) {
      p.stats_x[2 * row] = mean;
      p.stats_x[2 * row + 1] = rstd;
    }
    return;
  }
  float s = 0.f;
  for (int c = lane; c < C; c += 32) s += tm_bwd_ld<IO>(p.x, r0 + c);
  const float mean = tm_group32_sum(s) / (float)C;
  float q = 0.f;
  for (int c = lane; c < C; c += 32) {
    const float d = tm_bwd_ld<IO>(p.x, r0 + c) - mean;
    q += d * d;
  }
  const float rstd = tm_rsqrt(tm_group32_sum(q) / (float)C + p.eps);
  for (int c = lane; c < C; c += 32) {
    const float z = (tm_bwd_ld<IO>(p.x, r0 + c) - mean) * rstd * p.norm_in_w[c] + p.norm_in_b[c];
    tm_bwd_st<TM_BWD_F(IO)>(p.z, r0 + c, z);
    if (IO != TM_IO_F32) p.z_bf16[r0 + c] = tm_f2bf(z);
  }
  if (lane == 0) {
    p.stats_x[2 * row] = mean;
    p.stats_x[2 * row + 1] = rstd;
  }
}

extern "C" __global__ void TM_LAUNCH_BOUNDS(TM_BWD_THREADS) backward_input_norm(const TmBackwardParams p) { tm_bwd_input_norm<TM_IO_F32>(p); }
extern "C" __global__ void TM_LAUNCH_BOUNDS(TM_BWD_THREADS) backward_input_norm_16(const TmBackwardParams p) {
  p.io == TM_IO_F16 ? tm_bwd_input_norm<TM_IO_F16>(p) : tm_bwd_input_norm<TM_IO_BF16>(p);
}

// left and right, hidden-major, from P's first 4H columns, 32 channels at a time.
template <int IO>
TM_INLINE void tm_bwd_gating(const TmBackwardParams& p) {
  extern __shared__ float tm_dyn_smem[];
  float* sl = tm_dyn_smem;
  float* sr = sl + 32 * (TM_BWD_TILE + 1);
  const TmBwdTile tile = tm_bwd_tile();
  const int lane = tile.lane, warp = tile.warp, H = p.h;
  const tm_i64 first = tile.first;
  const tm_i64 rows = p.rows, f = p.f;
  for (int h0 = 0; h0 < H; h0 += 32) {
    const int h = h0 + lane, hn = H - h0 < 32 ? H - h0 : 32;
    // This lane's channel's biases, once per chunk rather than per position.
    float bias[4] = {0.f, 0.f, 0.f, 0.f};
    if (p.proj_bias && h < H) {
      for (int k = 0; k < 4; ++k) bias[k] = p.proj_bias[k * H + h];
    }
#pragma unroll 1
    for (int r = warp; r < TM_BWD_TILE; r += TM_BWD_WARPS) {
      const tm_i64 row = first + r;
      float l = 0.f, rr = 0.f;
      if (row < rows && h < H) {
        const tm_i64 pr = row * f;
        const float m = p.mask ? p.mask[row] : 1.f;
        const float pl = tm_bwd_ld<TM_BWD_F(IO)>(p.p, pr + h) + bias[0];
        const float ql = tm_bwd_ld<TM_BWD_F(IO)>(p.p, pr + H + h) + bias[1];
        const float pq = tm_bwd_ld<TM_BWD_F(IO)>(p.p, pr + 2 * H + h) + bias[2];
        const float qr = tm_bwd_ld<TM_BWD_F(IO)>(p.p, pr + 3 * H + h) + bias[3];
        l = pl * tm_sigmoid(ql) * m;
        rr = pq * tm_sigmoid(qr) * m;
      }
      sl[lane * (TM_BWD_TILE + 1) + r] = l;
      sr[lane * (TM_BWD_TILE + 1) + r] = rr;
    }
    tm_sync();
    tm_bwd_store_hidden<TM_BWD_F(IO)>(p, p.left, sl, first, h0, hn);
    tm_bwd_store_hidden<TM_BWD_F(IO)>(p, p.right, sr, first, h0, hn);
    if (IO != TM_IO_F32) {
      tm_bwd_store_hidden<TM_IO_BF16>(p, p.left_bf16, sl, first, h0, hn);
      tm_bwd_store_hidden<TM_IO_BF16>(p, p.right_bf16, sr, first, h0, hn);
    }
    tm_sync();
  }
}

extern "C" __global__ void TM_LAUNCH_BOUNDS_MIN(TM_BWD_THREADS, TM_BWD_TILE_BLOCKS) backward_gating(const TmBackwardParams p) { tm_bwd_gating<TM_IO_F32>(p); }
extern "C" __global__ void TM_LAUNCH_BOUNDS_MIN(TM_BWD_THREADS, TM_BWD_TILE_BLOCKS) backward_gating_16(const TmBackwardParams p) { tm_bwd_gating<TM_IO_BF16>(p); }

// Dynamic shared memory of the two kernels that hold a tile's whole t: [H][TILE + 1] floats.
#define TM_BWD_T_SMEM(H) ((H) * (TM_BWD_TILE + 1) * 4)

// u = LN_H(t) and its statistics; gpumode's v = u⊙σ(P_G) too.
template <int IO>
TM_INLINE void tm_bwd_output_norm(const TmBackwardParams& p) {
  extern __shared__ float tm_dyn_smem[];
  float* st = tm_dyn_smem;
  const int lane = (int)(tm_tid() & 31u), warp = (int)(tm_tid() >> 5);
  const tm_i64 first = (tm_i64)tm_bid() * TM_BWD_TILE;
  const int H = p.h;
  tm_bwd_load_hidden<TM_BWD_F(IO)>(p, p.t, st, first, 0, H);
  tm_sync();
  for (int r = warp; r < TM_BWD_TILE; r += TM_BWD_WARPS) {
    const tm_i64 row = first + r;
    if (row >= p.rows) break;  // uniform per warp
    float s = 0.f;
    for (int h = lane; h < H; h += 32) s += st[h * (TM_BWD_TILE + 1) + r];
    const float mean = tm_group32_sum(s) / (float)H;
    float q = 0.f;
    for (int h = lane; h < H; h += 32) {
      const float d = st[h * (TM_BWD_TILE + 1) + r] - mean;
      q += d * d;
    }
    const float rstd = tm_rsqrt(tm_group32_sum(q) / (float)H + p.eps);
    for (int h = lane; h < H; h += 32) {
      const float u = (st[h * (TM_BWD_TILE + 1) + r] - mean) * rstd * p.norm_out_w[h] + p.norm_out_b[h];
      p.u[row * H + h] = u;
      if (!p.af3) {
        const int gc = 4 * H + h;
        const float g = tm_sigmoid(tm_bwd_ld<TM_BWD_F(IO)>(p.p, row * p.f + gc) + tm_bwd_bias(p.proj_bias, gc));
        p.e[row * H + h] = u * g;
      }
    }
    if (lane == 0) {
      p.stats_t[2 * row] = mean;
      p.stats_t[2 * row + 1] = rstd;
    }
  }
}

extern "C" __global__ void TM_LAUNCH_BOUNDS_MIN(TM_BWD_THREADS, TM_BWD_TILE_BLOCKS) backward_output_norm(const TmBackwardParams p) { tm_bwd_output_norm<TM_IO_F32>(p); }
extern "C" __global__ void TM_LAUNCH_BOUNDS_MIN(TM_BWD_THREADS, TM_BWD_TILE_BLOCKS) backward_output_norm_16(const TmBackwardParams p) { tm_bwd_output_norm<TM_IO_BF16>(p); }

// The output gate's backward, one thread per element of the gate (af3 [M, C], gpumode [M, H]):
// dy in IO (af3 reads it here; gpumode's dv comes from a GEMM, in du).
template <int IO>
TM_INLINE void tm_bwd_output_gate(const TmBackwardParams& p) {
  const int H = p.h, W = p.af3 ? p.c : p.h;
  const tm_i64 i = (tm_i64)tm_bid() * TM_BWD_THREADS + tm_tid();
  if (i < p.rows * W) {
    const tm_i64 row = i / W;
    const int col = (int)(i - row * W), gc = 4 * H + col;
    const float g = tm_sigmoid(tm_bwd_ld<TM_BWD_F(IO)>(p.p, row * p.f + gc) + tm_bwd_bias(p.proj_bias, gc));
    if (p.af3) {
      const float dy = tm_bwd_ld<IO>(p.dy, i), s = p.e[i] + tm_bwd_bias(p.out_bias, col);
      p.e[i] = dy * g;
      tm_bwd_st<TM_BWD_G(IO)>(p.dcat, row * p.f + gc, dy * s * g * (1.f - g));
    } else {
      const float dv = p.du[i];
      p.du[i] = dv * g;
      tm_bwd_st<TM_BWD_G(IO)>(p.dcat, row * p.f + gc, dv * p.u[i] * g * (1.f - g));
    }
  }
}

extern "C" __global__ void TM_LAUNCH_BOUNDS(TM_BWD_THREADS) backward_output_gate(const TmBackwardParams p) { tm_bwd_output_gate<TM_IO_F32>(p); }
extern "C" __global__ void TM_LAUNCH_BOUNDS(TM_BWD_THREADS) backward_output_gate_16(const TmBackwardParams p) {
  p.io == TM_IO_F16 ? tm_bwd_output_gate<TM_IO_F16>(p) : tm_bwd_output_gate<TM_IO_BF16>(p);
}

// The LayerNorm backward kernels' column sums, γ's gradient Σ du⊙v̂ and β's Σ du over all
// positions: each warp adds its positions into its own row of `acc` ([warps][2W] floats in
// shared memory: [0, W) for γ, [W, 2W) for β; each lane owns its columns, so no atomics), and
// the block's warps are added in f64 into its row of `partial` (backward_column_finish adds
// the blocks' rows). The grid is `blocks` and each block loops over positions.
TM_INLINE void tm_bwd_zero_acc(float* acc, int w) {
  for (int i = (int)tm_tid(); i < TM_BWD_WARPS * 2 * w; i += TM_BWD_THREADS) acc[i] = 0.f;
  tm_sync();
}

TM_INLINE void tm_bwd_flush_acc(const TmBackwardParams& p, const float* acc, int w) {
  tm_sync();
  for (int i = (int)tm_tid(); i < 2 * w; i += TM_BWD_THREADS) {
    double t = 0.0;
    for (int k = 0; k < TM_BWD_WARPS; ++k) t += (double)acc[k * 2 * w + i];
    p.partial[(tm_i64)tm_bid() * 2 * w + i] = t;
  }
}

// Dynamic shared memory of backward_output_norm_grad: the tile's t and the accumulators.
#define TM_BWD_T_ACC_SMEM(H) (TM_BWD_T_SMEM(H) + TM_BWD_WARPS * 2 * (H) * 4)

// LN_H's backward: dt (hidden-major, over t) from du and t, tile after tile; the column sums of
// du⊙t̂ and du.
template <int IO>
TM_INLINE void tm_bwd_output_norm_grad(const TmBackwardParams& p) {
  extern __shared__ float tm_dyn_smem[];
  const int H = p.h;
  float* st = tm_dyn_smem;
  float* acc = st + H * (TM_BWD_TILE + 1);
  const int lane = (int)(tm_tid() & 31u), warp = (int)(tm_tid() >> 5);
  float* wacc = acc + warp * 2 * H;
  tm_bwd_zero_acc(acc, H);
  const tm_i64 tiles = (p.rows + TM_BWD_TILE - 1) / TM_BWD_TILE;
  for (tm_i64 tile = tm_bid(); tile < tiles; tile += p.blocks) {
    const tm_i64 first = tile * TM_BWD_TILE;
    tm_bwd_load_hidden<TM_BWD_F(IO)>(p, p.t, st, first, 0, H);
    tm_sync();
    for (int r = warp; r < TM_BWD_TILE; r += TM_BWD_WARPS) {
      const tm_i64 row = first + r;
      if (row >= p.rows) break;
      const float mean = p.stats_t[2 * row], rstd = p.stats_t[2 * row + 1];
      float sg = 0.f, sgh = 0.f;
      for (int h = lane; h < H; h += 32) {
        const float th = (st[h * (TM_BWD_TILE + 1) + r] - mean) * rstd;
        const float g = p.du[row * H + h] * p.norm_out_w[h];
        sg += g;
        sgh += g * th;
      }
      const float mg = tm_group32_sum(sg) / (float)H, mgh = tm_group32_sum(sgh) / (float)H;
      for (int h = lane; h < H; h += 32) {
        float* cell = st + h * (TM_BWD_TILE + 1) + r;
        const float th = (*cell - mean) * rstd;
        const float du = p.du[row * H + h];
        *cell = rstd * (du * p.norm_out_w[h] - mg - th * mgh);
        wacc[h] += du * th;
        wacc[H + h] += du;
      }
    }
    tm_sync();
    tm_bwd_store_hidden<TM_BWD_G(IO)>(p, p.t, st, first, 0, H);
    tm_sync();  // the next tile's loads overwrite st
  }
  tm_bwd_flush_acc(p, acc, H);
}

extern "C" __global__ void TM_LAUNCH_BOUNDS_MIN(TM_BWD_THREADS, TM_BWD_TILE_BLOCKS) backward_output_norm_grad(const TmBackwardParams p) { tm_bwd_output_norm_grad<TM_IO_F32>(p); }
extern "C" __global__ void TM_LAUNCH_BOUNDS_MIN(TM_BWD_THREADS, TM_BWD_TILE_BLOCKS) backward_output_norm_grad_16(const TmBackwardParams p) { tm_bwd_output_norm_grad<TM_IO_BF16>(p); }

// The gated projections' backward: dcat's first 4H columns from dleft and dright (hidden-major,
// in `left`/`right`'s place: the caller passes them there) and P.
template <int IO>
TM_INLINE void tm_bwd_gating_grad(const TmBackwardParams& p) {
  extern __shared__ float tm_dyn_smem[];
  const TmBwdTile tile = tm_bwd_tile();
  const int lane = tile.lane, warp = tile.warp, H = p.h;
  const tm_i64 first = tile.first;
  float* sl = tm_dyn_smem;
  float* sr = sl + 32 * (TM_BWD_TILE + 1);
  const tm_i64 rows = p.rows, f = p.f;
  for (int h0 = 0; h0 < H; h0 += 32) {
    const int h = h0 + lane, hn = H - h0 < 32 ? H - h0 : 32;
    tm_bwd_load_hidden<TM_IO_F32>(p, p.left, sl, first, h0, hn);
    tm_bwd_load_hidden<TM_IO_F32>(p, p.right, sr, first, h0, hn);
    float bias[4] = {0.f, 0.f, 0.f, 0.f};  // as in tm_bwd_gating
    if (p.proj_bias && h < H) {
      for (int k = 0; k < 4; ++k) bias[k] = p.proj_bias[k * H + h];
    }
    tm_sync();
#pragma unroll 1
    for (int r = warp; r < TM_BWD_TILE; r += TM_BWD_WARPS) {
      const tm_i64 row = first + r;
      if (row >= rows || h >= H) continue;
      // dcat is written over P (the caller passes one buffer): each element is read, then
      // written by the same thread, so the pointers may alias (no restrict).
      const tm_i64 pr = row * f;
      const float m = p.mask ? p.mask[row] : 1.f;
      const float d[2] = {sl[lane * (TM_BWD_TILE + 1) + r] * m, sr[lane * (TM_BWD_TILE + 1) + r] * m};
#pragma unroll
      for (int side = 0; side < 2; ++side) {
        const int cv = 2 * side * H + h, cg = cv + H;
        const float pv = tm_bwd_ld<TM_BWD_F(IO)>(p.p, pr + cv) + bias[2 * side];
        const float sg = tm_sigmoid(tm_bwd_ld<TM_BWD_F(IO)>(p.p, pr + cg) + bias[2 * side + 1]);
        tm_bwd_st<TM_BWD_G(IO)>(p.dcat, pr + cv, d[side] * sg);
        tm_bwd_st<TM_BWD_G(IO)>(p.dcat, pr + cg, d[side] * pv * sg * (1.f - sg));
      }
    }
    tm_sync();
  }
}

extern "C" __global__ void TM_LAUNCH_BOUNDS_MIN(TM_BWD_THREADS, TM_BWD_TILE_BLOCKS) backward_gating_grad(const TmBackwardParams p) { tm_bwd_gating_grad<TM_IO_F32>(p); }
extern "C" __global__ void TM_LAUNCH_BOUNDS_MIN(TM_BWD_THREADS, TM_BWD_TILE_BLOCKS) backward_gating_grad_16(const TmBackwardParams p) { tm_bwd_gating_grad<TM_IO_BF16>(p); }

// Dynamic shared memory of backward_input_norm_grad: the accumulators.
#define TM_BWD_ACC_SMEM(C) (TM_BWD_WARPS * 2 * (C) * 4)

// LN_C's backward, one warp per position, blocks looping over positions: dx (in IO) from dz, x
// (in IO) and the statistics; the column sums of dz⊙x̂ and dz.
template <int IO>
TM_INLINE void tm_bwd_input_norm_grad(const TmBackwardParams& p) {
  extern __shared__ float tm_dyn_smem[];
  const int C = p.c;
  const int lane = (int)(tm_tid() & 31u), warp = (int)(tm_tid() >> 5);
  float* acc = tm_dyn_smem;
  float* wacc = acc + warp * 2 * C;
  if (tm_bwd_narrow(C, p.x, p.dx)) {
    // Lane owns channels [4·lane, 4·lane + 4) of every row: dz and x read once, as vectors, and
    // the column sums in registers until the end, then written (not added) to every column of
    // the warp's accumulators, so they need no zeroing.
    const int c0 = 4 * lane;
    const bool on = c0 < C;
    float w[4] = {0.f, 0.f, 0.f, 0.f}, sxh[4] = {0.f, 0.f, 0.f, 0.f}, sdz[4] = {0.f, 0.f, 0.f, 0.f};
    if (on)
      for (int k = 0; k < 4; ++k) w[k] = p.norm_in_w[c0 + k];
    for (tm_i64 row = (tm_i64)tm_bid() * TM_BWD_WARPS + warp; row < p.rows; row += (tm_i64)p.blocks * TM_BWD_WARPS) {
      const float mean = p.stats_x[2 * row], rstd = p.stats_x[2 * row + 1];
      const tm_i64 r0 = row * C;
      float dz[4] = {0.f, 0.f, 0.f, 0.f}, xh[4] = {0.f, 0.f, 0.f, 0.f};
      if (on) {
        tm_bwd_ld4<TM_IO_F32>(p.dz, r0 + c0, dz);
        tm_bwd_ld4<IO>(p.x, r0 + c0, xh);
        for (int k = 0; k < 4; ++k) xh[k] = (xh[k] - mean) * rstd;
      }
      float sg = 0.f, sgh = 0.f;
      for (int k = 0; k < 4; ++k) {
        const float g = dz[k] * w[k];
        sg += g;
        sgh += g * xh[k];
      }
      const float mg = tm_group32_sum(sg) / (float)C, mgh = tm_group32_sum(sgh) / (float)C;
      if (on) {
        float dx[4];
        for (int k = 0; k < 4; ++k) {
          dx[k] = rstd * (dz[k] * w[k] - mg - xh[k] * mgh);
          sxh[k] += dz[k] * xh[k];
          sdz[k] += dz[k];
        }
        tm_bwd_st4<IO>(p.dx, r0 + c0, dx);
      }
    }
    if (on)
      for (int k = 0; k < 4; ++k) {
        wacc[c0 + k] = sxh[k];
        wacc[C + c0 + k] = sdz[k];
      }
    tm_bwd_flush_acc(p, acc, C);
    return;
  }
  tm_bwd_zero_acc(acc, C);
  for (tm_i64 row = (tm_i64)tm_bid() * TM_BWD_WARPS + warp; row < p.rows; row += (tm_i64)p.blocks * TM_BWD_WARPS) {
    const float mean = p.stats_x[2 * row], rstd = p.stats_x[2 * row + 1];
    const tm_i64 r0 = row * C;
    const float* TM_RESTRICT dzr = p.dz + r0;
    float sg = 0.f, sgh = 0.f;
    for (int c = lane; c < C; c += 32) {
      const float g = dzr[c] * p.norm_in_w[c];
      sg += g;
      sgh += g * (tm_bwd_ld<IO>(p.x, r0 + c) - mean) * rstd;
    }
    const float mg = tm_group32_sum(sg) / (float)C, mgh = tm_group32_sum(sgh) / (float)C;
    for (int c = lane; c < C; c += 32) {
      const float xh = (tm_bwd_ld<IO>(p.x, r0 + c) - mean) * rstd, dz = dzr[c];
      tm_bwd_st<IO>(p.dx, r0 + c, rstd * (dz * p.norm_in_w[c] - mg - xh * mgh));
      wacc[c] += dz * xh;
      wacc[C + c] += dz;
    }
  }
  tm_bwd_flush_acc(p, acc, C);
}

extern "C" __global__ void TM_LAUNCH_BOUNDS(TM_BWD_THREADS) backward_input_norm_grad(const TmBackwardParams p) { tm_bwd_input_norm_grad<TM_IO_F32>(p); }
extern "C" __global__ void TM_LAUNCH_BOUNDS(TM_BWD_THREADS) backward_input_norm_grad_16(const TmBackwardParams p) {
  p.io == TM_IO_F16 ? tm_bwd_input_norm_grad<TM_IO_F16>(p) : tm_bwd_input_norm_grad<TM_IO_BF16>(p);
}

// Column sums of an [rows, cols] matrix with leading dimension ld (mirrored by `ColumnSums`).
typedef struct {
  const void* a;    // in `dtype`
  double* partial;  // [row_blocks, cols]
  float* out;       // [cols]
  tm_i64 rows;
  int cols;
  int ld;
  int row_blocks;
  int dtype;  // TM_IO_F32, TM_IO_BF16 or TM_IO_F16
} TmColumnSums;

// Block (row block rb, 32-column chunk cb): each warp sums every 8th row of the block's range
// for 32 consecutive columns in f64, then the 8 warps are added in a fixed order.
// Dynamic shared memory of backward_column_partials: the warps' f64 sums.
#define TM_BWD_PARTIALS_SMEM (TM_BWD_WARPS * 32 * 8)

template <int T>
TM_INLINE void tm_bwd_column_partials(const TmColumnSums& s) {
  extern __shared__ float tm_dyn_smem[];
  double* red = (double*)tm_dyn_smem;
  const int lane = (int)(tm_tid() & 31u), warp = (int)(tm_tid() >> 5);
  const int chunks = (s.cols + 31) / 32;
  const int rb = (int)tm_bid() / chunks, cb = (int)tm_bid() - rb * chunks;
  const tm_i64 per = (s.rows + s.row_blocks - 1) / s.row_blocks;
  const tm_i64 r0 = rb * per, r1 = r0 + per < s.rows ? r0 + per : s.rows;
  const int col = cb * 32 + lane;
  double acc = 0.0;
  if (col < s.cols)
    for (tm_i64 r = r0 + warp; r < r1; r += TM_BWD_WARPS) acc += (double)tm_bwd_ld<T>(s.a, r * s.ld + col);
  red[warp * 32 + lane] = acc;
  tm_sync();
  if (warp == 0 && col < s.cols) {
    double t = 0.0;
    for (int w = 0; w < TM_BWD_WARPS; ++w) t += red[w * 32 + lane];
    s.partial[(tm_i64)rb * s.cols + col] = t;
  }
}

extern "C" __global__ void TM_LAUNCH_BOUNDS(TM_BWD_THREADS) backward_column_partials(const TmColumnSums s) {
  switch (s.dtype) {
    case TM_IO_BF16:
      tm_bwd_column_partials<TM_IO_BF16>(s);
      break;
    case TM_IO_F16:
      tm_bwd_column_partials<TM_IO_F16>(s);
      break;
    default:
      tm_bwd_column_partials<TM_IO_F32>(s);
  }
}

extern "C" __global__ void TM_LAUNCH_BOUNDS(TM_BWD_THREADS) backward_column_finish(const TmColumnSums s) {
  const int col = (int)(tm_bid() * TM_BWD_THREADS + tm_tid());
  if (col >= s.cols) return;
  double t = 0.0;
  for (int rb = 0; rb < s.row_blocks; ++rb) t += s.partial[(tm_i64)rb * s.cols + col];
  s.out[col] = (float)t;
}

// n elements from one precision to another (TM_IO_ values): the prepared f16 weights to f32 for
// the TF32 GEMMs or to bf16 for the bf16 ones, and gpumode's 16-bit dy to f32 for its GEMMs;
// mirrored by `Convert`.
typedef struct {
  const void* src;
  void* dst;
  tm_i64 n;
  int from;
  int to;
} TmConvert;

extern "C" __global__ void TM_LAUNCH_BOUNDS(TM_BWD_THREADS) backward_convert(const TmConvert w) {
  const tm_i64 i = (tm_i64)tm_bid() * TM_BWD_THREADS + tm_tid();
  if (i >= w.n) return;
  const float v = w.from == TM_IO_F32    ? tm_bwd_ld<TM_IO_F32>(w.src, i)
                  : w.from == TM_IO_BF16 ? tm_bwd_ld<TM_IO_BF16>(w.src, i)
                                         : tm_bwd_ld<TM_IO_F16>(w.src, i);
  if (w.to == TM_IO_F32) {
    tm_bwd_st<TM_IO_F32>(w.dst, i, v);
  } else if (w.to == TM_IO_BF16) {
    tm_bwd_st<TM_IO_BF16>(w.dst, i, v);
  } else {
    tm_bwd_st<TM_IO_F16>(w.dst, i, v);
  }
}
