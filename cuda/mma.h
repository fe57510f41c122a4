// Tensor-core building blocks shared by the fused CUDA kernels (sm_80+): shared-window
// addresses, cp.async, ldmatrix, mma.sync m16n8k16 with f16 inputs and f32 accumulators, and the
// f32 -> f16x2 pack. Inline PTX, because NVRTC ships no <mma.h>/<cuda_fp16.h>.
#pragma once

__device__ __forceinline__ unsigned mma_smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void mma_cp_async16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
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

// One k16 step of a warp's 32 x (8·NT) tile: acc[mt][nt] += A[rows a_row0 + 16·mt ..][k] ·
// B[rows b_row0 + 8·nt ..][k]ᵀ for the 16 k from a_col (A) and b_col (B). A and B are f16 in
// shared memory, row-major with pitches lda and ldb halves, at shared-window addresses a_u and
// b_u; B's rows are the output columns (the weights' natural [out, in] layout).
template <int NT>
__device__ __forceinline__ void mma_warp_k16(float (&acc)[2][NT][4], unsigned a_u, int lda, int a_row0, int a_col,
                                             unsigned b_u, int ldb, int b_row0, int b_col) {
  const unsigned lane = threadIdx.x & 31;
  unsigned a[2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int row = a_row0 + mt * 16 + (lane & 15);
    mma_ldmatrix_x4(a_u + (row * lda + a_col + (lane >> 4) * 8) * 2, a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
  }
#pragma unroll
  for (int np = 0; np < NT / 2; ++np) {  // pairs of n8 tiles
    const int nrow = b_row0 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
    const int kcol = b_col + ((lane >> 3) & 1) * 8;
    unsigned b0, b1, b2, b3;
    mma_ldmatrix_x4(b_u + (nrow * ldb + kcol) * 2, b0, b1, b2, b3);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      mma_16816(acc[mt][2 * np], a[mt], b0, b1);
      mma_16816(acc[mt][2 * np + 1], a[mt], b2, b3);
    }
  }
}
