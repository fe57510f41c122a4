// Stage 3 fused: output LayerNorm, gate and output projection in one pass, y out in the I/O
// precision (f32, bf16 or f16).
//   gpumode: y = (LN_H(t) ⊙ gate) · Woutᵀ                gate [M, H]
//   af3:     y = gate ⊙ (LN_H(t) · Woutᵀ + bout)         gate [M, C], bout optional
// It replaces output_norm + the cuBLASLt output GEMM (+ output_gate) and saves writing and
// re-reading the [M, H] operand `a` (and, for af3, a pass over y).
//
// A block owns OP_BM = 64 consecutive positions (three blocks per SM: with 128 the kernel sat
// waiting on DRAM, ncu's long-scoreboard stall at 3.9 per issued instruction):
//   1. t[b, :, positions] -> shared sa[BM][H + 8] (f16), transposed on the way in: each thread
//      loads 32 bytes of one channel (16 positions, a full sector) and writes them down a column,
//      consecutive threads taking consecutive channels so the shared stores do not conflict.
//      These loads are issued before anything else, the rest of the set-up running under them;
//   2. mean and rstd per position in f32, two passes, 4 threads per position;
//   3. a = (t - mean)·rstd·w + b (⊙ gate for gpumode) in place in sa, 16 bytes at a time, the
//      gate read 16 bytes at a time along h (coalesced) at the start of the kernel, so that its
//      latency, like that of the t loads (four in flight per thread), overlaps other work;
//   4. for each 128-column chunk of C: Wout's rows for the chunk -> shared sw[128][H + 8] through
//      cp.async (the first chunk's copy overlaps steps 1–3), then mma.sync m16n8k16 with f32
//      accumulators, 8 warps as 2 (rows) x 4 (columns) of 32 x 32, K = H;
//   5. epilogue from registers: + bout, ⊙ gate for af3, and y out. af3's gate chunk [BM][128]
//      comes into shared sg through cp.async with the Wout chunk (ncu, af3 bf16 at N = 1024: the
//      epilogue's per-element gate loads, issued right before their use, held a third of the
//      kernel's stall samples). 16-bit y is packed into sg (over the gate it used) and leaves as
//      16-byte runs along C; f32 y is stored from registers, 8 bytes per thread.
// Requirements checked by the host: H % 16 == 0, H <= 128, C % 8 == 0.
// output_projection_resident (end of the file) runs the same steps for H = 128, C <= 128 as
// blocks that load Wout once and walk tiles, each tile's t prefetched, with the output columns
// permuted so that the epilogue reads and writes 16 bytes at a time from registers.
#include "common/compat.h"
#include "common/params.h"
#include "cuda/io.h"
#include "cuda/mma.h"

#define OP_THREADS 256
#define OP_BM 64
#define OP_BN 128
#define OP_LD (128 + 8)  // halves per row of sa and sw: 16 bytes of padding keep ldmatrix conflict-free
// Step-3 items (8 channels of one position) per thread at the largest H (128).
#define OP_ITEMS (OP_BM * (128 / 8) / OP_THREADS)
#define OP_TPP (OP_THREADS / OP_BM)  // threads per position in the statistics step
// t pieces (32 bytes) each thread has in flight in step 1: all of them at H = 128.
#define OP_T_INFLIGHT (128 * (OP_BM / 16) / OP_THREADS)

// i / d for the small divisors of this kernel (H / 8: 2 .. 16): a shift when d is a power of two
// (H = 16, 32, 64, 128), which the index math of the copies and the normalisation otherwise
// spends most of its instructions on (ncu, H100).
__device__ __forceinline__ int op_div(int i, int d) { return (d & (d - 1)) == 0 ? i >> (__ffs(d) - 1) : i / d; }

// Copy Wout rows [c0, c0 + 128) into sw (zeros past C); one cp.async group. HC: H when it is
// known at compile time (128), else 0.
template <int HC>
__device__ __forceinline__ void op_load_w(const TrimulParams& p, tm_half* sw, int c0) {
  const int H = HC ? HC : p.h, pieces_per_row = H / 8;
#pragma unroll
  for (int i = threadIdx.x; i < OP_BN * pieces_per_row; i += OP_THREADS) {
    const int row = op_div(i, pieces_per_row), col = (i - row * pieces_per_row) * 8;
    tm_half* dst = sw + row * OP_LD + col;
    if (c0 + row < p.c) {
      mma_cp_async16(mma_smem_addr(dst), p.w_out + (tm_i64)(c0 + row) * H + col);
    } else {
      *(uint4*)dst = make_uint4(0, 0, 0, 0);
    }
  }
  asm volatile("cp.async.commit_group;");
}

// Whether the block stages through sg: af3's gate, and 16-bit y on its way out.
__device__ __forceinline__ bool op_uses_sg(const TrimulParams& p) { return p.af3 || p.io_dtype != TM_IO_F32; }

// Copy af3's gate columns [c0, c0 + 128) of the block's rows into sg (zeros past C and past the
// last position); cp.async without a commit: the caller commits.
__device__ __forceinline__ void op_load_gate(const TrimulParams& p, tm_half* sg, tm_i64 first, int np, int c0) {
#pragma unroll
  for (int k = 0; k < OP_BM * 16 / OP_THREADS; ++k) {
    const int i = threadIdx.x + k * OP_THREADS, r = i >> 4, col = (i & 15) * 8;
    tm_half* dst = sg + r * OP_LD + col;
    if (r < np && c0 + col < p.c) {
      mma_cp_async16(mma_smem_addr(dst), p.gate + (first + r - p.buf_row0) * (tm_i64)p.g + c0 + col);
    } else {
      *(uint4*)dst = make_uint4(0, 0, 0, 0);
    }
  }
}

// The 16-bit y staged in sg (columns [c0, c0 + 128) of the block's rows) out as 16-byte runs.
__device__ __forceinline__ void op_store_y16(const TrimulParams& p, const tm_half* sg, tm_i64 first, int np, int c0) {
#pragma unroll
  for (int k = 0; k < OP_BM * 16 / OP_THREADS; ++k) {
    const int i = threadIdx.x + k * OP_THREADS, r = i >> 4, col = (i & 15) * 8;
    if (r < np && c0 + col < p.c) {
      *(uint4*)((unsigned short*)p.y + (first + r) * p.c + c0 + col) = *(const uint4*)(sg + r * OP_LD + col);
    }
  }
}

// Step 5 for a warp's 32 x 32 tile: acc[mt][nt] covers rows r0 + 16·mt (+ 8) and columns
// cw + 8·nt (+ 1) of the chunk starting at c0, cw already including the lane's 2·(lane % 4).
// af3's gate comes from sg. Y16: y is 16-bit and goes into sg (each element where this thread
// read its gate); the caller stores the tile after a barrier.
template <bool HAS_BIAS, bool AF3, bool Y16>
__device__ __forceinline__ void op_epilogue(const TrimulParams& p, const float (&acc)[2][4][4], tm_half* sg,
                                            tm_i64 first, int np, int c0, int cw, int r0) {
  const int C = p.c;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int c = cw + nt * 8;
    if (c >= C) continue;
    const float2 bias = HAS_BIAS ? *(const float2*)(p.out_bias + c) : make_float2(0.f, 0.f);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + mt * 16 + half * 8;
        if (r >= np) continue;
        unsigned* staged = (unsigned*)(sg + r * OP_LD + (c - c0));
        float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
        if (HAS_BIAS) {
          v0 += bias.x;
          v1 += bias.y;
        }
        if (AF3) {
          const unsigned gg = *staged;
          v0 *= tm_lo(gg);
          v1 *= tm_hi(gg);
        }
        if (Y16) {
          *staged = io_pack_y2(p, v0, v1);
        } else {
          io_store_y2(p, (first + r) * C + c, v0, v1);
        }
      }
  }
}

template <bool HAS_BIAS, bool AF3>
__device__ __forceinline__ void op_epilogue_io(const TrimulParams& p, const float (&acc)[2][4][4], tm_half* sg,
                                               tm_i64 first, int np, int c0, int cw, int r0) {
  if (p.io_dtype == TM_IO_F32) {
    op_epilogue<HAS_BIAS, AF3, false>(p, acc, sg, first, np, c0, cw, r0);
  } else {
    op_epilogue<HAS_BIAS, AF3, true>(p, acc, sg, first, np, c0, cw, r0);
  }
}

// Specialised on the bias and the formulation: the branches and the per-element loads of the
// general form were a fifth of this kernel's instructions (ncu, H100).
__device__ __forceinline__ void op_epilogue_any(const TrimulParams& p, const float (&acc)[2][4][4], tm_half* sg,
                                                tm_i64 first, int np, int c0, int cw, int r0) {
  if (p.out_bias) {
    if (p.af3) op_epilogue_io<true, true>(p, acc, sg, first, np, c0, cw, r0);
    else op_epilogue_io<true, false>(p, acc, sg, first, np, c0, cw, r0);
  } else {
    if (p.af3) op_epilogue_io<false, true>(p, acc, sg, first, np, c0, cw, r0);
    else op_epilogue_io<false, false>(p, acc, sg, first, np, c0, cw, r0);
  }
}

// gpumode's gate for this thread's step-3 items (8 channels of one position each), f16 ones for
// af3 (its gate applies after the projection) and past the last position.
template <int HC>
__device__ __forceinline__ void op_load_gpre(const TrimulParams& p, uint4 (&gpre)[OP_ITEMS], tm_i64 first, int np) {
  const int h8 = (HC ? HC : p.h) / 8;
#pragma unroll
  for (int k = 0; k < OP_ITEMS; ++k) {
    const int i = threadIdx.x + k * OP_THREADS, r = op_div(i, h8);
    gpre[k] = make_uint4(0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u);  // f16 ones
    if (!p.af3 && i < OP_BM * h8 && r < np) {
      const tm_half* src = p.gate + (first + r - p.buf_row0) * (tm_i64)p.g + (i - r * h8) * 8;
      gpre[k] = *(const uint4*)src;
    }
  }
}

// One 32-byte piece of t (16 positions of channel h, from position 16·seg) down column h of sa.
__device__ __forceinline__ void op_scatter_t(tm_half* sa, const uint4 (&piece)[2], int h, int seg) {
  const tm_half* e16 = (const tm_half*)&piece[0];
#pragma unroll
  for (int e = 0; e < 16; ++e) sa[(seg * 16 + e) * OP_LD + h] = e16[e];
}

// 2. statistics, OP_TPP threads per position (adjacent lanes, 8 channels at a time in turn),
// two passes in f32.
template <int HC>
__device__ __forceinline__ void op_stats(const TrimulParams& p, const tm_half* sa, float* smean, float* srstd) {
  const int H = HC ? HC : p.h;
  const int r = threadIdx.x / OP_TPP, part = threadIdx.x % OP_TPP;
  const tm_half* row = sa + r * OP_LD;
  float s = 0.f;
  for (int h = part * 8; h < H; h += OP_TPP * 8) {
    const uint4 w = *(const uint4*)(row + h);
    const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) s += tm_lo(u[e]) + tm_hi(u[e]);
  }
#pragma unroll
  for (int o = 1; o < OP_TPP; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const float mean = s / (float)H;
  float q = 0.f;
  for (int h = part * 8; h < H; h += OP_TPP * 8) {
    const uint4 w = *(const uint4*)(row + h);
    const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float a = tm_lo(u[e]) - mean, b = tm_hi(u[e]) - mean;
      q += a * a + b * b;
    }
  }
#pragma unroll
  for (int o = 1; o < OP_TPP; o <<= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
  if (part == 0) {
    smean[r] = mean;
    srstd[r] = tm_rsqrt(q / (float)H + p.eps);
  }
}

// 3. normalise (⊙ gate for gpumode) in place, 8 channels per thread; positions past np become 0.
// GATED: multiply by gpre (gpumode; the plain kernel's af3 path passes ones instead).
template <int HC, bool GATED = true>
__device__ __forceinline__ void op_normalise(const TrimulParams& p, tm_half* sa, const float* smean,
                                             const float* srstd, const float* snw, const float* snb,
                                             const uint4 (&gpre)[OP_ITEMS], int np) {
  const int h8 = (HC ? HC : p.h) / 8;
#pragma unroll
  for (int k = 0; k < OP_ITEMS; ++k) {
    const int i = threadIdx.x + k * OP_THREADS;
    if (i >= OP_BM * h8) break;
    const int r = op_div(i, h8), h = (i - r * h8) * 8;
    tm_half* a = sa + r * OP_LD + h;
    const uint4 w = *(const uint4*)a;
    const unsigned u[4] = {w.x, w.y, w.z, w.w};
    const unsigned gv[4] = {gpre[k].x, gpre[k].y, gpre[k].z, gpre[k].w};
    const float mean = smean[r], rstd = srstd[r];
    unsigned o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = h + 2 * e;
      const float2 w = *(const float2*)(snw + c), b = *(const float2*)(snb + c);
      float lo = (tm_lo(u[e]) - mean) * rstd * w.x + b.x, hi = (tm_hi(u[e]) - mean) * rstd * w.y + b.y;
      if (GATED) {
        lo *= tm_lo(gv[e]);
        hi *= tm_hi(gv[e]);
      }
      o[e] = r < np ? tm_pack2(lo, hi) : 0u;
    }
    *(uint4*)a = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// 4. one 128-column chunk: the warp's 32 x 32 tile of sa · swᵀ over K = H, f32 accumulators.
template <int HC>
__device__ __forceinline__ void op_mma(const TrimulParams& p, float (&acc)[2][4][4], unsigned sa_u, unsigned sw_u,
                                       int warp_m, int warp_n) {
  const int H = HC ? HC : p.h;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
#pragma unroll 2
  for (int kk = 0; kk < H; kk += 16) {
    mma_warp_k16<4>(acc, sa_u, OP_LD, warp_m * 32, kk, sw_u, OP_LD, warp_n * 32, kk);
  }
}

// Both kernels' shared memory from its base: the a tile, one Wout chunk, mean and rstd per
// position and the LN_H weight and bias (read from shared memory by the normalisation, not per
// element from L1); `rest` is what follows (the plain kernel's sg, the resident one's sraw).
struct OpSmem {
  tm_half* sa;     // [BM][OP_LD]
  tm_half* sw;     // [BN][OP_LD]
  float* smean;    // [BM]
  float* srstd;    // [BM]
  float* snw;      // [128]
  float* snb;      // [128]
  tm_half* rest;
};

__device__ __forceinline__ OpSmem op_smem_layout(unsigned char* base) {
  OpSmem s;
  s.sa = (tm_half*)base;
  s.sw = s.sa + OP_BM * OP_LD;
  s.smean = (float*)(s.sw + OP_BN * OP_LD);
  s.srstd = s.smean + OP_BM;
  s.snw = s.srstd + OP_BM;
  s.snb = s.snw + 128;
  s.rest = (tm_half*)(s.snb + 128);
  return s;
}

// LN_H's weight and bias into shared memory (read by step 3, after at least one barrier).
template <int HC>
__device__ __forceinline__ void op_load_ln(const TrimulParams& p, float* snw, float* snb) {
  for (int h = threadIdx.x; h < (HC ? HC : p.h); h += OP_THREADS) {
    snw[h] = p.norm_out_w[h];
    snb[h] = p.norm_out_b[h];
  }
}

// The kernel body; HC is H when known at compile time (the common H = 128: every index
// division and copy loop then resolves at compile time), else 0.
template <int HC>
__device__ __forceinline__ void output_projection_body(const TrimulParams& p) {
  extern __shared__ __align__(16) unsigned char op_smem[];
  const OpSmem sm = op_smem_layout(op_smem);
  tm_half *sa = sm.sa, *sw = sm.sw;
  float *smean = sm.smean, *srstd = sm.srstd, *snw = sm.snw, *snb = sm.snb;
  tm_half* sg = sm.rest;  // [BM][OP_LD] when op_uses_sg: af3 gate, 16-bit y

  const int H = HC ? HC : p.h, C = p.c;
  // Blocks take the tiles last to first: the contraction wrote the last batch's t last, so the
  // L2 may still hold it when the first blocks start.
  const tm_i64 first = p.row0 + (tm_i64)(gridDim.x - 1 - blockIdx.x) * OP_BM;
  const tm_i64 end = p.row0 + p.rows;
  if (first >= end) return;
  const int np = (int)((end - first) < OP_BM ? (end - first) : OP_BM);
  const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const tm_i64 nn = (tm_i64)p.n * p.n;

  // 0. The weights (Wout's first chunk by cp.async, LN_H's weight and bias) are the only reads
  // before pdl_wait(): under programmatic launch they run while the contraction drains.
  op_load_w<HC>(p, sw, 0);
  op_load_ln<HC>(p, snw, snb);
  pdl_wait();

  // 1a. The t tile's loads go first among the dependent reads: they are the block's critical
  // DRAM latency, and the gate's set-up below runs while they are in flight. A thread
  // loads all its pieces (32 bytes of one channel: 16 positions) before storing any; the tile
  // has H·BM/16 <= 512 pieces, at most OP_T_INFLIGHT per thread.
  const tm_i64 b0 = first / nn, rem0 = first - b0 * nn;
  const int total = H * (OP_BM / 16);
  uint4 v[OP_T_INFLIGHT][2];
  {
    const bool fast = np == OP_BM && nn % 8 == 0 && rem0 % 8 == 0 && rem0 + OP_BM <= nn;
#pragma unroll
    for (int u = 0; u < OP_T_INFLIGHT; ++u) {
      const int i = tid + u * OP_THREADS;
      const int h = i % H, seg = i / H;  // consecutive threads: consecutive channels
      if (i >= total) continue;
      if (fast) {
        const uint4* src = (const uint4*)(p.t + (b0 * H + h) * nn + rem0 + seg * 16);
        v[u][0] = src[0];
        v[u][1] = src[1];
      } else {
        tm_half* e16 = (tm_half*)&v[u][0];
        for (int e = 0; e < 16; ++e) {
          const int r = seg * 16 + e;
          e16[e] = 0;
          if (r < np) {
            const tm_i64 row = first + r;
            const tm_i64 b = row / nn, rem = row - b * nn;
            e16[e] = p.t[(b * H + h) * nn + rem];
          }
        }
      }
    }
  }

  if (p.af3) {
    op_load_gate(p, sg, first, np, 0);
    asm volatile("cp.async.commit_group;");
  }

  // The gpumode gate of this thread's step-3 items, loaded now so its latency overlaps steps 1–2.
  uint4 gpre[OP_ITEMS];
  op_load_gpre<HC>(p, gpre, first, np);

  // 1b. The t tile, transposed into sa[position][h]; positions past the end are zero.
#pragma unroll
  for (int u = 0; u < OP_T_INFLIGHT; ++u) {
    const int i = tid + u * OP_THREADS;
    if (i < total) op_scatter_t(sa, v[u], i % H, i / H);
  }
  __syncthreads();
  op_stats<HC>(p, sa, smean, srstd);
  __syncthreads();
  op_normalise<HC>(p, sa, smean, srstd, snw, snb, gpre, np);

  // 4–5. per 128-column chunk: MMA over K = H, then the epilogue from registers.
  const int warp_m = warp & 1, warp_n = warp >> 1;  // 2 x 4 warps of 32 rows x 32 columns
  const int g = lane >> 2, tig = lane & 3;
  const unsigned sa_u = mma_smem_addr(sa), sw_u = mma_smem_addr(sw);
  for (int c0 = 0; c0 < C; c0 += OP_BN) {
    asm volatile("cp.async.wait_group 0;");
    __syncthreads();  // sw (and, on the first chunk, sa) complete
    float acc[2][4][4];
    op_mma<HC>(p, acc, sa_u, sw_u, warp_m, warp_n);
    __syncthreads();  // every warp done with sw before the next chunk's copy
    if (c0 + OP_BN < C) op_load_w<HC>(p, sw, c0 + OP_BN);
    const int cw = c0 + warp_n * 32 + 2 * tig, r0 = warp_m * 32 + g;
    op_epilogue_any(p, acc, sg, first, np, c0, cw, r0);
    if (op_uses_sg(p)) {
      __syncthreads();  // the tile's 16-bit y complete, and every gate read
      if (p.io_dtype != TM_IO_F32) op_store_y16(p, sg, first, np, c0);
      if (p.af3 && c0 + OP_BN < C) {
        // 16-bit y copied out of sg before the next gate chunk lands on it (f32 y never enters
        // sg, and the barrier above saw every gate read).
        if (p.io_dtype != TM_IO_F32) __syncthreads();
        op_load_gate(p, sg, first, np, c0 + OP_BN);
        asm volatile("cp.async.commit_group;");
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(OP_THREADS, 3) output_projection(const TrimulParams p) {
  if (p.h == 128) {
    output_projection_body<128>(p);
  } else {
    output_projection_body<0>(p);
  }
}

// t rows of the resident kernel's prefetch buffer: 64 positions plus 16 bytes of padding, so that
// the transposing reads (consecutive threads, consecutive channels) spread over the banks.
#define OP_RAW_LD (OP_BM + 8)

// The resident kernel's t tile [128 channels][64 positions] into sraw as one cp.async group:
// 1024 pieces of 16 bytes, 8 consecutive threads per channel's 128-byte run.
__device__ __forceinline__ void op_prefetch_t(const TrimulParams& p, tm_half* sraw, tm_i64 first) {
  const tm_i64 nn = (tm_i64)p.n * p.n, b = first / nn, rem = first - b * nn;
#pragma unroll
  for (int k = 0; k < 128 * (OP_BM / 8) / OP_THREADS; ++k) {
    const int i = threadIdx.x + k * OP_THREADS, h = i >> 3, q = i & 7;
    mma_cp_async16(mma_smem_addr(sraw + h * OP_RAW_LD + q * 8), p.t + (b * 128 + h) * nn + rem + q * 8);
  }
  asm volatile("cp.async.commit_group;");
}

// The resident kernel's column order. A thread's accumulators of one row hold GEMM columns
// 32·wn + 8·nt + 2·tig + e (nt = 0..3, e = 0..1: the m16n8 fragment layout); the kernel gives
// sw's row j Wout's row opr_perm(j), which swaps the 2-bit fields nt and tig, so that those 8
// columns are the 8 consecutive channels cb = 32·wn + 8·tig, .., cb + 7 of y. Then the
// epilogue reads af3's gate and the bias 16 bytes at a time and writes y 16 or 32 contiguous
// bytes per row straight from registers (the fragment order took 4-byte gate loads and 4- or
// 8-byte y stores, and staged 16-bit y through shared memory). An involution: also the channel
// that sw row j feeds.
__device__ __forceinline__ int opr_perm(int j) { return (j & ~0x1e) | ((j & 0x6) << 2) | ((j >> 2) & 0x6); }

// Copy Wout into sw in the resident kernel's column order (rows past C zero); one cp.async group.
__device__ __forceinline__ void opr_load_w(const TrimulParams& p, tm_half* sw) {
#pragma unroll
  for (int i = threadIdx.x; i < OP_BN * 16; i += OP_THREADS) {
    const int row = i >> 4, col = (i & 15) * 8, c = opr_perm(row);
    tm_half* dst = sw + row * OP_LD + col;
    if (c < p.c) {
      mma_cp_async16(mma_smem_addr(dst), p.w_out + (tm_i64)c * 128 + col);
    } else {
      *(uint4*)dst = make_uint4(0, 0, 0, 0);
    }
  }
  asm volatile("cp.async.commit_group;");
}

// af3's gate for this thread's rows r0 + 16·mt + 8·half, channels cb .. cb + 7 (one 16-byte
// load each), loaded at the top of a tile so that its latency runs under the tile's other steps.
__device__ __forceinline__ void opr_load_gate(const TrimulParams& p, uint4 (&gq)[2][2], tm_i64 first, int cb, int r0) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const tm_i64 row = first + r0 + mt * 16 + half * 8 - p.buf_row0;
      gq[mt][half] = cb < p.c ? __ldg((const uint4*)(p.gate + row * (tm_i64)p.g + cb)) : make_uint4(0, 0, 0, 0);
    }
}

// Step 5 of the resident kernel: + bout, ⊙ af3's gate, and the 8 consecutive channels of each of
// the thread's four rows out from registers (C <= 128, whole tiles: no row or column beyond
// the layer's but the channels past C, which the whole group of 8 is).
template <bool AF3, bool Y16, bool HAS_BIAS>
__device__ __forceinline__ void opr_epilogue(const TrimulParams& p, const float (&acc)[2][4][4],
                                             const uint4 (&gq)[2][2], tm_i64 first, int cb, int r0) {
  if (cb >= p.c) return;
  float bias[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (HAS_BIAS) {
    const float4 b0 = __ldg((const float4*)(p.out_bias + cb)), b1 = __ldg((const float4*)(p.out_bias + cb + 4));
    bias[0] = b0.x, bias[1] = b0.y, bias[2] = b0.z, bias[3] = b0.w;
    bias[4] = b1.x, bias[5] = b1.y, bias[6] = b1.z, bias[7] = b1.w;
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float v[8];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        v[2 * nt] = acc[mt][nt][2 * half] + bias[2 * nt];
        v[2 * nt + 1] = acc[mt][nt][2 * half + 1] + bias[2 * nt + 1];
        if (AF3) {
          const unsigned gg = (&gq[mt][half].x)[nt];  // channels cb + 2·nt, + 1
          v[2 * nt] *= tm_lo(gg);
          v[2 * nt + 1] *= tm_hi(gg);
        }
      }
      const tm_i64 at = (first + r0 + mt * 16 + half * 8) * p.c + cb;
      if (Y16) {
        *(uint4*)((unsigned short*)p.y + at) = make_uint4(io_pack_y2(p, v[0], v[1]), io_pack_y2(p, v[2], v[3]),
                                                          io_pack_y2(p, v[4], v[5]), io_pack_y2(p, v[6], v[7]));
      } else {
        float4* dst = (float4*)(p.y + at);
        dst[0] = make_float4(v[0], v[1], v[2], v[3]);
        dst[1] = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
}

// The resident form for H = 128, C <= 128 (one column chunk), any formulation and y precision:
// a block loads Wout once and walks tiles (blockIdx.x, + gridDim.x, ... counted from the last
// tile, as the plain kernel's blocks are); each tile's t arrives by cp.async while the block
// works on the tile before (the plain kernel waits on its t tile at the start of every block: a
// quarter of its stall samples, ncu at 256,2,128). It has no staging tile sg, which would leave
// room for only two blocks per SM (the form that lost, NOTES.md): with sw's rows in opr_perm's
// order, af3's gate comes into registers (the ones gpumode's gate takes in step 3) as one
// 16-byte load per row and y leaves from registers. The host guarantees whole tiles inside one
// batch: rows, row0 and N² multiples of 64.
template <bool AF3, bool Y16>
__device__ __forceinline__ void output_projection_resident_body(const TrimulParams& p) {
  extern __shared__ __align__(16) unsigned char opr_smem[];
  const OpSmem sm = op_smem_layout(opr_smem);
  tm_half *sa = sm.sa, *sw = sm.sw;
  float *smean = sm.smean, *srstd = sm.srstd, *snw = sm.snw, *snb = sm.snb;
  tm_half* sraw = sm.rest;  // [128][OP_RAW_LD] the next tile's t

  const tm_i64 tiles = p.rows / OP_BM;
  tm_i64 tile = blockIdx.x;
  if (tile >= tiles) return;
  const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  opr_load_w(p, sw);
  op_load_ln<128>(p, snw, snb);
  pdl_wait();  // the weights above are all this block reads before the contraction is done
  // Tiles last to first, as in the plain kernel: the last batch's t is the freshest in L2.
  op_prefetch_t(p, sraw, p.row0 + (tiles - 1 - tile) * OP_BM);

  const int warp_m = warp & 1, warp_n = warp >> 1;
  const int g = lane >> 2, tig = lane & 3;
  const int cb = warp_n * 32 + 8 * tig, r0 = warp_m * 32 + g;  // channels cb .. cb + 7 (opr_perm)
  const unsigned sa_u = mma_smem_addr(sa), sw_u = mma_smem_addr(sw);
  for (; tile < tiles; tile += gridDim.x) {
    const tm_i64 first = p.row0 + (tiles - 1 - tile) * OP_BM;
    uint4 gpre[OP_ITEMS];
    uint4 gq[2][2];  // read only for af3
    if (AF3) {
      opr_load_gate(p, gq, first, cb, r0);
    } else {
      op_load_gpre<128>(p, gpre, first, OP_BM);
    }
    asm volatile("cp.async.wait_group 0;");
    // This tile's t (and Wout) landed; every warp is done with the last tile's sa (its MMA
    // operand).
    __syncthreads();
#pragma unroll
    for (int u = 0; u < 128 * (OP_BM / 16) / OP_THREADS; ++u) {
      const int i = tid + u * OP_THREADS, h = i & 127, seg = i >> 7;
      const uint4* src = (const uint4*)(sraw + h * OP_RAW_LD + seg * 16);
      const uint4 piece[2] = {src[0], src[1]};
      op_scatter_t(sa, piece, h, seg);
    }
    __syncthreads();  // sa complete, sraw free for the next tile
    if (tile + gridDim.x < tiles) op_prefetch_t(p, sraw, first - (tm_i64)gridDim.x * OP_BM);
    op_stats<128>(p, sa, smean, srstd);
    __syncthreads();
    op_normalise<128, !AF3>(p, sa, smean, srstd, snw, snb, gpre, OP_BM);
    __syncthreads();
    float acc[2][4][4];
    op_mma<128>(p, acc, sa_u, sw_u, warp_m, warp_n);
    if (p.out_bias) {
      opr_epilogue<AF3, Y16, true>(p, acc, gq, first, cb, r0);
    } else {
      opr_epilogue<AF3, Y16, false>(p, acc, gq, first, cb, r0);
    }
  }
}

extern "C" __global__ void __launch_bounds__(OP_THREADS, 3) output_projection_resident(const TrimulParams p) {
  const bool y16 = p.io_dtype != TM_IO_F32;
  if (p.af3) {
    if (y16) output_projection_resident_body<true, true>(p);
    else output_projection_resident_body<true, false>(p);
  } else {
    if (y16) output_projection_resident_body<false, true>(p);
    else output_projection_resident_body<false, false>(p);
  }
}
