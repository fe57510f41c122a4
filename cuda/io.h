// x and y in the three I/O precisions (TmParams::io_dtype): f32, bf16 or f16. The fused
// kernels read x and write y through these, so one build serves every mode; the branch is
// uniform across the grid.
#pragma once
#include "cuda/mma.h"

// Four 16-bit elements of x (bf16 or f16 as IO says), widened to f32. Callers load the raw
// words of every row they batch first and widen after, so that all the loads are in flight at
// once (a load-then-convert per element, behind a branch on the mode, serialised them: the
// bf16 input stage measured 20% slower than f32 on the H100 while reading half the bytes).
template <int IO>
__device__ __forceinline__ float4 io_widen4(uint2 w) {
  if (IO == TM_IO_BF16) {
    // bf16 is the top half of an f32.
    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xFFFF0000u), __uint_as_float(w.y << 16),
                       __uint_as_float(w.y & 0xFFFF0000u));
  }
  return make_float4(tm_lo(w.x), tm_hi(w.x), tm_lo(w.y), tm_hi(w.y));
}

// Two consecutive elements of 16-bit y packed in the launch's I/O type (bf16 or f16), rounded to
// nearest even.
__device__ __forceinline__ unsigned io_pack_y2(const TmParams& p, float v0, float v1) {
  unsigned packed;
  if (p.io_dtype == TM_IO_BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(v1), "f"(v0));
  } else {
    packed = mma_pack_h2(v0, v1);
  }
  return packed;
}

// Two consecutive elements of y at element `idx` (even), rounded to nearest even.
__device__ __forceinline__ void io_store_y2(const TmParams& p, tm_i64 idx, float v0, float v1) {
  if (p.io_dtype == TM_IO_F32) {
    *(float2*)(p.y + idx) = make_float2(v0, v1);
    return;
  }
  *(unsigned*)((unsigned short*)p.y + idx) = io_pack_y2(p, v0, v1);
}
