// Matrix-core (MFMA) helpers for AMD CDNA GPUs (gfx908, gfx90a, gfx940/941/942, gfx950), wave64.
//
// v_mfma_f32_32x32x8f16 computes D[32x32] = A[32x8] * B[8x32] + C[32x32] over a whole wave of
// 64 lanes. Each lane holds 4 f16 of A, 4 f16 of B and 16 f32 of C/D. With lane = 0..63 and
// i/j/k the row, column and reduction indices (AMD CDNA3 ISA guide, "Matrix fused multiply-add";
// the same layout on CDNA2):
//   A[i][k]  is in lane  i + 32*(k/4),        element k%4          (rows along lanes, K split in halves)
//   B[k][j]  is in lane  j + 32*(k/4),        element k%4          (columns along lanes)
//   D[i][j]  is in lane  j + 32*((i/4)%2),    element 4*(i/8) + i%4
// so lane L holds A row L%32, B column L%32, k = 4*(L/32) .. 4*(L/32)+3, and D column L%32 with
// rows {8*g + 4*(L/32) + e : g = 0..3, e = 0..3} in elements 4*g + e.
// The host emulation in tests/hip_emu/ implements exactly this table, independently of the
// kernel's index math, to check the kernel on a CPU.
#pragma once

typedef _Float16 tm_half4 __attribute__((ext_vector_type(4)));
typedef float tm_float16 __attribute__((ext_vector_type(16)));

// 4 consecutive f16 (8 bytes, 8-byte aligned) as an MFMA operand. memcpy instead of a pointer
// cast: the storage type is tm_half (unsigned short), so a cast would break type-based aliasing.
TM_INLINE tm_half4 tm_load_half4(const tm_half* p) {
  tm_half4 v;
  __builtin_memcpy(&v, __builtin_assume_aligned(p, 8), sizeof(v));
  return v;
}

// The D row (the M index) element e (0..15) of `lane`'s accumulator holds; its column is lane % 32.
TM_INLINE int tm_mfma_d_row(int e, unsigned lane) { return 8 * (e >> 2) + (int)((lane & 63u) >> 5) * 4 + (e & 3); }

TM_INLINE tm_float16 tm_mfma_32x32x8_f16(tm_half4 a, tm_half4 b, tm_float16 c) {
  return __builtin_amdgcn_mfma_f32_32x32x8f16(a, b, c, 0, 0, 0);
}
