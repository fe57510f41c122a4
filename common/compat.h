// Portability layer for the stages that need no matrix cores: the same source compiles as
// CUDA (nvcc or NVRTC, no headers needed) and as HIP (clang -x hip -nogpuinc, no ROCm needed).
//
// It provides: kernel qualifiers, thread/block indices, block barriers, a 32-lane group sum
// (a CUDA warp; half an AMD wave64, so the same code is right on both), half-precision storage
// as raw 16-bit words with conversions, and the few math functions the stages use.
#pragma once

#if defined(__HIP__)
// ---------------------------------------------------------------- AMD (clang, no HIP headers)
#define TRIMUL_HIP 1
// hipRTC predefines these (identically); the guards keep the source valid under both.
#ifndef __global__
#define __global__ __attribute__((global))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#ifndef __shared__
#define __shared__ __attribute__((shared))
#endif
#define TM_INLINE __attribute__((device, always_inline)) inline
#define TM_LAUNCH_BOUNDS(n) __attribute__((amdgpu_flat_work_group_size(1, n)))
// With a minimum of `b` resident blocks per multiprocessor: CUDA caps the registers to fit them;
// on AMD only the work-group size is declared.
#define TM_LAUNCH_BOUNDS_MIN(n, b) __attribute__((amdgpu_flat_work_group_size(1, n)))
#define TM_RESTRICT __restrict__

TM_INLINE unsigned tm_tid() { return __builtin_amdgcn_workitem_id_x(); }
TM_INLINE unsigned tm_bid() { return __builtin_amdgcn_workgroup_id_x(); }
TM_INLINE unsigned tm_bdim() { return __builtin_amdgcn_workgroup_size_x(); }
TM_INLINE void tm_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
TM_INLINE unsigned tm_lane64() { return __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u)); }
// xor-shuffle within the wave; offsets below 32 never cross the 32-lane half.
TM_INLINE float tm_shfl_xor(float v, int offset) {
  int src = (int)(tm_lane64() ^ (unsigned)offset);
  return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute(src << 2, __builtin_bit_cast(int, v)));
}
TM_INLINE float tm_h2f(unsigned short h) { return (float)__builtin_bit_cast(_Float16, h); }
TM_INLINE unsigned short tm_f2h(float f) { return __builtin_bit_cast(unsigned short, (_Float16)f); }
TM_INLINE float tm_exp(float x) { return __builtin_expf(x); }
TM_INLINE float tm_rsqrt(float x) { return __builtin_amdgcn_rsqf(x); }
TM_INLINE float tm_rcp(float x) { return __builtin_amdgcn_rcpf(x); }
// bf16 is the top half of an f32.
TM_INLINE float tm_bf2f(unsigned short b) { return __builtin_bit_cast(float, (unsigned)b << 16); }
TM_INLINE unsigned tm_f2u(float f) { return __builtin_bit_cast(unsigned, f); }

#else
// ---------------------------------------------------------------- NVIDIA (nvcc or NVRTC)
#define TRIMUL_CUDA 1
#define TM_INLINE __device__ __forceinline__
#define TM_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#define TM_LAUNCH_BOUNDS_MIN(n, b) __launch_bounds__(n, b)
#define TM_RESTRICT __restrict__

TM_INLINE unsigned tm_tid() { return threadIdx.x; }
TM_INLINE unsigned tm_bid() { return blockIdx.x; }
TM_INLINE unsigned tm_bdim() { return blockDim.x; }
TM_INLINE void tm_sync() { __syncthreads(); }
TM_INLINE float tm_shfl_xor(float v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
// Inline PTX instead of <cuda_fp16.h>: NVRTC does not ship that header.
TM_INLINE float tm_h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
TM_INLINE unsigned short tm_f2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
TM_INLINE float tm_exp(float x) { return __expf(x); }
TM_INLINE float tm_rsqrt(float x) { return rsqrtf(x); }
// One MUFU instruction (1 ulp) instead of the IEEE division's multi-instruction sequence.
TM_INLINE float tm_rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// bf16 is the top half of an f32.
TM_INLINE float tm_bf2f(unsigned short b) { return __uint_as_float((unsigned)b << 16); }
TM_INLINE unsigned tm_f2u(float f) { return __float_as_uint(f); }
#endif

#include "common/storage_types.h"

TM_INLINE float tm_lo(unsigned w) { return tm_h2f((unsigned short)(w & 0xFFFFu)); }
TM_INLINE float tm_hi(unsigned w) { return tm_h2f((unsigned short)(w >> 16)); }
TM_INLINE unsigned tm_pack2(float lo, float hi) { return (unsigned)tm_f2h(lo) | ((unsigned)tm_f2h(hi) << 16); }

// f32 to bf16, rounded to nearest even (the top half of the f32 after rounding the bottom half);
// NaN stays a quiet NaN of the same sign (rounding could carry a NaN's payload into infinity).
TM_INLINE unsigned short tm_f2bf(float f) {
  const unsigned u = tm_f2u(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Sum over a group of 32 consecutive lanes (a CUDA warp, half an AMD wave).
TM_INLINE float tm_group32_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += tm_shfl_xor(v, o);
  return v;
}

// Logistic sigmoid; saturates cleanly for large |x| (exp overflow gives rcp(inf) = 0) and keeps
// NaN. The approximate reciprocal (1 ulp; the argument is ≥ 1, so flushing denormals changes
// nothing) costs one instruction where a division costs about ten; the epilogues that apply the
// gates issued more instructions than their MMAs (ncu on the fused input kernel).
TM_INLINE float tm_sigmoid(float x) { return tm_rcp(1.0f + tm_exp(-x)); }
