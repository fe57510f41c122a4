// Stage 1, fused: input LayerNorm + all input projections + gating epilogue in one pass over x.
//
// A block owns BM = 128 consecutive positions. It reads their rows of x once (f32, bf16 or f16
// as io_dtype says), computes
// z = LN_C(x) with two-pass f32 statistics held in registers, and keeps z resident in shared
// memory as f16 (the GEMM's A operand). It then walks the fused weight matrix in column chunks
// of BN = 128, streaming each chunk's weights through a two-stage cp.async ring in K slices of
// BK = 64, multiplying with f16 tensor-core MMAs (f32 accumulate), and finishing each chunk in
// registers:
//   gating chunks (32 hidden channels each): the prepare step ordered the weight rows per block
//     of 8 channels as [lp(8) | lg(8) | rp(8) | rg(8)], so every thread already holds lp, lg, rp
//     and rg of the same channels and positions:
//       left = (lp+b)·mask·σ(lg+b)   right = (rp+b)·mask·σ(rg+b)
//     staged through shared memory and stored as 16-byte runs along positions, straight into
//     the contraction layout [B, H, N, N];
//   gate chunks: σ(og+b), staged and stored as 16-byte runs into gate [M, G].
// Two builds of the MMA: mma.sync m16n8k16 (sm_80+: 8 warps of 32 x 64, operands through
// ldmatrix), and on sm_90a the warpgroup MMA (2 warpgroups of 64 x 128, wgmma.m64n128k16 with both
// operands read by the tensor cores from 128-byte-swizzled shared memory). Everything else is
// shared: the LayerNorm prologue, the epilogues and the stores. At C = H = 128 on sm_90a a third
// form, warp-specialised and persistent (input_projection_sm90_ws, below), keeps all weights
// resident and splits each SM's 32 warps into LayerNorm producers and MMA/epilogue consumers.
// Chunked plans (src/memory.rs) launch it on a subset: a hidden pass runs the gating chunks of
// its channels over every position, writing [B, lr_h, N, N] chunk buffers; the output stage's
// gate pass runs the gate chunks over one row chunk (row0, rows) into a gate buffer that starts
// at position buf_row0.
// The projection never touches device memory: x is read once and only left, right and the gate
// are written, which is the byte floor of this stage.
//
// Shapes this kernel takes (the host checks; others use the cuBLASLt path): C % 4 == 0 and
// k_pad = round_up(C, 64) <= 512 (z must fit in shared memory next to the weight ring).
#include "common/compat.h"
#include "common/params.h"
#include "cuda/io.h"
#include "cuda/mma.h"

#define IP_THREADS 256
#define IP_BM 128
#define IP_BN 128
#define IP_BK 64
#define IP_MAX_K 512
// Rows of x a warp loads before reducing (all their loads in flight at once): the wgmma builds
// for C <= 128 and for wider C at one block per SM, and the mma.sync builds (whose fragments
// leave fewer registers: 8 rows spill there).
#define IP_LN_ROWS_NARROW 8
#define IP_LN_ROWS_WIDE 8
#define IP_LN_ROWS_MMA 4
// Row pitch of the weight ring in halves: 16 bytes of padding keep ldmatrix conflict-free.
#define IP_LDB (IP_BK + 8)
static_assert(IP_THREADS == TM_STAGE_THREADS && IP_BM == TM_IP_ROWS && IP_MAX_K == TM_IP_MAX_K, "common/smem.h");
// The shared memory the bodies below carve (z tile, weight ring, epilogue staging, mask), which
// the host passes as TM_IP_SMEM(k_pad) and TM_IP_SM90_SMEM(BM, k_pad): affine in k_pad, so the
// two ends of its range check it for all.
constexpr int ip_smem_used(int k_pad) {
  return (IP_BM * (k_pad + 8) + 2 * IP_BN * IP_LDB + IP_BM * (IP_BN + 8)) * 2 + IP_BM * 4;
}
constexpr int ip_sm90_smem_used(int bm, int k_pad) {
  return (bm * k_pad + 2 * IP_BN * IP_BK + bm * (IP_BN + 8)) * 2 + bm * 4 + 1024;
}
static_assert(ip_smem_used(64) == TM_IP_SMEM(64) && ip_smem_used(IP_MAX_K) == TM_IP_SMEM(IP_MAX_K), "common/smem.h");
static_assert(ip_sm90_smem_used(64, 64) == TM_IP_SM90_SMEM(64, 64) &&
                  ip_sm90_smem_used(IP_BM, IP_MAX_K) == TM_IP_SM90_SMEM(IP_BM, IP_MAX_K),
              "common/smem.h");

// The prepare step stores HALF of every fused weight and bias (exact: a power of two), so the
// MMA yields x/2 for each projection and gate x, which is what the tanh form of the sigmoid
// takes: σ(x) = 0.5·tanh(x/2) + 0.5, and a gated projection p·σ(g) = (p/2)·(tanh(g/2) + 1) — a
// tanh and one packed FMA per two values, with no scaling instructions (ncu, H100: the
// epilogues were the largest block of this kernel's instructions). tanh.approx.f16x2's absolute
// error (≈ 2.5e-4 after the halving, the f16 resolution of tanh near ±1) is below the f16
// rounding the results are stored with.

// p·m·σ(g) of two channels from the halves of p and g, packed f16: (p/2·m)·tanh(g/2) + p/2·m.
__device__ __forceinline__ unsigned ip_gated2(float ph_lo, float ph_hi, float gh_lo, float gh_hi, float m) {
  const unsigned pm = mma_pack_h2(ph_lo * m, ph_hi * m), g = mma_pack_h2(gh_lo, gh_hi);
  unsigned t, r;
  asm("tanh.approx.f16x2 %0, %1;" : "=r"(t) : "r"(g));
  asm("fma.rn.f16x2 %0, %1, %2, %1;" : "=r"(r) : "r"(pm), "r"(t));
  return r;
}

// Where this thread's weight pieces come from and go to: a slice is 128 rows x 64 halves = 1024
// pieces of 16 bytes, 4 per thread, piece i at row tid/8 + 32·i and 16-byte column tid % 8. SW128
// selects the layout the wgmma kernel reads (rows of 128 bytes, 16-byte pieces XOR-permuted by
// row % 8, which is the same for all four pieces); otherwise rows are IP_LDB halves apart, the
// padding keeping ldmatrix conflict-free. Computed once per block: per slice only the chunk's and
// slice's offsets are added (ncu, H100: the per-piece 64-bit index math was a fifth of the main
// loop's instructions).
struct IpBLoader {
  const tm_half* src;     // this thread's first piece in chunk 0, slice 0
  tm_i64 src_step;        // halves between its pieces (32 rows)
  unsigned dst;           // its first piece in ring stage 0
};

template <bool SW128>
__device__ __forceinline__ IpBLoader ip_b_loader(const TmInputParams& p, const tm_half* ring) {
  const int row = threadIdx.x >> 3, c16 = threadIdx.x & 7;
  IpBLoader b;
  b.src = p.w_in + (tm_i64)row * p.k_pad + c16 * 8;
  b.src_step = (tm_i64)32 * p.k_pad;
  b.dst = mma_smem_addr(ring) + (SW128 ? row * 128 + ((c16 ^ (row & 7)) << 4) : (row * IP_LDB + c16 * 8) * 2);
  return b;
}

// Issue the cp.async loads of K slice `ks` of column chunk `chunk` into ring stage `stage`.
template <bool SW128>
__device__ __forceinline__ void ip_load_b(const TmInputParams& p, const IpBLoader& b, int stage, int chunk, int ks) {
  const tm_half* src = b.src + (tm_i64)chunk * IP_BN * p.k_pad + ks * IP_BK;
  const unsigned dst = b.dst + stage * IP_BN * (SW128 ? IP_BK : IP_LDB) * 2;
#pragma unroll
  for (int i = 0; i < 4; ++i) mma_cp_async16(dst + i * 32 * (SW128 ? 128 : IP_LDB * 2), src + i * b.src_step);
  asm volatile("cp.async.commit_group;");
}

// Byte offset of z[r][c] (c % 4 == 0, an 8-byte group) in the block's A tile. SW128: the wgmma
// layout, 64-channel atoms of [BM][128 bytes] one after another, pieces permuted as in ip_b_loader;
// otherwise row-major with a pitch of `lda` halves.
template <bool SW128, int BM>
__device__ __forceinline__ unsigned ip_z_offset(int r, int c, int lda) {
  if (SW128) return wgmma_sw128_offset<BM>(r, c);
  return (r * lda + c) * 2;
}

// Sums each of R values over the warp, the R butterflies interleaved so their shuffle latencies
// overlap.
template <int R>
__device__ __forceinline__ void ip_warp_sums(float (&v)[R]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int rr = 0; rr < R; ++rr) v[rr] += __shfl_xor_sync(0xffffffffu, v[rr], o);
}

// Prologue: z = LN_C(x) for the block's rows, into shared memory as f16 (zeros past C and past
// the last position), and each row's mask into smask. Each warp takes IP_LN_ROWS_* rows at a time:
// all their loads are issued before the first use, and the rows' butterfly reductions are
// interleaved, so a warp waits for DRAM once per batch and the shuffle latencies overlap. (ncu on
// the H100: with 4 rows per batch and one reduction after another, the first use of x was the
// kernel's most-stalled instruction and the LayerNorm about 40% of its stall samples.) A lane's
// channels are the same in every row, so its LN weights are loaded once.
// FULL: C == KMAX and every row of the tile is a position, so no channel or row is checked.
template <int KMAX, bool SW128, int BM, int LN_ROWS, int IO, bool FULL>
__device__ __forceinline__ void ip_layernorm_io(const TmInputParams& p, unsigned char* sa, int lda, float* smask,
                                                tm_i64 tile0, tm_i64 m_total) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int C = FULL ? KMAX : p.c;
  const float inv_c = 1.f / (float)C;
  constexpr int ln_rows = LN_ROWS;
  float4 w[KMAX / 128], b[KMAX / 128];
#pragma unroll
  for (int i = 0; i < KMAX / 128; ++i) {
    const int c = (lane + 32 * i) * 4;
    w[i] = c < C ? *(const float4*)(p.norm_in_w + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    b[i] = c < C ? *(const float4*)(p.norm_in_b + c) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const unsigned long long stream = l2_evict_first();  // x is read once
  constexpr bool hint = KMAX > 128;
  for (int r0 = warp * ln_rows; r0 < BM; r0 += (IP_THREADS / 32) * ln_rows) {
    float4 v[ln_rows][KMAX / 128];
    uint2 raw[IO == TM_IO_F32 ? 1 : ln_rows][KMAX / 128];  // 16-bit x as loaded
#pragma unroll
    for (int rr = 0; rr < ln_rows; ++rr) {
      const tm_i64 row = tile0 + r0 + rr;
#pragma unroll
      for (int i = 0; i < KMAX / 128; ++i) {
        const int c4 = lane + 32 * i;
        const bool in = FULL || (row < m_total && c4 * 4 < C);
        if (IO == TM_IO_F32) {
          const float* src = p.x + row * C + c4 * 4;
          v[rr][i] = !in ? make_float4(0.f, 0.f, 0.f, 0.f) : hint ? ld_stream_f4(src, stream) : *(const float4*)src;
        } else {
          const unsigned short* src = (const unsigned short*)p.x + row * C + c4 * 4;
          raw[rr][i] = !in ? make_uint2(0u, 0u) : hint ? ld_stream_u2(src, stream) : *(const uint2*)src;
        }
      }
    }
    if (IO != TM_IO_F32) {
#pragma unroll
      for (int rr = 0; rr < ln_rows; ++rr)
#pragma unroll
        for (int i = 0; i < KMAX / 128; ++i) v[rr][i] = io_widen4<IO>(raw[rr][i]);
    }
    float mean[ln_rows], rstd[ln_rows];
#pragma unroll
    for (int rr = 0; rr < ln_rows; ++rr) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < KMAX / 128; ++i) s += (v[rr][i].x + v[rr][i].y) + (v[rr][i].z + v[rr][i].w);
      mean[rr] = s;
    }
    ip_warp_sums(mean);
#pragma unroll
    for (int rr = 0; rr < ln_rows; ++rr) {
      mean[rr] *= inv_c;
      float q = 0.f;
#pragma unroll
      for (int i = 0; i < KMAX / 128; ++i) {
        if (FULL || (lane + 32 * i) * 4 < C) {
          const float a = v[rr][i].x - mean[rr], bb = v[rr][i].y - mean[rr];
          const float c = v[rr][i].z - mean[rr], d = v[rr][i].w - mean[rr];
          q += (a * a + bb * bb) + (c * c + d * d);
        }
      }
      rstd[rr] = q;
    }
    ip_warp_sums(rstd);
#pragma unroll
    for (int rr = 0; rr < ln_rows; ++rr) {
      const int r = r0 + rr;
      const tm_i64 row = tile0 + r;
      const float m = mean[rr], rs = tm_rsqrt(rstd[rr] * inv_c + p.eps);
      const bool live = FULL || row < m_total;  // rows past the end become zeros (and mask 0)
#pragma unroll
      for (int i = 0; i < KMAX / 128; ++i) {
        const int c = (lane + 32 * i) * 4;
        if (FULL || c < p.k_pad) {
          unsigned lo = 0, hi = 0;
          if (FULL || (live && c < C)) {
            lo = mma_pack_h2((v[rr][i].x - m) * rs * w[i].x + b[i].x, (v[rr][i].y - m) * rs * w[i].y + b[i].y);
            hi = mma_pack_h2((v[rr][i].z - m) * rs * w[i].z + b[i].z, (v[rr][i].w - m) * rs * w[i].w + b[i].w);
          }
          *(uint2*)(sa + ip_z_offset<SW128, BM>(r, c, lda)) = make_uint2(lo, hi);
        }
      }
      if (lane == 0) smask[r] = live ? (p.mask ? p.mask[row] : 1.f) : 0.f;
    }
  }
}

// The prologue for the launch's I/O precision (one uniform branch per block).
template <int KMAX, bool SW128, int BM, int LN_ROWS, bool FULL>
__device__ __forceinline__ void ip_layernorm_full(const TmInputParams& p, unsigned char* sa, int lda, float* smask,
                                                  tm_i64 tile0, tm_i64 m_total) {
  if (p.io_dtype == TM_IO_BF16) {
    ip_layernorm_io<KMAX, SW128, BM, LN_ROWS, TM_IO_BF16, FULL>(p, sa, lda, smask, tile0, m_total);
  } else if (p.io_dtype == TM_IO_F16) {
    ip_layernorm_io<KMAX, SW128, BM, LN_ROWS, TM_IO_F16, FULL>(p, sa, lda, smask, tile0, m_total);
  } else {
    ip_layernorm_io<KMAX, SW128, BM, LN_ROWS, TM_IO_F32, FULL>(p, sa, lda, smask, tile0, m_total);
  }
}

// The prologue for the launch's I/O precision and, in the wgmma builds where C is the build's
// width (C = 128 in the narrow build) and the tile is all positions, without its bounds checks
// (ncu, H100: they were a tenth of the LayerNorm's instructions, as compares and divergence
// bookkeeping). The mma.sync build keeps the checked form: the unchecked one spills there.
template <int KMAX, bool SW128, int BM, int LN_ROWS>
__device__ __forceinline__ void ip_layernorm(const TmInputParams& p, unsigned char* sa, int lda, float* smask,
                                             tm_i64 tile0, tm_i64 m_total) {
  if (SW128 && p.c == KMAX && p.k_pad == KMAX && tile0 + BM <= m_total) {
    ip_layernorm_full<KMAX, SW128, BM, LN_ROWS, true>(p, sa, lda, smask, tile0, m_total);
  } else {
    ip_layernorm_full<KMAX, SW128, BM, LN_ROWS, false>(p, sa, lda, smask, tile0, m_total);
  }
}

// Gating epilogue of one position r and one pair of channels (ch, ch + 1) of a gating chunk:
// v holds lp, lg, rp, rg (bias added) of both channels. Stages left and right as f16, laid out
// [channel][position] for the stores along positions.
template <int BM>
__device__ __forceinline__ void ip_stage_gating(tm_half* sl, tm_half* sr, int r, int ch, const float (&v)[4][2],
                                                float m) {
  const unsigned left = ip_gated2(v[0][0], v[0][1], v[1][0], v[1][1], m);
  const unsigned right = ip_gated2(v[2][0], v[2][1], v[3][0], v[3][1], m);
  sl[ch * (BM + 8) + r] = (tm_half)(left & 0xFFFFu);
  sl[(ch + 1) * (BM + 8) + r] = (tm_half)(left >> 16);
  sr[ch * (BM + 8) + r] = (tm_half)(right & 0xFFFFu);
  sr[(ch + 1) * (BM + 8) + r] = (tm_half)(right >> 16);
}

// Stores a gating chunk's staged left and right (32 channels x BM positions each) as 16-byte runs
// along positions into [B, lr_h, N, N]: 2 x 32 channels x BM/8 runs of 8 positions. A thread
// keeps one run and takes every (256 / runs)-th channel. Channels outside the launch's window
// lr_h0 .. lr_h0 + lr_h are skipped. When the tile lies inside one batch (N² a multiple of 8 and
// of the tile: every shape but N² < 128) a store is one 64-bit multiply-add from the tile's base;
// the general path steps across batch boundaries per run (ncu, H100: the general index math was a
// seventh of this kernel's stall samples).
template <int BM>
__device__ __forceinline__ void ip_store_gating(const TmInputParams& p, const tm_half* sl, const tm_half* sr, int chunk,
                                                tm_i64 tile0, tm_i64 m_total, tm_i64 tb0, tm_i64 trem0, tm_i64 nn,
                                                tm_i64 ms, int lr_h0, int lr_h) {
  const unsigned tid = threadIdx.x;
  constexpr int runs = BM / 8;
  constexpr int ch_step = IP_THREADS / runs;  // channels a pass over the threads covers
  const int run = tid % runs, ch0 = tid / runs;
  if ((nn % 8 == 0) && (tile0 + BM <= m_total) && (trem0 + BM <= nn)) {
    const tm_i64 base = tb0 * lr_h * ms + trem0 + run * 8;
#pragma unroll
    for (int i = 0; i < 32 / ch_step; ++i) {
      const int ch = ch0 + i * ch_step, h = chunk * 32 + ch;
      if (h >= p.h || h < lr_h0 || h >= lr_h0 + lr_h) continue;
      const tm_i64 off = base + (tm_i64)(h - lr_h0) * ms;
      *(uint4*)(p.left + off) = *(const uint4*)(sl + ch * (BM + 8) + run * 8);
      *(uint4*)(p.right + off) = *(const uint4*)(sr + ch * (BM + 8) + run * 8);
    }
    return;
  }
  const bool vec = (nn % 8 == 0) && (tile0 + BM <= m_total);
  for (int side = 0; side < 2; ++side) {
    for (int ch = ch0; ch < 32; ch += ch_step) {
      const int h = chunk * 32 + ch;
      if (h >= p.h || h < lr_h0 || h >= lr_h0 + lr_h) continue;
      const tm_half* src = (side ? sr : sl) + ch * (BM + 8) + run * 8;
      tm_half* out = side ? p.right : p.left;
      const tm_i64 row = tile0 + run * 8;
      if (vec) {
        // The run starts run·8 positions into the tile: step across batch boundaries from the
        // tile's first row (a tile spans one boundary unless N² < 128).
        tm_i64 b = tb0, rem = trem0 + run * 8;
        while (rem >= nn) {
          rem -= nn;
          ++b;
        }
        *(uint4*)(out + (b * lr_h + (h - lr_h0)) * ms + rem) = *(const uint4*)src;
      } else {
        for (int e = 0; e < 8; ++e) {
          const tm_i64 rr = row + e;
          if (rr >= m_total) break;
          const tm_i64 b = rr / nn, rem = rr - b * nn;
          out[(b * lr_h + (h - lr_h0)) * ms + rem] = src[e];
        }
      }
    }
  }
}

// Stores a gate chunk's staged σ(og) (BM positions x 128 columns from gc0) as 16-byte runs into
// gate [rows from buf_row0, G]: BM rows x 16 runs of 8 columns, BM/16 per thread.
template <int BM, bool HINT>
__device__ __forceinline__ void ip_store_gate(const TmInputParams& p, const tm_half* stage_buf, int gc0, tm_i64 tile0,
                                              tm_i64 m_total) {
  const unsigned tid = threadIdx.x;
  const int G = p.g;
  const bool vec = (G % 8 == 0);
  const unsigned long long stream = l2_evict_first();  // read back only by the output stage
#pragma unroll
  for (int i = 0; i < BM * 16 / IP_THREADS; ++i) {
    const int piece = tid + i * IP_THREADS;
    const int r = piece >> 4, run = piece & 15;
    const tm_i64 row = tile0 + r;
    const int col = gc0 + run * 8;
    if (row >= m_total || col >= G) continue;
    const tm_half* src = stage_buf + r * (IP_BN + 8) + run * 8;
    if (vec) {
      tm_half* dst = p.gate + (row - p.buf_row0) * G + col;
      if (HINT) {
        st_stream_u4(dst, *(const uint4*)src, stream);
      } else {
        *(uint4*)dst = *(const uint4*)src;
      }
    } else {
      for (int e = 0; e < 8 && col + e < G; ++e) p.gate[(row - p.buf_row0) * G + col + e] = src[e];
    }
  }
}

// What a launch covers, shared by both bodies.
struct IpLaunch {
  tm_i64 m_total, tile0, nn, tb0, trem0;
  tm_i64 ms;  // elements between left's (and right's) matrices: N², or mat_rows·N (common/params.h)
  int nks, n_gating, chunk0, n_chunks, lr_h0, lr_h;
};

// REVERSE: blocks take the tiles last to first (below).
template <int BM, bool REVERSE>
__device__ __forceinline__ IpLaunch ip_launch(const TmInputParams& p) {
  IpLaunch l;
  // Positions row0 .. m_total of this launch (a row chunk of the output stage's gate pass, or
  // every position); rows past m_total are zeros with mask 0 and are never stored.
  l.m_total = p.row0 + p.rows;
  // Tiles last to first: the positions written last (left/right of the first batch) are the
  // ones the contraction reads first, while the L2 may still hold them (H100, 256,2,128: −2%).
  l.tile0 = p.row0 + (tm_i64)(REVERSE ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM;
  l.nks = p.k_pad / IP_BK;
  l.n_gating = p.h_pad / 32;  // 32 channels (128 columns) per gating chunk
  // Column chunks of this launch: a hidden pass runs some gating chunks, the gate pass the gate
  // chunks, the one-pass plan all of them.
  l.chunk0 = p.chunk_begin;
  l.n_chunks = p.chunk_end > 0 ? p.chunk_end : l.n_gating + p.g_pad / IP_BN;
  l.lr_h0 = p.lr_h0;
  l.lr_h = p.lr_h > 0 ? p.lr_h : p.h;
  l.nn = (tm_i64)p.n * p.n;
  l.ms = (tm_i64)(p.mat_rows > 0 ? p.mat_rows : p.n) * p.n;
  // Batch and in-batch position of the tile's first row: the epilogue's stores step from here
  // instead of dividing by N² per store.
  l.tb0 = l.tile0 / l.nn;
  l.trem0 = l.tile0 - l.tb0 * l.nn;
  return l;
}

// (a0 + bias[i], a1 + bias[i + 1]) for an even i, the bias pair in one 8-byte load; without a
// bias (a0, a1) itself, specialised at compile time: adding a zero is not free, since x + 0 is
// not x for x = -0.
template <bool HAS_BIAS>
__device__ __forceinline__ float2 ip_add_bias2(const float* bias, int i, float a0, float a1) {
  if (!HAS_BIAS) return make_float2(a0, a1);
  const float2 b = *(const float2*)(bias + i);
  return make_float2(a0 + b.x, a1 + b.y);
}

// Stores a column chunk's staged results (after a barrier that follows the staging): left and
// right of a gating chunk, or the gate.
// HINT: the gate's stores marked first to evict in L2 (see the builds' entry points).
template <int BM, bool HINT>
__device__ __forceinline__ void ip_store_chunk(const TmInputParams& p, const IpLaunch& l, int chunk,
                                               const tm_half* stage_buf) {
  if (chunk < l.n_gating) {
    ip_store_gating<BM>(p, stage_buf, stage_buf + 32 * (BM + 8), chunk, l.tile0, l.m_total, l.tb0, l.trem0, l.nn,
                        l.ms, l.lr_h0, l.lr_h);
  } else {
    ip_store_gate<BM, HINT>(p, stage_buf, (chunk - l.n_gating) * IP_BN, l.tile0, l.m_total);
  }
}

// Epilogue of one column chunk, mma.sync build (staging only; ip_store_chunk stores): a warp
// holds 32 rows x 64 columns as acc[m16 tile][n8 tile][4].
template <bool HAS_BIAS>
__device__ __forceinline__ void ip_epilogue_mma(const float (&acc)[2][8][4], const TmInputParams& p, const IpLaunch& l,
                                                int chunk, tm_half* stage_buf, const float* smask, int warp_m,
                                                int warp_n) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const float* bias = p.w_in_bias + chunk * IP_BN;
  if (chunk < l.n_gating) {
    // The prepare step ordered each block of 8 channels as [lp | lg | rp | rg]: a warp's 64
    // columns are two such blocks. Staging: left [32][BM+8] then right [32][BM+8].
    tm_half* sl = stage_buf;
    tm_half* sr = stage_buf + 32 * (IP_BM + 8);
#pragma unroll
    for (int q = 0; q < 2; ++q) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {  // rows g and g + 8; channels 2·tig, 2·tig + 1 as a pair
          const int r = warp_m * 32 + mt * 16 + g + hf * 8;
          const int base = warp_n * 64 + q * 32;  // first column of this block of 8 channels
          float v[4][2];
#pragma unroll
          for (int sct = 0; sct < 4; ++sct) {  // lp, lg, rp, rg
            const float2 b = ip_add_bias2<HAS_BIAS>(bias, base + 8 * sct + 2 * tig, acc[mt][4 * q + sct][2 * hf],
                                                    acc[mt][4 * q + sct][2 * hf + 1]);
            v[sct][0] = b.x;
            v[sct][1] = b.y;
          }
          ip_stage_gating<IP_BM>(sl, sr, r, (warp_n * 2 + q) * 8 + 2 * tig, v, smask[r]);
        }
      }
    }
  } else {
    // gate columns [gc0, gc0 + 128): staging [BM][BN+8]
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {  // rows g and g + 8; two adjacent columns each
          const int r = warp_m * 32 + mt * 16 + g + hf * 8;
          const int col = warp_n * 64 + nt * 8 + 2 * tig;
          const float2 v = ip_add_bias2<HAS_BIAS>(bias, col, acc[mt][nt][2 * hf], acc[mt][nt][2 * hf + 1]);
          *(unsigned*)(stage_buf + r * (IP_BN + 8) + col) = mma_sigmoid2_halves(v.x, v.y);
        }
  }
}

// Left and right of one block of 8 channels [lp | lg | rp | rg] (the chunk's columns 32·q ..)
// from a warpgroup's wgmma accumulators (acc[4j + e] is n8 tile j; the block's first tile is
// 4·qa), for this thread's rows g and g + 8: lr[left, right][row g, row g + 8] as f16 pairs, the
// bias added, gated and masked.
template <bool HAS_BIAS, int NACC>
__device__ __forceinline__ void ip_gated_block(const float (&acc)[NACC], const float* bias, int q, int qa, int tig,
                                               float m0, float m1, unsigned (&lr)[2][2]) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float v[4][2];
#pragma unroll
    for (int sct = 0; sct < 4; ++sct) {
      const float2 b = ip_add_bias2<HAS_BIAS>(bias, q * 32 + 8 * sct + 2 * tig, acc[(4 * qa + sct) * 4 + 2 * hf],
                                              acc[(4 * qa + sct) * 4 + 2 * hf + 1]);
      v[sct][0] = b.x;
      v[sct][1] = b.y;
    }
    const float m = hf ? m1 : m0;
    lr[0][hf] = ip_gated2(v[0][0], v[0][1], v[1][0], v[1][1], m);
    lr[1][hf] = ip_gated2(v[2][0], v[2][1], v[3][0], v[3][1], m);
  }
}

// Epilogue of one column chunk, wgmma build (staging only; ip_store_chunk stores). BM = 128:
// warpgroup wg owns rows 64·wg .. and all 128 columns; BM = 64: both own the 64 rows and
// warpgroup wg the columns 64·wg ... A warp holds 16 rows x NW columns, acc[4j + e] being n8
// tile j.
// WG_STAGE (BM = 64, the warp-specialised build): each warpgroup stages into its own 8 KB at
// stage_buf (rows of 128 bytes whose 16-byte pieces are permuted by XOR with row % 8, so that
// stmatrix and the stores' reads stay conflict-free without padding): of a gating chunk its 16
// channels of left (rows 0-15) and right (rows 16-31) along the 64 positions, of the gate chunk
// its 64 columns for each position (row = position). ws_store_wg reads them back.
template <bool HAS_BIAS, int BM, bool WG_STAGE = false>
__device__ __forceinline__ void ip_epilogue_sm90(const float (&acc)[BM == 128 ? 64 : 32], const TmInputParams& p,
                                                 const IpLaunch& l, int chunk, tm_half* stage_buf, const float* smask,
                                                 int wg, int wq) {
  constexpr int NW = BM == 128 ? 128 : 64;  // columns per warpgroup
  const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  const int row0 = (BM == 128 ? wg * 64 : 0) + wq * 16 + g, col0 = BM == 128 ? 0 : wg * 64;
  const float* bias = p.w_in_bias + chunk * IP_BN;
  // The stores into the staging are stmatrix (four 8 x 8 tiles of 16-bit values per
  // instruction, the accumulator layout being stmatrix's fragment layout): lane L gives the
  // address of row L % 8 of tile L / 8. (ncu, H100: the 16-bit stores one value at a time and the
  // moves that split the pairs were a tenth of this kernel's instructions.)
  const int tile = lane >> 3, trow = lane & 7;
  const int wrow = (BM == 128 ? wg * 64 : 0) + wq * 16;  // the warp's first row
  if (chunk < l.n_gating) {
    tm_half* sl = stage_buf;
    tm_half* sr = stage_buf + 32 * (BM + 8);
    // Tiles 0, 1: left at rows wrow + 0..7, + 8..15; tiles 2, 3: right. Transposed: the row
    // this lane addresses is channel q·8 + trow, 8 positions along it.
    const unsigned st_base =
        WG_STAGE ? mma_smem_addr(stage_buf) + ((tile < 2 ? 0 : 16) + trow) * 128 +
                       (((wrow / 8 + (tile & 1)) ^ trow) << 4)
                 : mma_smem_addr(tile < 2 ? sl : sr) + (trow * (BM + 8) + wrow + (tile & 1) * 8) * 2;
    const float m0 = smask[row0], m1 = smask[row0 + 8];
#pragma unroll
    for (int qq = 0; qq < NW / 32; ++qq) {  // the warpgroup's blocks of 8 channels [lp | lg | rp | rg]
      const int q = col0 / 32 + qq;
      unsigned lr[2][2];
      ip_gated_block<HAS_BIAS>(acc, bias, q, qq, tig, m0, m1, lr);
      stmatrix_x4_trans(st_base + (WG_STAGE ? qq * 8 * 128 : q * 8 * (BM + 8) * 2), lr[0][0], lr[0][1], lr[1][0],
                        lr[1][1]);
    }
  } else {
    // Tiles: (n8 tile nt, rows + 0..7), (nt, + 8..15), (nt + 1, + 0..7), (nt + 1, + 8..15).
    const unsigned st_base =
        WG_STAGE ? mma_smem_addr(stage_buf) + (wrow + (tile & 1) * 8 + trow) * 128
                 : mma_smem_addr(stage_buf) +
                       ((wrow + (tile & 1) * 8 + trow) * (IP_BN + 8) + col0 + (tile >> 1) * 8) * 2;
#pragma unroll
    for (int nt = 0; nt < NW / 8; nt += 2) {
      unsigned sg[2][2];  // [n8 tile nt, nt + 1][row g, row g + 8]
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float2 v = ip_add_bias2<HAS_BIAS>(bias, col0 + (nt + j) * 8 + 2 * tig, acc[(nt + j) * 4 + 2 * hf],
                                                  acc[(nt + j) * 4 + 2 * hf + 1]);
          sg[j][hf] = mma_sigmoid2_halves(v.x, v.y);
        }
      stmatrix_x4(st_base + (WG_STAGE ? (((nt + (tile >> 1)) ^ trow) << 4) : nt * 8 * 2), sg[0][0], sg[0][1], sg[1][0],
                  sg[1][1]);
    }
  }
}

// The sm_80 body: 8 warps of 32 rows x 64 columns (4 x 2) with mma.sync.
template <int KMAX>
__device__ __forceinline__ void input_projection_body(const TmInputParams& p) {
  extern __shared__ __align__(16) unsigned char ip_smem[];
  const int lda = p.k_pad + 8;  // halves; +16 bytes keeps ldmatrix conflict-free
  tm_half* sa = (tm_half*)ip_smem;                                 // [BM][lda]   z tile
  tm_half* ring = sa + IP_BM * lda;                                // [2][BN][LDB] weight slices
  tm_half* stage_buf = ring + 2 * IP_BN * IP_LDB;                  // [BM][BN+8]  epilogue staging
  float* smask = (float*)(stage_buf + IP_BM * (IP_BN + 8));        // [BM]

  const unsigned warp = threadIdx.x >> 5;
  const IpLaunch l = ip_launch<IP_BM, true>(p);

  // Start streaming the first weight slice while the LayerNorm runs.
  ip_load_b<false>(p, ip_b_loader<false>(p, ring), 0, l.chunk0, 0);
  pdl_wait();  // x (and every buffer written below) only after the previous kernel is done
  ip_layernorm<KMAX, false, IP_BM, IP_LN_ROWS_MMA>(p, (unsigned char*)sa, lda, smask, l.tile0, l.m_total);
  __syncthreads();  // z complete before any warp reads it
  // Built again after the LayerNorm rather than held through it (held, it spills in this build).
  const IpBLoader bl = ip_b_loader<false>(p, ring);

  // ---- main loop over column chunks and K slices (one global slice counter for the ring).
  const int warp_m = warp >> 1, warp_n = warp & 1;  // 4 x 2 warps, each 32 rows x 64 columns
  // Shared-window addresses of the two operand tiles, computed once (not per ldmatrix).
  const unsigned sa_u = mma_smem_addr(sa), ring_u = mma_smem_addr(ring);
  int slice = 0;
  for (int chunk = l.chunk0; chunk < l.n_chunks; ++chunk) {
    float acc[2][8][4];
    mma_zero(acc);

    for (int ks = 0; ks < l.nks; ++ks, ++slice) {
      asm volatile("cp.async.wait_group 0;");
      __syncthreads();  // slice `slice` visible to all; everyone is done with the other stage
      {
        const int next_ks = ks + 1 < l.nks ? ks + 1 : 0;
        const int next_chunk = ks + 1 < l.nks ? chunk : chunk + 1;
        if (next_chunk < l.n_chunks) ip_load_b<false>(p, bl, (slice + 1) & 1, next_chunk, next_ks);
      }
      const unsigned sb_u = ring_u + (slice & 1) * IP_BN * IP_LDB * 2;
#pragma unroll 1
      for (int kk = 0; kk < IP_BK; kk += 16) {
        mma_warp_k16<8>(acc, sa_u, lda, warp_m * 32, ks * IP_BK + kk, sb_u, IP_LDB, warp_n * 64, kk);
      }
    }

    // ---- epilogue of this chunk, specialised on the bias (adding a zero is not free: x + 0
    // is not x for x = -0, so the compiler keeps every add and its load).
    if (p.w_in_bias) {
      ip_epilogue_mma<true>(acc, p, l, chunk, stage_buf, smask, warp_m, warp_n);
    } else {
      ip_epilogue_mma<false>(acc, p, l, chunk, stage_buf, smask, warp_m, warp_n);
    }
    __syncthreads();
    ip_store_chunk<IP_BM, (KMAX > 128)>(p, l, chunk, stage_buf);
    __syncthreads();  // staging is reused by the next chunk's epilogue
  }
}

// The sm_90a body: two warpgroups with wgmma, z and the weight ring in the 128-byte swizzle the
// descriptors name. BM = 128: each warpgroup multiplies its 64 rows by all 128 columns of a chunk
// (m64n128k16); BM = 64: both take the block's 64 rows and each warpgroup 64 of the columns
// (m64n64k16), which halves z so that two blocks fit on an SM at C up to 448 (three at C <= 128). The
// shared-memory traffic of the MMA (ldmatrix of every A and B fragment, once per warp) becomes
// the tensor cores' own reads, and a warpgroup issues one instruction per k16 step where the
// mma.sync body issues 22 per warp. Same LayerNorm, epilogues and stores as the sm_80 body.
template <int KMAX, int BM, int LN_ROWS>
__device__ __forceinline__ void input_projection_sm90_body(const TmInputParams& p) {
#if defined(TM_HAS_WGMMA)
  extern __shared__ __align__(16) unsigned char ip_smem[];
  // The swizzle atoms must sit on 1024-byte boundaries; the host adds 1024 bytes of slack.
  unsigned char* base = ip_smem + ((1024u - (mma_smem_addr(ip_smem) & 1023u)) & 1023u);
  unsigned char* sa = base;                                         // k_pad/64 atoms of [BM][128 B]
  tm_half* ring = (tm_half*)(sa + BM * p.k_pad * 2);                // [2][BN][128 B]
  tm_half* stage_buf = ring + 2 * IP_BN * IP_BK;                    // [BM][BN+8] epilogue staging
  float* smask = (float*)(stage_buf + BM * (IP_BN + 8));            // [BM]

  const unsigned warp = threadIdx.x >> 5;
  // Not in the 128-position C = 128 build (16-bit x): there the reversed index cost a register
  // spill and ≈ 1% (af3 bf16, H100).
  const IpLaunch l = ip_launch<BM, !(BM == 128 && KMAX == 128)>(p);
  // The builds for wider C mark x's loads and the gate's stores first to evict in L2.
  constexpr bool IP_HINT = KMAX > 128;

  const IpBLoader bl = ip_b_loader<true>(p, ring);
  // Padded C <= 128: a chunk's K slices (one or two) fill the ring, so each chunk's weights are
  // loaded whole, under the previous chunk's epilogue and stores (below).
  constexpr bool whole_chunks = KMAX == 128;
  for (int ks = 0; ks < (whole_chunks ? l.nks : 1); ++ks) ip_load_b<true>(p, bl, ks, l.chunk0, ks);
  pdl_wait();  // x (and every buffer written below) only after the previous kernel is done
  ip_layernorm<KMAX, true, BM, LN_ROWS>(p, sa, 0, smask, l.tile0, l.m_total);
  fence_proxy_async();  // z was written by ordinary stores; the tensor cores read it next
  __syncthreads();

  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it (16 rows)
  // This warpgroup's A rows and B rows (output columns) within the tiles.
  // Their descriptors, built once: a descriptor's address field is the byte address / 16, so
  // stepping to another k16 step, K slice or ring stage adds that offset / 16.
  const unsigned long long a_desc = wgmma_desc_sw128(mma_smem_addr(sa) + (BM == 128 ? wg * 64 * 128 : 0));
  const unsigned long long b_desc = wgmma_desc_sw128(mma_smem_addr(ring) + (BM == 128 ? 0 : wg * 64 * 128));
  int slice = 0;
  // A chunk's first k16 step overwrites the accumulators (scale-d 0), so they are not zeroed per
  // chunk: 32 register moves per thread and chunk fewer.
  float acc[BM == 128 ? 64 : 32];
#pragma unroll
  for (int i = 0; i < (BM == 128 ? 64 : 32); ++i) acc[i] = 0.f;
  // In the 64-position build for wider C a chunk's results leave shared memory while the next
  // chunk's first MMAs run (C = 384: input stage −3%, H100). In the C = 128 builds the stores'
  // registers spill next to the accumulators (128 positions, 128 registers: 88 bytes, and the
  // stage lost 20%; 64 positions, 80 registers: 64 bytes); the wide build (C > 448) is
  // unmeasured. Those store right after the staging.
  constexpr bool overlap_stores = BM == 64 && KMAX > 128;
  // The chunk whose staged results still wait for their stores.
  int pending = -1;
  if constexpr (whole_chunks) {
    // Per chunk: its weights have landed (issued a chunk ahead) → all its MMAs at once → once
    // every warpgroup is done with the ring, the next chunk's weights are issued, then the
    // epilogue and the stores run while they arrive. Three barriers per chunk, and one MMA wait.
    for (int chunk = l.chunk0; chunk < l.n_chunks; ++chunk) {
      asm volatile("cp.async.wait_group 0;");
      fence_proxy_async();  // this thread's cp.async writes, visible to the tensor cores
      __syncthreads();      // the chunk's weights complete; the previous chunk's stores done reading the staging
      wgmma_fence();
      // C = 128 (two K slices), unrolled: in the runtime loop ptxas inserted a warpgroup.arrive
      // before each slice's wgmmas (its C7519 note), the accumulators being live across the back edge.
      if (l.nks == 2) {
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)
          wgmma_slice<BM>(acc, a_desc + ((ks * BM * 128) >> 4), b_desc + ((ks * IP_BN * 128) >> 4), ks);
      } else {
        wgmma_slice<BM>(acc, a_desc, b_desc, 0);
      }
      wgmma_commit();
      wgmma_wait_all();
      __syncthreads();  // every warpgroup done reading the ring
      if (chunk + 1 < l.n_chunks)
        for (int ks = 0; ks < l.nks; ++ks) ip_load_b<true>(p, bl, ks, chunk + 1, ks);
      if (p.w_in_bias) {
        ip_epilogue_sm90<true, BM>(acc, p, l, chunk, stage_buf, smask, wg, wq);
      } else {
        ip_epilogue_sm90<false, BM>(acc, p, l, chunk, stage_buf, smask, wg, wq);
      }
      __syncthreads();
      ip_store_chunk<BM, IP_HINT>(p, l, chunk, stage_buf);
    }
  } else {
    for (int chunk = l.chunk0; chunk < l.n_chunks; ++chunk) {
      for (int ks = 0; ks < l.nks; ++ks, ++slice) {
        wgmma_wait_all();  // the previous slice's MMAs are done reading the other stage
        asm volatile("cp.async.wait_group 0;");
        fence_proxy_async();  // this thread's cp.async writes, visible to the tensor cores
        __syncthreads();
        {
          const int next_ks = ks + 1 < l.nks ? ks + 1 : 0;
          const int next_chunk = ks + 1 < l.nks ? chunk : chunk + 1;
          if (next_chunk < l.n_chunks) ip_load_b<true>(p, bl, (slice + 1) & 1, next_chunk, next_ks);
        }
        const unsigned long long sb = b_desc + (((slice & 1) * IP_BN * 128) >> 4);
        const unsigned long long sa_k = a_desc + ((ks * BM * 128) >> 4);
        wgmma_fence();
        wgmma_slice<BM>(acc, sa_k, sb, ks);
        wgmma_commit();
        if (overlap_stores && ks == 0 && pending >= 0) {
          // The previous chunk's staging, complete since this slice's barrier, stored under the
          // MMAs just issued (they read only z and the ring).
          ip_store_chunk<BM, IP_HINT>(p, l, pending, stage_buf);
          pending = -1;
        }
      }
      wgmma_wait_all();
      // Every store above done reading the staging (with two or more K slices, slice 1's barrier).
      if (overlap_stores && l.nks == 1) __syncthreads();

      if (p.w_in_bias) {
        ip_epilogue_sm90<true, BM>(acc, p, l, chunk, stage_buf, smask, wg, wq);
      } else {
        ip_epilogue_sm90<false, BM>(acc, p, l, chunk, stage_buf, smask, wg, wq);
      }
      if (overlap_stores) {
        pending = chunk;
      } else {
        __syncthreads();
        ip_store_chunk<BM, IP_HINT>(p, l, chunk, stage_buf);
        __syncthreads();  // staging is reused by the next chunk's epilogue
      }
    }
    if (pending >= 0) {
      __syncthreads();  // the last chunk's staging complete
      ip_store_chunk<BM, IP_HINT>(p, l, pending, stage_buf);
    }
  }
#else
  // Built for another target: the host launches this entry only on sm_90 from sm_90a code.
  __trap();
#endif
}

// ---- Warp-specialised persistent build (sm_90a; C = H = 128, one-pass plans) ----
// One block of 1024 threads per SM walks 64-position tiles with all 160 KB of weights resident in
// shared memory, loaded once per block (under the previous kernel's tail, with PDL):
//   - warps 0-15, the LayerNorm producers: each loads its 4 rows of the next tile into registers
//     as soon as it has handed over the current one, so x's DRAM latency passes while the
//     consumers work; once a z buffer is free it normalises those rows into it, a row over 8
//     lanes (WsRows). (With 8 warps of 8 rows, a row over 32 lanes, the consumers waited for z a
//     quarter to a third of the time on the statistics' chains of 5 dependent shuffles; 16 warps
//     and 3 shuffles per statistic leave the producers waiting for the consumers instead.)
//   - warps 16-23 and 24-31, two consumer pairs (two warpgroups each, the 64-position build's
//     m64n64 split of the columns): pair P takes every other tile, through z buffer P and its own
//     staging, running the five column chunks' MMAs, epilogues and stores.
// The ablation of the two-and-three-blocks-per-SM builds (docs/perf/NOTES.md) found their phases
// adding up: the weight loads, x's latency, the MMAs and the stores one after another. Here the
// weights are loaded once, x arrives a tile ahead, and one pair's MMAs overlap the other pair's
// epilogue and stores, with 32 warps where the three-blocks build has 24.
// The hand-overs are named barriers: FULL[P] (the producers arrive once z of pair P's tile is
// written; the pair waits), EMPTY[P] (the pair arrives once its last chunk's MMAs have read z;
// the producers wait before writing z again), and one per consumer warpgroup around its part of
// the staging.
#define WS_THREADS 1024
#define WS_PRODUCERS 16   // LayerNorm producer warps, WS_LN_ROWS rows of a tile each
#define WS_LN_ROWS 4
#define WS_HAND 768       // threads at a FULL or EMPTY hand-over: the producers and one pair
#define WS_BM 64
#define WS_CHUNKS 5
#define WS_SLICE_BYTES (IP_BN * IP_BK * 2)                   // one K slice of one chunk: 16 KB
#define WS_W_BYTES (WS_CHUNKS * 2 * WS_SLICE_BYTES)          // 160 KB
#define WS_Z_BYTES (WS_BM * 128 * 2)                         // 16 KB
#define WS_STAGE_BYTES (2 * 8192)                            // a pair's staging: 8 KB per warpgroup
#define WS_SMEM_BYTES (WS_W_BYTES + 2 * WS_Z_BYTES + 2 * WS_STAGE_BYTES + 2 * WS_BM * 4 + 2 * 128 * 4 + 1024)
static_assert(WS_SMEM_BYTES == TM_WS_SMEM && WS_BM == TM_WS_ROWS && WS_THREADS == TM_WS_THREADS, "common/smem.h");

__device__ __forceinline__ void ws_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void ws_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// Named barrier ids (0 is __syncthreads).
__device__ __forceinline__ int ws_full(int pair) { return 1 + pair; }
__device__ __forceinline__ int ws_empty(int pair) { return 3 + pair; }
__device__ __forceinline__ int ws_group(int pair, int wg) { return 5 + 2 * pair + wg; }

// The k-th tile this block takes (tiles last to first, as the other builds: what is written last
// is read first by the contraction), and its launch description.
__device__ __forceinline__ tm_i64 ws_tile0(const TmInputParams& p, int k) {
  const tm_i64 tiles = p.rows / WS_BM;
  return p.row0 + (tiles - 1 - ((tm_i64)blockIdx.x + (tm_i64)k * gridDim.x)) * WS_BM;
}
__device__ __forceinline__ IpLaunch ws_launch(const TmInputParams& p, tm_i64 tile0) {
  IpLaunch l;
  l.m_total = p.row0 + p.rows;
  l.tile0 = tile0;
  l.nks = 2;
  l.n_gating = 4;
  l.chunk0 = 0;
  l.n_chunks = p.chunk_end > 0 ? p.chunk_end : WS_CHUNKS;  // 4: no gate (the output stage makes it from x)
  l.lr_h0 = 0;
  l.lr_h = p.h;
  l.nn = (tm_i64)p.n * p.n;
  l.ms = (tm_i64)(p.mat_rows > 0 ? p.mat_rows : p.n) * p.n;
  l.tb0 = tile0 / l.nn;
  l.trem0 = tile0 - l.tb0 * l.nn;
  return l;
}

// A producer warp's WS_LN_ROWS rows of x as loaded (f32, or the raw words of 16-bit x), and lane
// r < WS_LN_ROWS's mask value of row r. A row is spread over 8 lanes (lane = 8·r + j): lane j
// holds the 4-channel groups 32·g + 4·j, g = 0..3, f[i] / h[i] being g = i ^ (r & 1). Each load
// instruction reads 128 contiguous bytes (16-bit x: 64) of each of the 4 rows, and the row's
// statistics need 3 shuffle steps instead of 5 (the 32-lanes-per-row layout of the other builds
// ran 4 rows' chains of 5 per statistic). The rotation by r & 1 puts rows r and r + 1 in different
// halves of the z tile's 128-byte rows, so a warp's z stores take two wavefronts, not four.
static_assert(WS_LN_ROWS * 8 == 32, "a producer warp holds WS_LN_ROWS rows of 8 lanes each");
template <int IO>
struct WsRows {
  float4 f[IO == TM_IO_F32 ? 4 : 1];
  uint2 h[IO == TM_IO_F32 ? 1 : 4];
  float mask;
};

__device__ __forceinline__ int ws_group_channel(int i) {
  const unsigned lane = threadIdx.x & 31;
  return 32 * (i ^ (int)((lane >> 3) & 1)) + 4 * (int)(lane & 7);
}

template <int IO>
__device__ __forceinline__ void ws_load(const TmInputParams& p, tm_i64 row0, WsRows<IO>& x) {
  const unsigned lane = threadIdx.x & 31;
  const tm_i64 row = row0 + (lane >> 3);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (IO == TM_IO_F32) {
      x.f[i] = *(const float4*)(p.x + row * 128 + ws_group_channel(i));
    } else {
      x.h[i] = *(const uint2*)((const unsigned short*)p.x + row * 128 + ws_group_channel(i));
    }
  }
  x.mask = (p.mask && lane < WS_LN_ROWS) ? p.mask[row0 + lane] : 1.f;
}

// LN_C of the warp's WS_LN_ROWS rows (from r0 of the tile) into z (the 128-byte swizzle of the
// 64-position build) and their mask into smask; ln_wb holds LN_C's weight and bias (2 × 128 f32).
// Bit for bit the result of ip_layernorm_io's full-tile path (tests/cuda.rs): there lane L = 8·g + j
// holds group g and a statistic is summed by butterflies over L ^ 16, ^ 8, ^ 4, ^ 2, ^ 1. The
// first two combine g with g ^ 2, then with g ^ 1, which here are sums within the lane, in the
// same pairs ((s0 + s2) + (s1 + s3), each pair in either order: a float sum is commutative); the
// last three are this layout's shuffles over j.
template <int IO>
__device__ __forceinline__ void ws_normalize(const TmInputParams& p, const WsRows<IO>& x, const float* ln_wb,
                                             unsigned char* z, float* smask, int r0) {
  const unsigned lane = threadIdx.x & 31;
  const int r = r0 + (int)(lane >> 3);
  float4 v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (IO == TM_IO_F32) {
      v[i] = x.f[i];
    } else {
      v[i] = io_widen4<IO>(x.h[i]);
    }
  }
  float s[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] = (v[i].x + v[i].y) + (v[i].z + v[i].w);
  float mean = (s[0] + s[2]) + (s[1] + s[3]);
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) mean += __shfl_xor_sync(0xffffffffu, mean, o);
  mean *= (1.f / 128.f);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float a = v[i].x - mean, bb = v[i].y - mean, c = v[i].z - mean, d = v[i].w - mean;
    s[i] = (a * a + bb * bb) + (c * c + d * d);
  }
  float var = (s[0] + s[2]) + (s[1] + s[3]);
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) var += __shfl_xor_sync(0xffffffffu, var, o);
  const float rs = tm_rsqrt(var * (1.f / 128.f) + p.eps);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = ws_group_channel(i);
    const float4 w = *(const float4*)(ln_wb + c), b = *(const float4*)(ln_wb + 128 + c);
    const unsigned lo = mma_pack_h2((v[i].x - mean) * rs * w.x + b.x, (v[i].y - mean) * rs * w.y + b.y);
    const unsigned hi = mma_pack_h2((v[i].z - mean) * rs * w.z + b.z, (v[i].w - mean) * rs * w.w + b.w);
    *(uint2*)(z + ip_z_offset<true, WS_BM>(r, c, 0)) = make_uint2(lo, hi);
  }
  if (lane < WS_LN_ROWS) smask[r0 + lane] = x.mask;
}

// The producers' loop: tile k goes to z buffer k % 2 (pair k % 2). x holds the warp's rows of
// tile 0, loaded while the weights were still arriving.
template <int IO>
__device__ __forceinline__ void ws_produce(const TmInputParams& p, unsigned char* zbuf, float* smask,
                                           const float* ln_wb, int n_k, WsRows<IO>& x) {
  const unsigned warp = threadIdx.x >> 5;
  const int r0 = warp * WS_LN_ROWS;
  for (int k = 0; k < n_k; ++k) {
    const int buf = k & 1;
    if (k >= 2) ws_bar_sync(ws_empty(buf), WS_HAND);  // pair `buf` done reading its previous tile's z
    ws_normalize<IO>(p, x, ln_wb, zbuf + buf * WS_Z_BYTES, smask + buf * WS_BM, r0);
    fence_proxy_async();  // z written by ordinary stores; the pair's tensor cores read it next
    ws_bar_arrive(ws_full(buf), WS_HAND);
    // The last tile's rows again after the last tile, rather than a conditional load: with one,
    // x would have to survive the iteration for the case that skips it (12 bytes of spills).
    ws_load<IO>(p, ws_tile0(p, k + 1 < n_k ? k + 1 : k) + r0, x);
  }
  // Match each pair's last hand-back, so that no barrier is left part-way.
  for (int k = n_k < 2 ? 2 : n_k; k < n_k + 2; ++k) ws_bar_sync(ws_empty(k & 1), WS_HAND);
}

// Stores warpgroup wg's part of a chunk's staging, by its 128 threads (t): of a gating chunk its
// 16 channels (16·wg ..) of left and right, one 16-byte run of 8 positions per thread and side; of
// the gate chunk its 64 columns, four runs per thread. Each warpgroup stages into and stores from
// its own 8 KB, so the two warpgroups of a pair synchronise only among their own 128 threads.
__device__ __forceinline__ void ws_store_wg(const TmInputParams& p, const IpLaunch& l, int chunk,
                                            const tm_half* stage_buf, int wg, unsigned t) {
  const unsigned char* st = (const unsigned char*)stage_buf;  // this warpgroup's 8 KB (ip_epilogue_sm90)
  if (chunk < l.n_gating) {
    const int run = t & 7, ch = t >> 3;  // 16-byte run of positions, channel among the 16
    const tm_i64 off = l.tb0 * l.lr_h * l.ms + l.trem0 + run * 8 + (tm_i64)(chunk * 32 + 16 * wg + ch) * l.ms;
    *(uint4*)(p.left + off) = *(const uint4*)(st + ch * 128 + ((run ^ (ch & 7)) << 4));
    *(uint4*)(p.right + off) = *(const uint4*)(st + (16 + ch) * 128 + ((run ^ (ch & 7)) << 4));
  } else {
    // The gate is read back only by the output stage, after the contraction has streamed left and
    // right through L2; marked first to evict, its lines leave room for the left and right the
    // contraction reads first (H100: 256,2,128 −1 to −2 µs, 768,1,128 −0.5%, 1024 unchanged).
    const unsigned long long gate_policy = l2_evict_first();
    const int gc0 = (chunk - 4) * IP_BN;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int piece = t + 128 * i, r = piece >> 3, run = piece & 7;
      st_stream_u4(p.gate + (l.tile0 + r - p.buf_row0) * p.g + gc0 + 64 * wg + run * 8,
                   *(const uint4*)(st + r * 128 + ((run ^ (r & 7)) << 4)), gate_policy);
    }
  }
}

#if defined(TM_HAS_WGMMA)
// A consumer pair's loop over its tiles (every other one, from `pair`).
__device__ __forceinline__ void ws_consume(const TmInputParams& p, const unsigned char* wts, const unsigned char* zbuf,
                                           const float* smask_all, tm_half* stage_all, int n_k, int pair) {
  const unsigned pt = threadIdx.x - 32 * WS_PRODUCERS - 256 * pair;  // thread within the pair
  const int wq = (pt >> 5) & 3;
  // Warp-uniform as far as the compiler can tell (a value broadcast from lane 0), so that the
  // descriptors below and their per-step offsets live in uniform registers: computed per thread,
  // each wgmma took four R2UR moves and a 64-bit add of ten instructions (ncu, v31).
  const int wg = __shfl_sync(0xffffffffu, (int)(pt >> 7), 0);
  pair = __shfl_sync(0xffffffffu, pair, 0);
  const unsigned char* z = zbuf + pair * WS_Z_BYTES;
  const float* smask = smask_all + pair * WS_BM;
  tm_half* stage_buf = stage_all + (pair * WS_STAGE_BYTES + wg * (WS_STAGE_BYTES / 2)) / 2;
  // Both warpgroups read all 64 rows of z; warpgroup wg the output columns 64·wg .. of a chunk.
  const unsigned long long a_desc = wgmma_desc_sw128(mma_smem_addr(z));
  const unsigned long long b_desc = wgmma_desc_sw128(mma_smem_addr(wts) + wg * 64 * 128);
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  for (int k = pair; k < n_k; k += 2) {
    const IpLaunch l = ws_launch(p, ws_tile0(p, k));
    ws_bar_sync(ws_full(pair), WS_HAND);
    for (int chunk = 0; chunk < l.n_chunks; ++chunk) {
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
        wgmma_slice<WS_BM>(acc, a_desc + ((ks * WS_BM * 128) >> 4),
                            b_desc + (((chunk * 2 + ks) * WS_SLICE_BYTES) >> 4), ks);
      wgmma_commit();
      wgmma_wait_all();
      // The gate chunk reads neither z nor the mask: hand the buffer back before its epilogue.
      // Without it (chunk_end 4) the last chunk is a gating one, whose epilogue reads the mask:
      // the hand-back then follows the barrier after that epilogue. (Placed right after the
      // epilogue, the compiler merged it with the arrive above, ahead of the mask reads, and
      // racecheck saw the producers' next mask race with them.)
      const bool last = chunk == l.n_chunks - 1;
      if (last && chunk >= l.n_gating) ws_bar_arrive(ws_empty(pair), WS_HAND);
      if (p.w_in_bias) {
        ip_epilogue_sm90<true, WS_BM, true>(acc, p, l, chunk, stage_buf, smask, wg, wq);
      } else {
        ip_epilogue_sm90<false, WS_BM, true>(acc, p, l, chunk, stage_buf, smask, wg, wq);
      }
      ws_bar_sync(ws_group(pair, wg), 128);
      if (last && chunk < l.n_gating) ws_bar_arrive(ws_empty(pair), WS_HAND);
      ws_store_wg(p, l, chunk, stage_buf, wg, pt & 127);
      ws_bar_sync(ws_group(pair, wg), 128);  // the staging is reused by the next chunk's epilogue
    }
  }
}
#endif

// The persistent builds' weights, by all THREADS of the block: the first CHUNKS column chunks
// as one cp.async group (piece i, 16 bytes, of slice s = i / 1024 at row (i % 1024) / 8, column
// i % 8, into the 128-byte swizzle), and LN_C's weight and bias into ln_wb.
template <int CHUNKS, int THREADS>
__device__ __forceinline__ void ws_load_weights(const TmInputParams& p, unsigned char* wts, float* ln_wb) {
  for (int i = threadIdx.x; i < CHUNKS * 2 * 1024; i += THREADS) {
    const int s = i >> 10, row = (i >> 3) & 127, c16 = i & 7, chunk = s >> 1, ks = s & 1;
    const tm_half* src = p.w_in + (tm_i64)(chunk * IP_BN + row) * 128 + ks * IP_BK + c16 * 8;
    // Slice s is the s-th 64-column atom of a [128]-row tile: WS_SLICE_BYTES = 128 x 128 bytes apart.
    mma_cp_async16(mma_smem_addr(wts) + wgmma_sw128_offset<128>(row, s * 64 + c16 * 8), src);
  }
  asm volatile("cp.async.commit_group;");
  if (threadIdx.x < 256) {
    ln_wb[threadIdx.x] = threadIdx.x < 128 ? p.norm_in_w[threadIdx.x] : p.norm_in_b[threadIdx.x - 128];
  }
}

// Shapes (the host checks): C = k_pad = H = G = 128, every chunk and channel, row0, rows and N²
// multiples of 64, so that every tile is full and inside one batch. The gate is stored from
// position buf_row0 (a rank's own positions in the sharded forward).
template <int IO>
__device__ __forceinline__ void input_projection_ws_body(const TmInputParams& p) {
#if defined(TM_HAS_WGMMA)
  extern __shared__ __align__(16) unsigned char ws_smem[];
  // The swizzle atoms must sit on 1024-byte boundaries; the host adds 1024 bytes of slack.
  unsigned char* wts = ws_smem + ((1024u - (mma_smem_addr(ws_smem) & 1023u)) & 1023u);  // [5][2][128][128 B]
  unsigned char* zbuf = wts + WS_W_BYTES;                             // [2][2 atoms][64][128 B]
  tm_half* stage_all = (tm_half*)(zbuf + 2 * WS_Z_BYTES);             // [2 pairs][2 warpgroups][8 KB]
  float* smask = (float*)((unsigned char*)stage_all + 2 * WS_STAGE_BYTES);  // [2][64]
  float* ln_wb = smask + 2 * WS_BM;                                   // LN_C weight [128], bias [128]

  // All weights, once. Before pdl_wait: the weights are no other kernel's output.
  ws_load_weights<WS_CHUNKS, WS_THREADS>(p, wts, ln_wb);
  const int tiles = (int)(p.rows / WS_BM);
  const int n_k = tiles > (int)blockIdx.x ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
  pdl_wait();
  const unsigned warp = threadIdx.x >> 5;
  // The producers' first rows of x, in flight while the weights land.
  WsRows<IO> x;
  if (warp < WS_PRODUCERS && n_k > 0) ws_load<IO>(p, ws_tile0(p, 0) + warp * WS_LN_ROWS, x);
  asm volatile("cp.async.wait_group 0;");
  fence_proxy_async();  // the weights, visible to the tensor cores
  __syncthreads();
  // The block starts at 64 registers per thread (1024 x 64, the SM's 64 K); the producers give
  // back what the consumers take: 512 x (64 - 48) = 512 x (80 - 64).
  if (warp < WS_PRODUCERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 48;");
    ws_produce<IO>(p, zbuf, smask, ln_wb, n_k, x);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 80;");
    ws_consume(p, wts, zbuf, smask, stage_all, n_k, (warp - WS_PRODUCERS) >> 3);
  }
#else
  __trap();
#endif
}

// ---- The register-operand build (input_projection_sm90_rs): 16-bit x, C = H = 128, sm_90a,
// the four gating chunks alone (af3's gate made from x by the output stage).
// The warp-specialised build above keeps z in shared memory, so each of its m64n64 wgmmas reads
// both operands from there (L1/shared 87% busy at N = 1024 on an H200), and its sixteen
// 80-register consumer warps run MMA, epilogue and stores of a chunk one after another. Here a
// block is three warpgroups, one per SM:
//   warpgroup 0 (the producer, 40 registers) copies each 64-position tile of raw 16-bit x and its
//     mask into one of two shared buffers (cp.async, the 128-byte swizzle), tile k into buffer
//     k % 2;
//   warpgroups 1 and 2 (the consumers, 232 registers) take the tiles alternately (tile k is
//     consumer k % 2's, so each buffer has one reader). A consumer loads its tile with ldmatrix
//     straight into the wgmma A-fragment layout (a warp's 16 positions, a thread two of them and
//     32 channels of each), keeps the mask in registers, hands the buffer back, computes LN_C in
//     registers (the four threads of a quad share a position: two shuffles per statistic) and
//     keeps z as 32 f16x2 registers. Every gating chunk is then 8 m64n128k16 wgmmas with A from
//     registers and B (the resident weights) from shared memory, into one of two accumulator
//     sets, so that chunk c + 1's MMAs run while chunk c's epilogue gates, stages and stores.
// Measured faster than the warp-specialised build without the gate; with the gate chunk too (two
// staging passes by one warpgroup after the last MMAs) it was slower, so that build keeps the
// launches that store the gate (docs/perf/NOTES.md, thirty-sixth session).
// Not bit for bit the other builds: LN_C's sums are taken in another order (tests/cuda.rs).
#define RS_THREADS 384
#define RS_BM 64
#define RS_X_BYTES (RS_BM * 128 * 2)  // one tile of 16-bit x: two 64-channel atoms of [64][128 B]
#define RS_STAGE_BYTES 8192           // one staging buffer; two per consumer
#define RS_SMEM_BYTES (WS_W_BYTES + 2 * RS_X_BYTES + 4 * RS_STAGE_BYTES + 2 * RS_BM * 4 + 2 * 128 * 4 + 1024)
static_assert(RS_SMEM_BYTES == TM_RS_SMEM && RS_THREADS == TM_RS_THREADS && RS_BM == TM_WS_ROWS, "common/smem.h");

// Named barriers (0 is __syncthreads): buffer w full (the producer arrives, consumer w waits),
// buffer w empty (consumer w arrives, the producer waits), and consumer w's own 128 threads.
__device__ __forceinline__ int rs_full(int w) { return 1 + w; }
__device__ __forceinline__ int rs_empty(int w) { return 3 + w; }
__device__ __forceinline__ int rs_group(int w) { return 5 + w; }

// Two 16-bit values of x (bf16 or f16 as IO says) widened to f32.
template <int IO>
__device__ __forceinline__ float2 rs_widen2(unsigned w) {
  if (IO == TM_IO_BF16) return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  return make_float2(tm_lo(w), tm_hi(w));
}

// The producer: tile k's 64 rows of x (16 pieces of 16 bytes each) into buffer k % 2 in the
// 128-byte swizzle, and its mask, once consumer k % 2 has handed back tile k - 2's.
__device__ __forceinline__ void rs_produce(const TmInputParams& p, unsigned char* xbuf, float* smask, int n_k) {
  const unsigned t = threadIdx.x;  // 0 .. 127
  for (int k = 0; k < n_k; ++k) {
    const int w = k & 1;
    if (k >= 2) ws_bar_sync(rs_empty(w), 256);
    const tm_i64 tile0 = ws_tile0(p, k);
    const unsigned xs = mma_smem_addr(xbuf + w * RS_X_BYTES);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int piece = (int)t + 128 * i, r = piece >> 4, c = (piece & 15) * 8;
      mma_cp_async16(xs + wgmma_sw128_offset<RS_BM>(r, c), (const unsigned short*)p.x + (tile0 + r) * 128 + c);
    }
    asm volatile("cp.async.commit_group;");
    if (t < RS_BM) smask[w * RS_BM + t] = p.mask ? p.mask[tile0 + t] : 1.f;
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    ws_bar_arrive(rs_full(w), 256);
  }
  // Match each consumer's last hand-backs, so that no barrier is left part-way.
  for (int k = n_k < 2 ? 2 : n_k; k < n_k + 2; ++k) ws_bar_sync(rs_empty(k & 1), 256);
}

#if defined(TM_HAS_WGMMA)
// One column chunk's 8 k16 steps into acc (A: z in registers; B: the chunk's weights, both K
// slices), committed as one group.
__device__ __forceinline__ void rs_mma_chunk(float (&acc)[64], const unsigned (&a)[8][4], unsigned long long b_desc,
                                             int chunk) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    wgmma_m64n128k16_rs(acc, a[kk], b_desc + (((chunk * 2 + (kk >> 2)) * WS_SLICE_BYTES) >> 4) + (kk & 3) * 2,
                        kk != 0);
  }
  wgmma_commit();
}

// Where this thread stores a gating chunk's left and right: piece i of its four (i = 0, 1: left,
// 2, 3: right) is channel t / 8 + 16·(i % 2) of the chunk, positions 8·(t % 8) .. of the tile.
// The pointers advance by 32 channels per chunk, so each chunk adds one offset instead of
// computing four 64-bit addresses (which ptxas kept for every chunk and spilled).
struct RsOut {
  tm_half* left;
  tm_half* right;
  tm_i64 ch16;  // 16 channels apart
  tm_i64 ch32;
};

// A gating chunk's epilogue: left and right of its 32 channels gated and masked, staged
// transposed into `st` (rows 0-31 left's channels, 32-63 right's, each row the tile's 64
// positions as 128 bytes whose 16-byte pieces are permuted by XOR with row % 8), then stored as
// 16-byte runs along positions. The accumulator layout is ip_epilogue_sm90's for BM = 128.
template <bool HAS_BIAS>
__device__ __forceinline__ void rs_gating_epilogue(const float (&acc)[64], const TmInputParams& p, RsOut& o,
                                                   int chunk, unsigned char* st, float m0, float m1, int w) {
  const unsigned t = threadIdx.x & 127;
  const int lane = t & 31, wq = t >> 5, tig = lane & 3, tile = lane >> 3, trow = lane & 7;
  const float* bias = p.w_in_bias + chunk * IP_BN;
  const unsigned st_base =
      mma_smem_addr(st) + ((tile < 2 ? 0 : 32) + trow) * 128 + (((2 * wq + (tile & 1)) ^ trow) << 4);
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // blocks of 8 channels [lp | lg | rp | rg]
    unsigned lr[2][2];
    ip_gated_block<HAS_BIAS>(acc, bias, q, q, tig, m0, m1, lr);
    stmatrix_x4_trans(st_base + q * 8 * 128, lr[0][0], lr[0][1], lr[1][0], lr[1][1]);
  }
  ws_bar_sync(rs_group(w), 128);
  // Piece i's row of the staging is t / 8 + 16·i: the same swizzle (row % 8) for all four.
  const unsigned char* src = st + (t >> 3) * 128 + (((t & 7) ^ ((t >> 3) & 7)) << 4);
  const uint4 l0 = *(const uint4*)src, l1 = *(const uint4*)(src + 2048);
  const uint4 r0 = *(const uint4*)(src + 4096), r1 = *(const uint4*)(src + 6144);
  *(uint4*)o.left = l0;
  *(uint4*)(o.left + o.ch16) = l1;
  *(uint4*)o.right = r0;
  *(uint4*)(o.right + o.ch16) = r1;
  o.left += o.ch32;
  o.right += o.ch32;
}

// Chunk c's epilogue from accumulator set c % 2, while chunk c + 1's MMAs (issued first) run.
// Unrolled into straight-line code, so that ptxas sees which accumulator set each epilogue reads
// and does not serialise the wgmmas.
template <bool HAS_BIAS>
__device__ __forceinline__ void rs_chunks(float (&acc)[2][64], const unsigned (&a)[8][4], unsigned long long b_desc,
                                          const TmInputParams& p, RsOut o, unsigned char* st, float m0, float m1,
                                          int w) {
  rs_mma_chunk(acc[0], a, b_desc, 0);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    if (c + 1 < 4) {
      rs_mma_chunk(acc[(c + 1) & 1], a, b_desc, c + 1);
      wgmma_wait<1>();
    } else {
      wgmma_wait_all();
    }
    rs_gating_epilogue<HAS_BIAS>(acc[c & 1], p, o, c, st + (c & 1) * RS_STAGE_BYTES, m0, m1, w);
  }
}

// Consumer w's loop over tiles w, w + 2, ...
template <int IO>
__device__ __forceinline__ void rs_consume(const TmInputParams& p, const unsigned char* wts,
                                           const unsigned char* xbuf, const float* smask_all, const float* ln_wb,
                                           unsigned char* stage_all, int n_k, int w) {
  const unsigned t = threadIdx.x & 127;
  const int lane = t & 31, wq = t >> 5, g = lane >> 2;
  const unsigned xs = mma_smem_addr(xbuf + w * RS_X_BYTES);
  const float* smask = smask_all + w * RS_BM;
  unsigned char* st = stage_all + w * 2 * RS_STAGE_BYTES;
  const unsigned long long b_desc = wgmma_desc_sw128(mma_smem_addr(wts));
  // ldmatrix.x4 of k16 step j: lane L addresses row L % 8 (+ 8 for L / 8 odd) of the warp's 16,
  // channel 16·j + 8·(L / 16); registers 0-3 are then the A fragment's (rows g, g + 8; channels
  // 2·(L % 4) + {0, 1}, + 8).
  const int lrow = 16 * wq + (lane & 7) + 8 * ((lane >> 3) & 1), lcol = 8 * (lane >> 4);
  const int c2 = 2 * (lane & 3);  // this thread's first channel of each 8
  for (int k = w; k < n_k; k += 2) {
    const tm_i64 tile0 = ws_tile0(p, k);
    ws_bar_sync(rs_full(w), 256);
    unsigned a[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      mma_ldmatrix_x4(xs + wgmma_sw128_offset<RS_BM>(lrow, 16 * j + lcol), a[j][0], a[j][1], a[j][2], a[j][3]);
    }
    const float m0 = smask[16 * wq + g], m1 = smask[16 * wq + g + 8];
    float2 v[8][4];  // [k16 step][register]: registers 0, 2 are row g, 1, 3 row g + 8
    // Sums in four partial chains per row (one per pair of k16 steps), so that their adds
    // overlap instead of running as one chain of 32.
    float part[2][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        v[j][r] = rs_widen2<IO>(a[j][r]);
        const float pair = v[j][r].x + v[j][r].y;
        part[r & 1][j & 3] = j < 4 && r < 2 ? pair : part[r & 1][j & 3] + pair;
      }
    float s[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) s[hf] = (part[hf][0] + part[hf][1]) + (part[hf][2] + part[hf][3]);
    // The buffer back to the producer: in PTX's memory model a barrier's arrive orders this
    // thread's earlier shared-memory reads (the ldmatrix and the mask) before the accesses that
    // follow the producer's bar.sync on the same barrier, so its next copy cannot overwrite them.
    ws_bar_arrive(rs_empty(w), 256);
    float mean[2], rstd[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      s[hf] += __shfl_xor_sync(0xffffffffu, s[hf], 1);
      s[hf] += __shfl_xor_sync(0xffffffffu, s[hf], 2);
      mean[hf] = s[hf] * (1.f / 128.f);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float d0 = v[j][r].x - mean[r & 1], d1 = v[j][r].y - mean[r & 1];
        const float q = d0 * d0 + d1 * d1;
        part[r & 1][j & 3] = j < 4 && r < 2 ? q : part[r & 1][j & 3] + q;
      }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      rstd[hf] = (part[hf][0] + part[hf][1]) + (part[hf][2] + part[hf][3]);
      rstd[hf] += __shfl_xor_sync(0xffffffffu, rstd[hf], 1);
      rstd[hf] += __shfl_xor_sync(0xffffffffu, rstd[hf], 2);
      rstd[hf] = tm_rsqrt(rstd[hf] * (1.f / 128.f) + p.eps);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int c = 16 * j + 8 * (r >> 1) + c2;
        const float2 wn = *(const float2*)(ln_wb + c), bn = *(const float2*)(ln_wb + 128 + c);
        const float mu = mean[r & 1], rs = rstd[r & 1];
        a[j][r] = mma_pack_h2((v[j][r].x - mu) * rs * wn.x + bn.x, (v[j][r].y - mu) * rs * wn.y + bn.y);
      }
    // The tile's first store positions (ws_launch's arithmetic: the tile lies in one batch).
    const IpLaunch l = ws_launch(p, tile0);
    const tm_i64 first = l.tb0 * l.lr_h * l.ms + l.trem0 + (t & 7) * 8 + (tm_i64)(t >> 3) * l.ms;
    const RsOut o{p.left + first, p.right + first, 16 * l.ms, 32 * l.ms};
    // Declared per tile: the wgmmas' first k-step overwrites them, so nothing carries over and
    // they are not live during the next tile's LayerNorm.
    float acc[2][64];
    if (p.w_in_bias) {
      rs_chunks<true>(acc, a, b_desc, p, o, st, m0, m1, w);
    } else {
      rs_chunks<false>(acc, a, b_desc, p, o, st, m0, m1, w);
    }
  }
}
#endif

// Shapes as the warp-specialised build's (the host checks), with 16-bit x.
template <int IO>
__device__ __forceinline__ void input_projection_rs_body(const TmInputParams& p) {
#if defined(TM_HAS_WGMMA)
  extern __shared__ __align__(16) unsigned char rs_smem[];
  unsigned char* wts = rs_smem + ((1024u - (mma_smem_addr(rs_smem) & 1023u)) & 1023u);  // [5][2][128][128 B], 4 used
  unsigned char* xbuf = wts + WS_W_BYTES;                                           // [2][2 atoms][64][128 B]
  unsigned char* stage_all = xbuf + 2 * RS_X_BYTES;                                 // [2 consumers][2][8 KB]
  float* smask = (float*)(stage_all + 4 * RS_STAGE_BYTES);                          // [2][64]
  float* ln_wb = smask + 2 * RS_BM;                                                 // LN_C weight, bias
  // The gating chunks' weights, once. Before pdl_wait: the weights are no other kernel's output.
  ws_load_weights<4, RS_THREADS>(p, wts, ln_wb);
  const int tiles = (int)(p.rows / RS_BM);
  const int n_k = tiles > (int)blockIdx.x ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
  pdl_wait();
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  fence_proxy_async();  // the weights, visible to the tensor cores
  __syncthreads();
  // 384 threads at 168 registers: the producer gives back 128 x (168 - 40), the consumers take
  // 256 x (232 - 168).
  const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    rs_produce(p, xbuf, smask, n_k);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    rs_consume<IO>(p, wts, xbuf, smask, ln_wb, stage_all, n_k, wg - 1);
  }
#else
  __trap();
#endif
}

// k_pad <= 128: two blocks per SM (registers capped at 128, which the small LN prologue allows
// without spilling)...
extern "C" __global__ void __launch_bounds__(IP_THREADS, 2) input_projection(const TmInputParams p) {
  input_projection_body<128>(p);
}

// ...and k_pad <= 512: one block per SM (z takes up to 130 KB of shared memory) with the
// registers uncapped.
extern "C" __global__ void __launch_bounds__(IP_THREADS, 1) input_projection_wide(const TmInputParams p) {
  input_projection_body<IP_MAX_K>(p);
}

// The same two builds with warpgroup MMA, for sm_90a...
extern "C" __global__ void __launch_bounds__(IP_THREADS, 2) input_projection_sm90(const TmInputParams p) {
  input_projection_sm90_body<128, IP_BM, IP_LN_ROWS_NARROW>(p);
}

extern "C" __global__ void __launch_bounds__(IP_THREADS, 1) input_projection_sm90_wide(const TmInputParams p) {
  input_projection_sm90_body<IP_MAX_K, IP_BM, IP_LN_ROWS_WIDE>(p);
}

// ...and a third for 128 < k_pad <= 448: 64-position blocks, two per SM, so that one block's
// LayerNorm (DRAM-bound) overlaps the other's MMAs and epilogues.
extern "C" __global__ void __launch_bounds__(IP_THREADS, 2) input_projection_sm90_mid(const TmInputParams p) {
  input_projection_sm90_body<IP_MAX_K, 64, 2>(p);
}

// ...and a fourth for k_pad <= 128 with f32 x: 64-position blocks, three per SM (80 registers).
// The third block hides more of the DRAM latency of f32 x; with 16-bit x the 128-position build
// stays faster (the host's FusedKernel::launch has the numbers).
extern "C" __global__ void __launch_bounds__(IP_THREADS, 3) input_projection_sm90_narrow64(const TmInputParams p) {
  input_projection_sm90_body<128, 64, 4>(p);
}

// ...and the warp-specialised persistent build for C = H = 128 (above), one block per SM.
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) input_projection_sm90_ws(const TmInputParams p) {
  if (p.io_dtype == TM_IO_BF16) {
    input_projection_ws_body<TM_IO_BF16>(p);
  } else if (p.io_dtype == TM_IO_F16) {
    input_projection_ws_body<TM_IO_F16>(p);
  } else {
    input_projection_ws_body<TM_IO_F32>(p);
  }
}

// ...and the register-operand build for 16-bit x at C = H = 128 (above), one block per SM.
extern "C" __global__ void __launch_bounds__(RS_THREADS, 1) input_projection_sm90_rs(const TmInputParams p) {
  if (p.io_dtype == TM_IO_BF16) {
    input_projection_rs_body<TM_IO_BF16>(p);
  } else {
    input_projection_rs_body<TM_IO_F16>(p);
  }
}
