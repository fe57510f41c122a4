// x and y of the portable stages in the three I/O precisions (TrimulParams::io_dtype): f32, bf16
// or f16, read and written where they lie, so a 16-bit model needs no f32 copies. Element
// indices count elements of the I/O type. The branch on the precision is uniform across the grid.
// (The fused CUDA kernels have their own, batched loads: cuda/io.h.)
#pragma once

// x[i] widened to f32.
TM_INLINE float tm_load_x(const TrimulParams& p, tm_i64 i) {
  if (p.io_dtype == TM_IO_F32) return p.x[i];
  const unsigned short w = ((const unsigned short*)p.x)[i];
  return p.io_dtype == TM_IO_BF16 ? tm_bf2f(w) : tm_h2f(w);
}

// x[i .. i + 4) widened to f32: one 16-byte (f32) or 8-byte (16-bit) load; i % 4 == 0, and the
// row starts the callers use are aligned to that.
TM_INLINE tm_f4 tm_load_x4(const TrimulParams& p, tm_i64 i) {
  if (p.io_dtype == TM_IO_F32) return ((const tm_f4*)p.x)[i >> 2];
  const tm_u64h w = ((const tm_u64h*)p.x)[i >> 2];
  tm_f4 r;
  if (p.io_dtype == TM_IO_BF16) {
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
TM_INLINE void tm_store_y(const TrimulParams& p, tm_i64 i, float v) {
  if (p.io_dtype == TM_IO_F32) {
    p.y[i] = v;
  } else {
    ((unsigned short*)p.y)[i] = p.io_dtype == TM_IO_BF16 ? tm_f2bf(v) : tm_f2h(v);
  }
}
