// Tensor-core building blocks shared by the fused CUDA kernels: shared-window addresses,
// cp.async, ldmatrix, mma.sync m16n8k16 with f16 inputs and f32 accumulators, the f32 -> f16x2
// pack (sm_80+), and Hopper's warpgroup MMA with its shared-memory descriptors (sm_90a only).
// Inline PTX, because NVRTC ships no <mma.h>/<cuda_fp16.h>.
#pragma once

__device__ __forceinline__ unsigned mma_smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void mma_cp_async16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

// Streaming accesses (data read or written once and not needed again soon): an L2 policy that
// marks their lines first to evict. The input builds for C > 128 use it for x and the gate (H100:
// C = 384 input stage −10 to −15%); in the C = 128 builds and for the output kernels' t and gate
// it measured neutral to 20% slower (docs/perf/NOTES.md, v24).
__device__ __forceinline__ unsigned long long l2_evict_first() {
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ float4 ld_stream_f4(const void* p, unsigned long long pol) {
  float4 v;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.f32 {%0,%1,%2,%3}, [%4], %5;"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ uint2 ld_stream_u2(const void* p, unsigned long long pol) {
  uint2 v;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ void st_stream_u4(void* p, uint4 v, unsigned long long pol) {
  asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w), "l"(pol)
               : "memory");
}

// 16 bytes from or to global memory in one instruction. A plain uint4 store through a pointer
// cast was split by nvcc into 4-byte ones where the value was built from separate words (SASS of
// the backward's output side: eight STG.E per 16 bytes, each touching 32 sectors across the warp).
// Volatile, so that a load and a later store of the same address stay in order.
__device__ __forceinline__ uint4 ld_u4(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_u4(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ void mma_ldmatrix_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void mma_16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as one f16x2 word, `lo` in the low half (the lower address).
__device__ __forceinline__ unsigned mma_pack_h2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// The same as bf16x2 (one instruction where tm_f2bf takes seven).
__device__ __forceinline__ unsigned mma_pack_bf2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// σ(x) of two values from their halves h = x/2, packed f16: 0.5·tanh(x/2) + 0.5, one tanh and
// one packed FMA per two values (the fused kernels' weights and biases are stored halved for it:
// cuda/input_projection.cu says why).
__device__ __forceinline__ unsigned mma_sigmoid2_halves(float h_lo, float h_hi) {
  const unsigned x = mma_pack_h2(h_lo, h_hi);
  unsigned t, r;
  asm("tanh.approx.f16x2 %0, %1;" : "=r"(t) : "r"(x));
  asm("fma.rn.f16x2 %0, %1, %2, %2;" : "=r"(r) : "r"(t), "r"(0x38003800u));  // t·0.5 + 0.5
  return r;
}

// Zeroes a warp's accumulators: MT x NT m16n8 tiles of 4 floats each.
template <int MT, int NT>
__device__ __forceinline__ void mma_zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// A's two m16 x k16 fragments of a warp's 32 rows: rows a_row0 + 16·mt, the 16 k from a_col.
__device__ __forceinline__ void mma_load_a32(unsigned (&a)[2][4], unsigned a_u, int lda, int a_row0, int a_col) {
  const unsigned lane = threadIdx.x & 31;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int row = a_row0 + mt * 16 + (lane & 15);
    mma_ldmatrix_x4(a_u + (row * lda + a_col + (lane >> 4) * 8) * 2, a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
  }
}

// mma_warp_k16's body for B stored n-major ([n][k], ldmatrix) or k-major ([k][n],
// ldmatrix.trans, which hands out the transposed 8 x 8 tiles: the same m16n8k16 B fragments); the
// output columns from n0, the k from k0.
template <int NT, bool K_MAJOR>
__device__ __forceinline__ void mma_warp_k16_b(float (&acc)[2][NT][4], unsigned a_u, int lda, int a_row0, int a_col,
                                               unsigned b_u, int ldb, int n0, int k0) {
  const unsigned lane = threadIdx.x & 31;
  unsigned a[2][4];
  mma_load_a32(a, a_u, lda, a_row0, a_col);
#pragma unroll
  for (int np = 0; np < NT / 2; ++np) {  // pairs of n8 tiles
    unsigned b0, b1, b2, b3;
    if (K_MAJOR) {
      const int tile = lane >> 3;
      const int krow = k0 + (tile & 1) * 8 + (lane & 7), ncol = n0 + np * 16 + (tile >> 1) * 8;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                   : "r"(b_u + (krow * ldb + ncol) * 2));
    } else {
      const int nrow = n0 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
      const int kcol = k0 + ((lane >> 3) & 1) * 8;
      mma_ldmatrix_x4(b_u + (nrow * ldb + kcol) * 2, b0, b1, b2, b3);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      mma_16816(acc[mt][2 * np], a[mt], b0, b1);
      mma_16816(acc[mt][2 * np + 1], a[mt], b2, b3);
    }
  }
}

// One k16 step of a warp's 32 x (8·NT) tile: acc[mt][nt] += A[rows a_row0 + 16·mt ..][k] ·
// B[rows b_row0 + 8·nt ..][k]ᵀ for the 16 k from a_col (A) and b_col (B). A and B are f16 in
// shared memory, row-major with pitches lda and ldb halves, at shared-window addresses a_u and
// b_u; B's rows are the output columns (the weights' natural [out, in] layout).
template <int NT>
__device__ __forceinline__ void mma_warp_k16(float (&acc)[2][NT][4], unsigned a_u, int lda, int a_row0, int a_col,
                                             unsigned b_u, int ldb, int b_row0, int b_col) {
  mma_warp_k16_b<NT, false>(acc, a_u, lda, a_row0, a_col, b_u, ldb, b_row0, b_col);
}

// mma_warp_k16 with B stored k-major ([k][n] row-major, pitch ldb halves): the output columns
// b_n0 + 8·nt, the k from b_k0 (the backward's du = ds·Wz reads Wz [C][H] this way).
template <int NT>
__device__ __forceinline__ void mma_warp_k16_kn(float (&acc)[2][NT][4], unsigned a_u, int lda, int a_row0, int a_col,
                                                unsigned b_u, int ldb, int b_k0, int b_n0) {
  mma_warp_k16_b<NT, true>(acc, a_u, lda, a_row0, a_col, b_u, ldb, b_n0, b_k0);
}

// ---- sm_90: stmatrix, four 8 x 8 tiles of 16-bit values from the mma fragment layout (thread t
// holds row t/4, columns 2(t%4) and 2(t%4) + 1 of each) to shared memory; lane L gives the
// address of row L%8 of tile L/8. The .trans form stores each tile transposed: the row lane L
// addresses receives column L%8.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void stmatrix_x4_trans(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
#endif

// ---- Programmatic dependent launch (sm_90+) ----
// The host launches the fused input and output kernels with the programmatic-stream-
// serialization attribute on sm_90 (src/backend/cuda/kernels.rs, `Stage::launch_dependent`): such
// a kernel's blocks may start while the kernel before it in the stream is still draining, and run
// their set-up (weights into shared memory, descriptors) under its tail. Everything a kernel does
// before pdl_wait() must therefore neither read what the previous kernel writes nor write what it
// reads: only the prepared weights. pdl_wait() returns once that kernel has completed and its
// writes are visible; for a kernel launched without the attribute, or built for an older GPU, it
// does nothing. None of these kernels triggers its dependents early: the next kernel may start
// only as this one's blocks exit.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Byte offset of element [r][c] of a K-major tile of `ROWS` rows in the 128-byte swizzle (the
// layout wgmma_desc_sw128 describes): 64-column atoms of [ROWS][128 bytes] one after another, the
// 16-byte pieces of row r permuted by XOR with r % 8. Pieces of 8 aligned columns stay contiguous.
template <int ROWS>
__device__ __forceinline__ unsigned wgmma_sw128_offset(int r, int c) {
  return (c >> 6) * (ROWS * 128) + r * 128 + ((((c & 63) >> 3) ^ (r & 7)) << 4) + (c & 7) * 2;
}

// ---- Hopper warpgroup MMA (sm_90a only; callers guard with TM_HAS_WGMMA) ----
// A warpgroup (4 consecutive warps, the first at a warp index divisible by 4) multiplies a
// 64 x 16 A tile by a 16 x 128 B tile from shared memory into 64 f32 accumulators per thread.
// Thread t of the warpgroup (warp w = t / 32, lane l) holds d[4j + e] for the n8 tile j:
// row 16w + l/4 + 8·(e/2), column 8j + 2·(l%4) + e%2 (the mma.sync m16n8 layout, one per n8 tile).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TM_HAS_WGMMA 1

// Shared-memory matrix descriptor of a K-major tile in the 128-byte swizzle: rows of 64 halves
// (128 bytes) whose 16-byte pieces are permuted by XOR with (row % 8), 8-row groups 1024 bytes
// apart, each group 1024-byte aligned. The leading-byte offset is unused in this mode.
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(unsigned smem_addr) {
  return (unsigned long long)((smem_addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Generic-proxy shared stores (st.shared, cp.async) made visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// The accumulator operands of a wgmma asm statement: 32 or 64 floats read and written.
#define TM_WGMMA_D32(d)                                                                                        \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),      \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define TM_WGMMA_D64(d)                                                                                        \
  TM_WGMMA_D32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),   \
      "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]),      \
      "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),      \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),      \
      "+f"(d[63])

// d (+)= A·Bᵀ for one k16 step; `accumulate` 0 overwrites d.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long a_desc, unsigned long long b_desc,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}"
      : TM_WGMMA_D64(d)
      : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}
// The same with a 16 x 64 B tile into 32 accumulators (n8 tiles j = 0..7).
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], unsigned long long a_desc, unsigned long long b_desc,
                                                int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}"
      : TM_WGMMA_D32(d)
      : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// d (+)= A·Bᵀ for one k16 step with A from registers (`a`: this thread's four f16x2 words of the
// warp's 16 rows, the mma.sync m16n8k16 A-fragment layout) and B from shared memory.
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const unsigned (&a)[4], unsigned long long b_desc,
                                                    int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}"
      : TM_WGMMA_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate));
}
// Waits until at most N of this warpgroup's committed wgmma groups are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// The wgmmas of one 64-wide K slice: four k16 steps of 32 bytes inside the 128-byte rows, from
// the descriptors of the slice's A and B tiles. BM = 128: m64n128 (a warpgroup's 64 rows, all
// 128 columns); BM = 64: m64n64. A chunk's first slice (ks 0) overwrites the accumulators with
// its first step (scale-d 0), so they are not zeroed per chunk.
template <int BM>
__device__ __forceinline__ void wgmma_slice(float (&acc)[BM == 128 ? 64 : 32], unsigned long long sa_k,
                                            unsigned long long sb, int ks) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int accumulate = (ks | kk) != 0;
    if constexpr (BM == 128) {
      wgmma_m64n128k16(acc, sa_k + kk * 2, sb + kk * 2, accumulate);
    } else {
      wgmma_m64n64k16(acc, sa_k + kk * 2, sb + kk * 2, accumulate);
    }
  }
}
#endif
