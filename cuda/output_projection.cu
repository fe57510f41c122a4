// Stage 3 fused: output LayerNorm, gate and output projection in one pass, f32 y out.
//   gpumode: y = (LN_H(t) ⊙ gate) · Woutᵀ                gate [M, H]
//   af3:     y = gate ⊙ (LN_H(t) · Woutᵀ + bout)         gate [M, C], bout optional
// It replaces output_norm + the cuBLASLt output GEMM (+ output_gate) and saves writing and
// re-reading the [M, H] operand `a` (and, for af3, a pass over y).
//
// Persistent: a block walks tiles of OP_BM = 64 consecutive positions (tile blockIdx.x, then every
// gridDim.x-th), two blocks per SM. While it computes one tile, cp.async copies the next tile's t
// and gate into shared memory (the gate double-buffered: af3 reads it in the epilogue), so the DRAM reads overlap the LayerNorm, the MMA and the y
// stores; the earlier one-tile-per-block kernel waited on DRAM (ncu: long-scoreboard stall 4.0 per
// issued instruction) and copied all of Wout from L2 for every tile. Wout now stays resident when
// C <= 128. Per tile:
//   1. t[b, :, positions] (prefetched as [h][64 positions]) -> shared sa[BM][H + 8] (f16),
//      transposed from shared memory; tiles that cross a batch boundary or end early load t
//      straight from device memory instead;
//   2. mean and rstd per position in f32, two passes, 4 threads per position;
//   3. a = (t - mean)·rstd·w + b (⊙ gate for gpumode) in place in sa, 16 bytes at a time;
//   4. for each 128-column chunk of C: mma.sync m16n8k16 with f32 accumulators against Wout's
//      rows in sw[128][H + 8], 8 warps as 2 (rows) x 4 (columns) of 32 x 32, K = H (C > 128:
//      the chunk's rows are copied in per chunk);
//   5. epilogue from registers: + bout, ⊙ gate for af3, 8-byte stores of y.
// Requirements checked by the host: H % 16 == 0, H <= 128, C % 8 == 0.
#include "common/compat.h"
#include "common/params.h"
#include "cuda/mma.h"

#define OP_THREADS 256
#define OP_BM 64
#define OP_BN 128
#define OP_LD (128 + 8)  // halves per row of sa, sw and sg: 16 bytes of padding keep ldmatrix conflict-free
#define OP_LDT (OP_BM + 8)  // halves per channel of st: 144-byte rows, conflict-free 16-byte reads
// Step-3 items (8 channels of one position) per thread at the largest H (128).
#define OP_ITEMS (OP_BM * (128 / 8) / OP_THREADS)
#define OP_TPP (OP_THREADS / OP_BM)  // threads per position in the statistics step

// Copy Wout rows [c0, c0 + 128) into sw (zeros past C); one cp.async group.
__device__ __forceinline__ void op_load_w(const TrimulParams& p, tm_half* sw, int c0) {
  const int H = p.h, pieces_per_row = H / 8;
  for (int i = threadIdx.x; i < OP_BN * pieces_per_row; i += OP_THREADS) {
    const int row = i / pieces_per_row, col = (i - row * pieces_per_row) * 8;
    tm_half* dst = sw + row * OP_LD + col;
    if (c0 + row < p.c) {
      mma_cp_async16(mma_smem_addr(dst), p.w_out + (tm_i64)(c0 + row) * H + col);
    } else {
      *(uint4*)dst = make_uint4(0, 0, 0, 0);
    }
  }
  asm volatile("cp.async.commit_group;");
}

// Whether the tile starting at `first` with `np` positions lies in one batch, whole and 16-byte
// aligned in t: then its t rows are contiguous runs the copy engine can take.
__device__ __forceinline__ bool op_fast_tile(tm_i64 first, int np, tm_i64 nn) {
  const tm_i64 rem0 = first - (first / nn) * nn;
  return np == OP_BM && nn % 8 == 0 && rem0 % 8 == 0 && rem0 + OP_BM <= nn;
}

// Issue the cp.async copies of a tile's t (fast tiles only) into st and, when the gate fits
// (G <= 128), of its gate rows into sg; one cp.async group.
__device__ __forceinline__ void op_prefetch(const TrimulParams& p, tm_half* st, tm_half* sg, tm_i64 first, int np,
                                            tm_i64 nn, bool gate_in_smem) {
  const int H = p.h, G = p.g;
  if (op_fast_tile(first, np, nn)) {
    const tm_i64 b0 = first / nn, rem0 = first - b0 * nn;
    for (int i = threadIdx.x; i < H * (OP_BM / 8); i += OP_THREADS) {
      const int h = i / (OP_BM / 8), piece = i % (OP_BM / 8);
      mma_cp_async16(mma_smem_addr(st + h * OP_LDT + piece * 8), p.t + (b0 * H + h) * nn + rem0 + piece * 8);
    }
  }
  if (gate_in_smem) {
    const int g8 = G / 8;
    for (int i = threadIdx.x; i < np * g8; i += OP_THREADS) {
      const int r = i / g8, piece = i - r * g8;
      mma_cp_async16(mma_smem_addr(sg + r * OP_LD + piece * 8), p.gate + (first + r - p.buf_row0) * (tm_i64)G + piece * 8);
    }
  }
  asm volatile("cp.async.commit_group;");
}

extern "C" __global__ void __launch_bounds__(OP_THREADS, 2) output_projection(const TrimulParams p) {
  extern __shared__ __align__(16) unsigned char op_smem[];
  tm_half* sa = (tm_half*)op_smem;              // [BM][OP_LD]   normalised t (the A operand)
  tm_half* sw = sa + OP_BM * OP_LD;             // [BN][OP_LD]   Wout rows of one column chunk
  tm_half* st = sw + OP_BN * OP_LD;             // [128][OP_LDT] next tile's t as copied
  tm_half* sg2 = st + 128 * OP_LDT;             // [2][BM][OP_LD] this and the next tile's gate (G <= 128)
  float* smean = (float*)(sg2 + 2 * OP_BM * OP_LD);  // [BM]
  float* srstd = smean + OP_BM;                 // [BM]

  const int H = p.h, C = p.c, G = p.g;
  const tm_i64 end = p.row0 + p.rows;
  const tm_i64 ntiles = (p.rows + OP_BM - 1) / OP_BM;
  const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const tm_i64 nn = (tm_i64)p.n * p.n;
  const bool gate_in_smem = G <= 128;
  const int h8 = H / 8;
  const int warp_m = warp & 1, warp_n = warp >> 1;  // 2 x 4 warps of 32 rows x 32 columns
  const int g = lane >> 2, tig = lane & 3;
  const unsigned sa_u = mma_smem_addr(sa), sw_u = mma_smem_addr(sw);

  tm_i64 tile = blockIdx.x;
  if (tile >= ntiles) return;
  // Wout's first chunk (all of it when C <= 128), then the first tile's t and gate.
  op_load_w(p, sw, 0);
  {
    const tm_i64 first = p.row0 + tile * OP_BM;
    op_prefetch(p, st, sg2, first, (int)((end - first) < OP_BM ? (end - first) : OP_BM), nn, gate_in_smem);
  }

  for (int it = 0; tile < ntiles; tile += gridDim.x, ++it) {
    tm_half* sg = sg2 + (it & 1) * OP_BM * OP_LD;  // this tile's gate; the next one's goes to the other half
    const tm_i64 first = p.row0 + tile * OP_BM;
    const int np = (int)((end - first) < OP_BM ? (end - first) : OP_BM);
    asm volatile("cp.async.wait_group 0;");
    __syncthreads();  // this tile's st and sg (and Wout's chunk) have landed

    // 1. t tile into sa[position][h]; positions past the end are zero.
    if (op_fast_tile(first, np, nn)) {
      // From st: each thread reads 16 bytes (8 positions of one channel) and writes them down a
      // column of sa, consecutive threads taking consecutive channels.
      for (int i = tid; i < H * (OP_BM / 8); i += OP_THREADS) {
        const int h = i % H, seg = i / H;
        const uint4 v = *(const uint4*)(st + h * OP_LDT + seg * 8);
        const tm_half* e8 = (const tm_half*)&v;
#pragma unroll
        for (int e = 0; e < 8; ++e) sa[(seg * 8 + e) * OP_LD + h] = e8[e];
      }
    } else {
      for (int i = tid; i < H * OP_BM; i += OP_THREADS) {
        const int h = i % H, r = i / H;
        tm_half v = 0;
        if (r < np) {
          const tm_i64 row = first + r;
          const tm_i64 b = row / nn, rem = row - b * nn;
          v = p.t[(b * H + h) * nn + rem];
        }
        sa[r * OP_LD + h] = v;
      }
    }
    // The gpumode gate of this thread's step-3 items, from sg.
    uint4 gpre[OP_ITEMS];
#pragma unroll
    for (int k = 0; k < OP_ITEMS; ++k) {
      const int i = tid + k * OP_THREADS, r = i / h8;
      gpre[k] = make_uint4(0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u);  // f16 ones
      if (!p.af3 && i < OP_BM * h8 && r < np) gpre[k] = *(const uint4*)(sg + r * OP_LD + (i - r * h8) * 8);
    }
    __syncthreads();  // st consumed
    const tm_i64 next = tile + gridDim.x;
    if (next < ntiles) {
      const tm_i64 nfirst = p.row0 + next * OP_BM;
      tm_half* sg_next = sg2 + ((it + 1) & 1) * OP_BM * OP_LD;
      op_prefetch(p, st, sg_next, nfirst, (int)((end - nfirst) < OP_BM ? (end - nfirst) : OP_BM), nn, gate_in_smem);
    }

    // 2. statistics, OP_TPP threads per position (adjacent lanes, 8 channels at a time in turn),
    // two passes in f32.
    {
      const int r = tid / OP_TPP, part = tid % OP_TPP;
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
    __syncthreads();

    // 3. normalise (⊙ gate for gpumode) in place, 8 channels per thread.
#pragma unroll
    for (int k = 0; k < OP_ITEMS; ++k) {
      const int i = tid + k * OP_THREADS;
      if (i >= OP_BM * h8) break;
      const int r = i / h8, h = (i - r * h8) * 8;
      tm_half* a = sa + r * OP_LD + h;
      const uint4 w = *(const uint4*)a;
      const unsigned u[4] = {w.x, w.y, w.z, w.w};
      const unsigned gv[4] = {gpre[k].x, gpre[k].y, gpre[k].z, gpre[k].w};
      const float mean = smean[r], rstd = srstd[r];
      unsigned o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = h + 2 * e;
        const float lo = ((tm_lo(u[e]) - mean) * rstd * p.norm_out_w[c] + p.norm_out_b[c]) * tm_lo(gv[e]);
        const float hi = ((tm_hi(u[e]) - mean) * rstd * p.norm_out_w[c + 1] + p.norm_out_b[c + 1]) * tm_hi(gv[e]);
        o[e] = r < np ? tm_pack2(lo, hi) : 0u;
      }
      *(uint4*)a = make_uint4(o[0], o[1], o[2], o[3]);
    }

    // 4–5. per 128-column chunk: MMA over K = H, then the epilogue from registers.
    for (int c0 = 0; c0 < C; c0 += OP_BN) {
      if (c0 > 0) asm volatile("cp.async.wait_group 0;");  // this chunk's Wout rows
      __syncthreads();  // sw and sa complete
      float acc[2][4][4];
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
      if (C > OP_BN) {
        // Wout does not fit: the next chunk's rows (or the next tile's first) replace these.
        __syncthreads();  // every warp done with sw
        op_load_w(p, sw, c0 + OP_BN < C ? c0 + OP_BN : 0);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = warp_m * 32 + mt * 16 + g + half * 8;
          if (r >= np) continue;
          const tm_i64 row = first + r;
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const int c = c0 + warp_n * 32 + nt * 8 + 2 * tig;
            if (c >= C) continue;
            float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
            if (p.out_bias) {
              v0 += p.out_bias[c];
              v1 += p.out_bias[c + 1];
            }
            if (p.af3) {
              const unsigned gg = gate_in_smem ? *(const unsigned*)(sg + r * OP_LD + c)
                                               : *(const unsigned*)(p.gate + (row - p.buf_row0) * (tm_i64)G + c);
              v0 *= tm_lo(gg);
              v1 *= tm_hi(gg);
            }
            *(float2*)(p.y + row * C + c) = make_float2(v0, v1);
          }
        }
    }
    // Every warp done with sa (rewritten by the next tile's step 1) and with this sg (the copy
    // target of the tile after next).
    __syncthreads();
  }
  asm volatile("cp.async.wait_group 0;");
}
