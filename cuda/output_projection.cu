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
static_assert(OP_THREADS == TM_STAGE_THREADS && OP_BM == TM_OP_ROWS, "common/smem.h");
// The host passes these layouts' sizes as TM_OP_SMEM (+ TM_OP_SMEM_STAGING for sg): op_smem_layout.
static_assert((OP_BM + OP_BN) * OP_LD * 2 + (2 * OP_BM + 2 * 128) * 4 == TM_OP_SMEM, "common/smem.h");
static_assert(OP_BM * OP_LD * 2 == TM_OP_SMEM_STAGING, "common/smem.h");

// i / d for the small divisors of this kernel (H / 8: 2 .. 16): a shift when d is a power of two
// (H = 16, 32, 64, 128), which the index math of the copies and the normalisation otherwise
// spends most of its instructions on (ncu, H100).
__device__ __forceinline__ int op_div(int i, int d) { return (d & (d - 1)) == 0 ? i >> (__ffs(d) - 1) : i / d; }

// Copy Wout rows [c0, c0 + 128) into sw (zeros past C); one cp.async group. HC: H when it is
// known at compile time (128), else 0.
template <int HC>
__device__ __forceinline__ void op_load_w(const TmOutputParams& p, tm_half* sw, int c0) {
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
__device__ __forceinline__ bool op_uses_sg(const TmOutputParams& p) { return p.formulation == TM_AF3 || p.io_dtype != TM_IO_F32; }

// Copy af3's gate columns [c0, c0 + 128) of the block's rows into sg (zeros past C and past the
// last position); cp.async without a commit: the caller commits.
__device__ __forceinline__ void op_load_gate(const TmOutputParams& p, tm_half* sg, tm_i64 first, int np, int c0) {
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
__device__ __forceinline__ void op_store_y16(const TmOutputParams& p, const tm_half* sg, tm_i64 first, int np, int c0) {
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
__device__ __forceinline__ void op_epilogue(const TmOutputParams& p, const float (&acc)[2][4][4], tm_half* sg,
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
__device__ __forceinline__ void op_epilogue_io(const TmOutputParams& p, const float (&acc)[2][4][4], tm_half* sg,
                                               tm_i64 first, int np, int c0, int cw, int r0) {
  if (p.io_dtype == TM_IO_F32) {
    op_epilogue<HAS_BIAS, AF3, false>(p, acc, sg, first, np, c0, cw, r0);
  } else {
    op_epilogue<HAS_BIAS, AF3, true>(p, acc, sg, first, np, c0, cw, r0);
  }
}

// Specialised on the bias and the formulation: the branches and the per-element loads of the
// general form were a fifth of this kernel's instructions (ncu, H100).
__device__ __forceinline__ void op_epilogue_any(const TmOutputParams& p, const float (&acc)[2][4][4], tm_half* sg,
                                                tm_i64 first, int np, int c0, int cw, int r0) {
  if (p.out_bias) {
    if (p.formulation == TM_AF3) op_epilogue_io<true, true>(p, acc, sg, first, np, c0, cw, r0);
    else op_epilogue_io<true, false>(p, acc, sg, first, np, c0, cw, r0);
  } else {
    if (p.formulation == TM_AF3) op_epilogue_io<false, true>(p, acc, sg, first, np, c0, cw, r0);
    else op_epilogue_io<false, false>(p, acc, sg, first, np, c0, cw, r0);
  }
}

// gpumode's gate for this thread's step-3 items (8 channels of one position each), f16 ones for
// af3 (its gate applies after the projection) and past the last position.
template <int HC>
__device__ __forceinline__ void op_load_gpre(const TmOutputParams& p, uint4 (&gpre)[OP_ITEMS], tm_i64 first, int np) {
  const int h8 = (HC ? HC : p.h) / 8;
#pragma unroll
  for (int k = 0; k < OP_ITEMS; ++k) {
    const int i = threadIdx.x + k * OP_THREADS, r = op_div(i, h8);
    gpre[k] = make_uint4(0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u);  // f16 ones
    if (p.formulation != TM_AF3 && i < OP_BM * h8 && r < np) {
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
__device__ __forceinline__ void op_stats(const TmOutputParams& p, const tm_half* sa, float* smean, float* srstd) {
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
__device__ __forceinline__ void op_normalise(const TmOutputParams& p, tm_half* sa, const float* smean,
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
__device__ __forceinline__ void op_mma(const TmOutputParams& p, float (&acc)[2][4][4], unsigned sa_u, unsigned sw_u,
                                       int warp_m, int warp_n) {
  const int H = HC ? HC : p.h;
  mma_zero(acc);
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
__device__ __forceinline__ void op_load_ln(const TmOutputParams& p, float* snw, float* snb) {
  for (int h = threadIdx.x; h < (HC ? HC : p.h); h += OP_THREADS) {
    snw[h] = p.norm_out_w[h];
    snb[h] = p.norm_out_b[h];
  }
}

// The kernel body; HC is H when known at compile time (the common H = 128: every index
// division and copy loop then resolves at compile time), else 0.
template <int HC>
__device__ __forceinline__ void output_projection_body(const TmOutputParams& p) {
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
  const tm_i64 ms = (tm_i64)(p.mat_rows > 0 ? p.mat_rows : p.n) * p.n;  // between t's matrices
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
        const uint4* src = (const uint4*)(p.t + (b0 * H + h) * ms + rem0 + seg * 16);
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
            e16[e] = p.t[(b * H + h) * ms + rem];
          }
        }
      }
    }
  }

  if (p.formulation == TM_AF3) {
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
      if (p.formulation == TM_AF3 && c0 + OP_BN < C) {
        // 16-bit y copied out of sg before the next gate chunk lands on it (f32 y never enters
        // sg, and the barrier above saw every gate read).
        if (p.io_dtype != TM_IO_F32) __syncthreads();
        op_load_gate(p, sg, first, np, c0 + OP_BN);
        asm volatile("cp.async.commit_group;");
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(OP_THREADS, 3) output_projection(const TmOutputParams p) {
  if (p.h == 128) {
    output_projection_body<128>(p);
  } else {
    output_projection_body<0>(p);
  }
}

// t rows of the resident kernel's prefetch buffer: 64 positions plus 16 bytes of padding, so that
// the transposing reads (consecutive threads, consecutive channels) spread over the banks.
#define OP_RAW_LD (OP_BM + 8)
// The resident kernel's shared memory: op_smem_layout's, then sraw [128][OP_RAW_LD].
static_assert(TM_OP_SMEM + 128 * OP_RAW_LD * 2 == TM_OP_RESIDENT_SMEM, "common/smem.h");

// The resident kernel's t tile [128 channels][64 positions] into sraw as one cp.async group:
// 1024 pieces of 16 bytes, 8 consecutive threads per channel's 128-byte run.
__device__ __forceinline__ void op_prefetch_t(const TmOutputParams& p, tm_half* sraw, tm_i64 first) {
  const tm_i64 nn = (tm_i64)p.n * p.n, b = first / nn, rem = first - b * nn;
  const tm_i64 ms = (tm_i64)(p.mat_rows > 0 ? p.mat_rows : p.n) * p.n;  // between t's matrices
#pragma unroll
  for (int k = 0; k < 128 * (OP_BM / 8) / OP_THREADS; ++k) {
    const int i = threadIdx.x + k * OP_THREADS, h = i >> 3, q = i & 7;
    mma_cp_async16(mma_smem_addr(sraw + h * OP_RAW_LD + q * 8), p.t + (b * 128 + h) * ms + rem + q * 8);
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
__device__ __forceinline__ void opr_load_w(const TmOutputParams& p, tm_half* sw) {
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
__device__ __forceinline__ void opr_load_gate(const TmOutputParams& p, uint4 (&gq)[2][2], tm_i64 first, int cb, int r0) {
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
__device__ __forceinline__ void opr_epilogue(const TmOutputParams& p, const float (&acc)[2][4][4],
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
__device__ __forceinline__ void output_projection_resident_body(const TmOutputParams& p) {
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

extern "C" __global__ void __launch_bounds__(OP_THREADS, 3) output_projection_resident(const TmOutputParams p) {
  const bool y16 = p.io_dtype != TM_IO_F32;
  if (p.formulation == TM_AF3) {
    if (y16) output_projection_resident_body<true, true>(p);
    else output_projection_resident_body<true, false>(p);
  } else {
    if (y16) output_projection_resident_body<false, true>(p);
    else output_projection_resident_body<false, false>(p);
  }
}

// ---------------------------------------------------------------------------------------------
// output_projection_sm90_xgate: af3's output stage making the output gate itself, from x, for
// 16-bit x at C = H = 128 (sm_90a). The input stage then writes no gate: with 16-bit x, reading
// x here (2·C bytes a position) costs what reading the stored gate cost, and the input stage
// saves writing it, a quarter of its bytes. Per tile of 64 positions:
//   z = LN_C(x)                          from registers (16 lanes a position) into sz
//   g = σ(z · Wgᵀ + bg)                  wgmma, Wg = w_in's gate rows (stored halved)
//   a = LN_H(t)                          t's tile [h][position] in sraw (cp.async), its
//                                        statistics, then ldmatrix → normalise → stmatrix.trans
//                                        into sz (z is dead by then) as the second A, K-major
//   y = g ⊙ (a · Woutᵀ + bout)           wgmma, the epilogue from registers
// Two warpgroups, each taking 64 of the 128 output columns of both GEMMs (m64n64k16), so the
// tensor cores read each weight once per tile and A twice: 64 KB of shared-memory reads per
// GEMM where the mma.sync kernels' ldmatrix read 128 KB (an mma.sync form of this kernel was
// shared-memory bound and lost: NOTES.md, v33). Both weights sit in shared memory with their
// rows in opr_xg_perm's order, so that a thread's accumulators of a row are 16 consecutive
// channels: the gate multiplies y in registers and y leaves as two 16-byte stores per row.
// The next tile's x comes into registers while the block works on this one, and its t into
// sraw by cp.async (op_prefetch_t) once this tile's is consumed, under the output GEMM (the
// weights leave no room for a second staging tile at two blocks per SM).
#define OPX_X_PIECES (OP_BM * 16 / OP_THREADS)  // 16-byte pieces of x per thread: 4
static_assert(OP_RAW_LD == OP_BM + 8, "sraw's pitch: ldmatrix's 8 rows land in distinct banks");

// The kernel's column order: GEMM column J (warpgroup J / 64, n8 tile j, lane quad tig, e) feeds
// channel 64·(J / 64) + 16·tig + 2·j + e, so lane quad tig holds channels 16·tig .. + 15 of its
// warpgroup's 64. Sw's and swg's row J is that channel's weight row.
__device__ __forceinline__ int opr_xg_perm(int J) {
  return (J & 64) | (((J >> 1) & 3) << 4) | (((J >> 3) & 7) << 1) | (J & 1);
}

// The shared-memory layout (base 1024-byte aligned for the swizzled tiles).
struct OpxSmem {
  unsigned char* sw;   // [2 K atoms][128 rows][128 B] Wout, rows in opr_xg_perm order, 128-byte swizzle
  unsigned char* swg;  // the same for the gate weights
  unsigned char* sz;   // [2 K atoms][64 rows][128 B] z, then LN_H(t): the GEMMs' A
  tm_half* sraw;       // [128][OP_RAW_LD] the tile's t as loaded, [h][position]
  float* sred;         // [8 warps][64][2] partial sums of t's statistics
  float* smean;        // [64]
  float* srstd;        // [64]
  float* snw;          // [128] LN_H weight, bias
  float* snb;
  float* scw;          // [128] LN_C weight, bias
  float* scb;
  float* sgb;          // [128] the gate's bias (halved) in GEMM-column order, zeros without one
};

__device__ __forceinline__ OpxSmem opx_smem_layout(unsigned char* base) {
  OpxSmem s;
  s.sw = base;
  s.swg = s.sw + 32768;
  s.sz = s.swg + 32768;
  s.sraw = (tm_half*)(s.sz + 16384);
  s.sred = (float*)(s.sraw + 128 * OP_RAW_LD);
  s.smean = s.sred + 8 * OP_BM * 2;
  s.srstd = s.smean + OP_BM;
  s.snw = s.srstd + OP_BM;
  s.snb = s.snw + 128;
  s.scw = s.snb + 128;
  s.scb = s.scw + 128;
  s.sgb = s.scb + 128;
  return s;
}
// Where opx_smem_layout ends, plus the 1024 bytes of alignment slack: what the host passes.
static_assert(2 * 32768 + 16384 + 128 * OP_RAW_LD * 2 + (8 * OP_BM * 2 + 2 * OP_BM + 5 * 128) * 4 + 1024 ==
                  TM_OP_XGATE_SMEM,
              "common/smem.h");

// A [128][128] f16 weight (row J of the tile is row opr_xg_perm(J) of `w`, rows `ld` halves
// apart) into the 128-byte swizzle: one cp.async per 16-byte piece, no commit.
__device__ __forceinline__ void opx_load_weight(unsigned char* dst, const tm_half* w, tm_i64 ld) {
  for (int i = threadIdx.x; i < 2 * 128 * 8; i += OP_THREADS) {
    const int atom = i >> 10, row = (i >> 3) & 127, c16 = i & 7;
    mma_cp_async16(mma_smem_addr(dst) + wgmma_sw128_offset<128>(row, atom * 64 + c16 * 8),
                   w + opr_xg_perm(row) * ld + atom * 64 + c16 * 8);
  }
}

// This thread's pieces of a tile's x: rows tid/16 + 16·u, channels 8·(tid % 16) .. + 7.
__device__ __forceinline__ void opx_load_x(const TmOutputParams& p, uint4 (&xr)[OPX_X_PIECES], tm_i64 first) {
  const unsigned short* x = (const unsigned short*)p.x;
#pragma unroll
  for (int u = 0; u < OPX_X_PIECES; ++u) {
    const int i = threadIdx.x + u * OP_THREADS;
    xr[u] = __ldg((const uint4*)(x + (first + (i >> 4)) * 128 + (i & 15) * 8));
  }
}

// LN_C of this thread's pieces of x into sz (swizzled): a position's 128 channels are 16 lanes'
// pieces, so each statistic takes 4 shuffles (two passes in f32, as every LayerNorm here).
template <int IO>
__device__ __forceinline__ void opx_store_z(const uint4 (&xr)[OPX_X_PIECES], unsigned char* sz, const float* scw,
                                            const float* scb, float eps) {
  const int c = (threadIdx.x & 15) * 8;
  float w[8], b[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    w[e] = scw[c + e];
    b[e] = scb[c + e];
  }
#pragma unroll
  for (int u = 0; u < OPX_X_PIECES; ++u) {
    const float4 lo = io_widen4<IO>(make_uint2(xr[u].x, xr[u].y)), hi = io_widen4<IO>(make_uint2(xr[u].z, xr[u].w));
    const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    float s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const float mean = s * (1.f / 128.f);
    float q = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) q += (v[e] - mean) * (v[e] - mean);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
    const float rs = tm_rsqrt(q * (1.f / 128.f) + eps);
    unsigned z[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      z[e] = mma_pack_h2((v[2 * e] - mean) * rs * w[2 * e] + b[2 * e],
                         (v[2 * e + 1] - mean) * rs * w[2 * e + 1] + b[2 * e + 1]);
    const int r = (threadIdx.x + u * OP_THREADS) >> 4;
    *(uint4*)(sz + wgmma_sw128_offset<OP_BM>(r, c)) = make_uint4(z[0], z[1], z[2], z[3]);
  }
}

// LN_H's statistics of the tile in sraw, one pass shifted by each position's first channel
// (robust where the mean is large against the spread): thread (h octet hq = tid / 16, positions
// 4·(tid % 16) ..) sums 8 channels, the warp's two octets of a position are added by a shuffle,
// and each warp's sums go to sred; opx_stats_final adds the warps' sums after a barrier. (It runs
// under the gate's MMAs, whose accumulators hold 32 registers: 4 positions a thread keep it
// within the 128 of two blocks per SM.)
__device__ __forceinline__ void opx_stats_partial(const tm_half* sraw, float* sred) {
  const int pg = threadIdx.x & 15, hq = threadIdx.x >> 4, warp = threadIdx.x >> 5;
  const uint2 k2 = *(const uint2*)(sraw + pg * 4);
  const unsigned k[2] = {k2.x, k2.y};
  float s[4] = {0.f, 0.f, 0.f, 0.f}, q[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int hh = 0; hh < 8; ++hh) {
    const uint2 v2 = *(const uint2*)(sraw + (8 * hq + hh) * OP_RAW_LD + pg * 4);
    const unsigned v[2] = {v2.x, v2.y};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float d0 = tm_lo(v[e]) - tm_lo(k[e]), d1 = tm_hi(v[e]) - tm_hi(k[e]);
      s[2 * e] += d0;
      q[2 * e] += d0 * d0;
      s[2 * e + 1] += d1;
      q[2 * e + 1] += d1 * d1;
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    s[e] += __shfl_xor_sync(0xffffffffu, s[e], 16);
    q[e] += __shfl_xor_sync(0xffffffffu, q[e], 16);
  }
  if ((threadIdx.x & 31) < 16) {
#pragma unroll
    for (int e = 0; e < 4; ++e) *(float2*)(sred + (warp * OP_BM + pg * 4 + e) * 2) = make_float2(s[e], q[e]);
  }
}

__device__ __forceinline__ void opx_stats_final(const tm_half* sraw, const float* sred, float* smean, float* srstd,
                                                float eps) {
  const int r = threadIdx.x;
  if (r >= OP_BM) return;
  float s = 0.f, q = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    const float2 v = *(const float2*)(sred + (w * OP_BM + r) * 2);
    s += v.x;
    q += v.y;
  }
  const float d = s * (1.f / 128.f);  // mean - shift
  smean[r] = tm_h2f(*(const unsigned short*)(sraw + r)) + d;
  srstd[r] = tm_rsqrt(fmaxf(q * (1.f / 128.f) - d * d, 0.f) + eps);
}

#if defined(TM_HAS_WGMMA)
// sraw [h][position] → LN_H → sz [position][h] (K-major, swizzled): warp w takes positions
// 8w .. 8w + 7; each ldmatrix.x4 brings four 8 x 8 blocks (h blocks 4k + q, q = 0..3, lane L
// holding h = 8(4k + q) + L/4 at positions 8w + 2(L % 4), + 1), which are normalised in
// registers and stored transposed by stmatrix.trans (lane L addressing position 8w + L % 8 of
// block L / 8).
__device__ __forceinline__ void opx_transpose_normalise(const tm_half* sraw, unsigned char* sa, const float* smean,
                                                        const float* srstd, const float* snw, const float* snb) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int p0 = 8 * w + 2 * (lane & 3);
  const float m0 = smean[p0], m1 = smean[p0 + 1], r0 = srstd[p0], r1 = srstd[p0 + 1];
  const unsigned raw_u = mma_smem_addr(sraw), sa_u = mma_smem_addr(sa);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    unsigned v[4];
    mma_ldmatrix_x4(raw_u + ((8 * (4 * k + (lane >> 3)) + (lane & 7)) * OP_RAW_LD + 8 * w) * 2, v[0], v[1], v[2],
                    v[3]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int h = 8 * (4 * k + q) + (lane >> 2);
      const float wh = snw[h], bh = snb[h];
      v[q] = mma_pack_h2((tm_lo(v[q]) - m0) * r0 * wh + bh, (tm_hi(v[q]) - m1) * r1 * wh + bh);
    }
    stmatrix_x4_trans(sa_u + wgmma_sw128_offset<OP_BM>(8 * w + (lane & 7), 8 * (4 * k + (lane >> 3))), v[0], v[1],
                      v[2], v[3]);
  }
}
#endif

template <int IO>
__device__ __forceinline__ void output_projection_sm90_xgate_body(const TmOutputParams& p) {
#if defined(TM_HAS_WGMMA)
  extern __shared__ __align__(16) unsigned char opx_smem[];
  // The swizzle atoms must sit on 1024-byte boundaries; the host adds 1024 bytes of slack.
  const OpxSmem sm = opx_smem_layout(opx_smem + ((1024u - (mma_smem_addr(opx_smem) & 1023u)) & 1023u));
  const tm_i64 tiles = p.rows / OP_BM;
  tm_i64 tile = blockIdx.x;
  if (tile >= tiles) return;
  const unsigned tid = threadIdx.x, lane = tid & 31;
  // The weights and the LayerNorms' parameters: no other kernel's output, so before pdl_wait().
  opx_load_weight(sm.sw, p.w_out, 128);
  opx_load_weight(sm.swg, p.w_in + (tm_i64)4 * p.h_pad * p.k_pad, p.k_pad);
  asm volatile("cp.async.commit_group;");
  if (tid < 128) {
    sm.snw[tid] = p.norm_out_w[tid];
    sm.snb[tid] = p.norm_out_b[tid];
    sm.scw[tid] = p.norm_in_w[tid];
    sm.scb[tid] = p.norm_in_b[tid];
    sm.sgb[tid] = p.w_in_bias ? p.w_in_bias[4 * p.h_pad + opr_xg_perm(tid)] : 0.f;
  }
  pdl_wait();
  uint4 xr[OPX_X_PIECES];
  // Tiles last to first, as the other output kernels: the last batch's t is the freshest in L2.
  opx_load_x(p, xr, p.row0 + (tiles - 1 - tile) * OP_BM);
  op_prefetch_t(p, sm.sraw, p.row0 + (tiles - 1 - tile) * OP_BM);

  // Warpgroup wg takes GEMM columns 64·wg .. + 63 of both GEMMs; its thread (warp wq, lane g/tig)
  // holds rows 16·wq + g (+ 8) of them, channels 64·wg + 16·tig .. + 15 (opr_xg_perm).
  const int wg = __shfl_sync(0xffffffffu, (int)(tid >> 7), 0), wq = (tid >> 5) & 3;
  const int g = lane >> 2, tig = lane & 3;
  const unsigned long long a_desc = wgmma_desc_sw128(mma_smem_addr(sm.sz));
  const unsigned long long bg_desc = wgmma_desc_sw128(mma_smem_addr(sm.swg) + wg * 64 * 128);
  const unsigned long long bw_desc = wgmma_desc_sw128(mma_smem_addr(sm.sw) + wg * 64 * 128);
  const int ch = 64 * wg + 16 * tig;  // this thread's first channel
  for (; tile < tiles; tile += gridDim.x) {
    const tm_i64 first = p.row0 + (tiles - 1 - tile) * OP_BM;
    const bool more = tile + gridDim.x < tiles;
    asm volatile("cp.async.wait_group 0;");  // this tile's t (the first time, the weights too)
    fence_proxy_async();                     // the weights, visible to the tensor cores
    __syncthreads();  // t landed; every warpgroup done with the last tile's sz and statistics
    opx_store_z<IO>(xr, sm.sz, sm.scw, sm.scb, p.eps);
    if (more) opx_load_x(p, xr, first - (tm_i64)gridDim.x * OP_BM);
    fence_proxy_async();  // z, written by ordinary stores, is read by the tensor cores next
    __syncthreads();
    float acc[32];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) wgmma_slice<OP_BM>(acc, a_desc + ((ks * OP_BM * 128) >> 4), bg_desc + ((ks * 16384) >> 4), ks);
    wgmma_commit();
    opx_stats_partial(sm.sraw, sm.sred);  // under the gate's MMAs
    wgmma_wait_all();
    unsigned gq[2][8];  // σ(gate) of rows g, g + 8 (half), n8 tiles j: channels ch + 2j, + 1
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 gb = *(const float2*)(sm.sgb + 64 * wg + 8 * j + 2 * tig);
#pragma unroll
      for (int half = 0; half < 2; ++half)
        gq[half][j] = mma_sigmoid2_halves(acc[4 * j + 2 * half] + gb.x, acc[4 * j + 2 * half + 1] + gb.y);
    }
    __syncthreads();  // the partial sums; both warpgroups done reading z
    opx_stats_final(sm.sraw, sm.sred, sm.smean, sm.srstd, p.eps);
    __syncthreads();
    opx_transpose_normalise(sm.sraw, sm.sz, sm.smean, sm.srstd, sm.snw, sm.snb);
    fence_proxy_async();
    __syncthreads();  // LN_H(t) complete in sz; sraw free
    if (more) op_prefetch_t(p, sm.sraw, first - (tm_i64)gridDim.x * OP_BM);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) wgmma_slice<OP_BM>(acc, a_desc + ((ks * OP_BM * 128) >> 4), bw_desc + ((ks * 16384) >> 4), ks);
    wgmma_commit();
    wgmma_wait_all();
    // y = σ(gate) ⊙ (acc + bout), 16 consecutive channels of each of the thread's two rows.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      unsigned o[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 b = p.out_bias ? __ldg((const float2*)(p.out_bias + ch + 2 * j)) : make_float2(0.f, 0.f);
        const float v0 = (acc[4 * j + 2 * half] + b.x) * tm_lo(gq[half][j]);
        const float v1 = (acc[4 * j + 2 * half + 1] + b.y) * tm_hi(gq[half][j]);
        o[j] = io_pack_y2(p, v0, v1);
      }
      uint4* dst = (uint4*)((unsigned short*)p.y + (first + 16 * wq + g + 8 * half) * 128 + ch);
      dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
      dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
  }
#else
  __trap();
#endif
}

// Two blocks per SM: 106 KB of shared memory each (with the alignment slack), 128 registers a
// thread (ptxas keeps a few loop-invariant addresses in 72 bytes of local memory, reloaded once
// per tile). af3 only (its gate multiplies y; gpumode's would have to enter LN_H's tile).
extern "C" __global__ void __launch_bounds__(OP_THREADS, 2) output_projection_sm90_xgate(const TmOutputParams p) {
  if (p.io_dtype == TM_IO_BF16) {
    output_projection_sm90_xgate_body<TM_IO_BF16>(p);
  } else {
    output_projection_sm90_xgate_body<TM_IO_F16>(p);
  }
}
