// x and y of the portable stages in the three I/O precisions (TmParams::io_dtype): f32, bf16
// or f16, read and written where they lie, so a 16-bit model needs no f32 copies. Element
// indices count elements of the I/O type. The branch on the precision is uniform across the grid.
// (The fused CUDA kernels have their own, batched loads: cuda/io.h.)
#pragma once

// Element c of a row of x in precision IO, widened to f32; `row` points at the row's first
// element. Templated on the precision so that a kernel branches once per launch and the f32
// build keeps its plain restrict-qualified loads.
template <int IO>
TM_INLINE float tm_row_x(const void* TM_RESTRICT row, int c) {
  if (IO == TM_IO_F32) return ((const float*)row)[c];
  const unsigned short w = ((const unsigned short*)row)[c];
  return IO == TM_IO_BF16 ? tm_bf2f(w) : tm_h2f(w);
}

// Elements 4·c4 .. 4·c4 + 4 of a row of x widened to f32: one 16-byte (f32) or 8-byte (16-bit)
// load; the row starts the callers use are aligned to that (C a multiple of 4).
template <int IO>
TM_INLINE tm_f4 tm_row_x4(const void* TM_RESTRICT row, int c4) {
  if (IO == TM_IO_F32) return ((const tm_f4*)row)[c4];
  const tm_u64h w = ((const tm_u64h*)row)[c4];
  tm_f4 r;
  if (IO == TM_IO_BF16) {
    r.v[0] = tm_bf2f((unsigned short)(w.v[0] & 0xFFFFu));
    r.v[1] = tm_bf2f((unsigned short)(w.v[0] >> 16));
    r.v[2] = tm_bf2f((unsigned short)(w.v[1] & 0xFFFFu));
    r.v[3] = tm_bf2f((unsigned short)(w.v[1] >> 16));
  } else {
    r.v[0] = tm_lo(w.v[0]);
    r.v[1] = tm_hi(w.v[0]);
    r.v[2] = tm_lo(w.v[1]);
    r.v[3] = tm_hi(w.v[1]);
  }
  return r;
}

// y[i] = v, rounded to nearest even where y is 16-bit.
TM_INLINE void tm_store_y(const TmParams& p, tm_i64 i, float v) {
  if (p.io_dtype == TM_IO_F32) {
    p.y[i] = v;
  } else {
    ((unsigned short*)p.y)[i] = p.io_dtype == TM_IO_BF16 ? tm_f2bf(v) : tm_f2h(v);
  }
}
