// x and y in the three I/O precisions (TrimulParams::io_dtype): f32, bf16 or f16. The fused
// kernels read x and write y through these, so one build serves every mode; the branch is
// uniform across the grid.
#pragma once

// Four consecutive elements of x from element `idx` (a multiple of 4), as f32.
__device__ __forceinline__ float4 io_load_x4(const TrimulParams& p, tm_i64 idx) {
  if (p.io_dtype == TM_IO_F32) return *(const float4*)(p.x + idx);
  const uint2 w = *(const uint2*)((const unsigned short*)p.x + idx);
  if (p.io_dtype == TM_IO_BF16) {
    // bf16 is the top half of an f32.
    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xFFFF0000u), __uint_as_float(w.y << 16),
                       __uint_as_float(w.y & 0xFFFF0000u));
  }
  return make_float4(tm_lo(w.x), tm_hi(w.x), tm_lo(w.y), tm_hi(w.y));
}

// Two consecutive elements of y at element `idx` (even), rounded to nearest even.
__device__ __forceinline__ void io_store_y2(const TrimulParams& p, tm_i64 idx, float v0, float v1) {
  if (p.io_dtype == TM_IO_F32) {
    *(float2*)(p.y + idx) = make_float2(v0, v1);
    return;
  }
  unsigned packed;
  if (p.io_dtype == TM_IO_BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(v1), "f"(v0));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(v1), "f"(v0));
  }
  *(unsigned*)((unsigned short*)p.y + idx) = packed;
}
