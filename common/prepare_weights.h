// Weight preparation on the device: the caller's weight tensors (each contiguous, row-major, in
// f32, bf16 or f16) converted, scaled and reordered into the buffers the stage kernels read, in
// one launch, with no host copy and no synchronisation. Used when the weights already live on
// the device (a PyTorch model's parameters, GPU MODE's harness); the host path packs the same
// layouts on the CPU (src/backend/params.rs, FusedInputLayout::pack).
//
// Segments, processed one after another by the whole grid (grid-stride over each):
//   TM_SEG_PLAIN    dst[i] = scale * src[i] for i < count (src null: the constant scale, e.g. 0
//                   for an absent bias, 1 for a vector of ones)
//   TM_SEG_FUSED_W  the fused input kernel's weight matrix [4*h_pad + g_pad, k_pad]:
//                   dst[row][k] = 1/2 * W_s[j][k] for k < C, where (s, j) = the section and
//                   channel of `row` (FusedInputLayout::source), else 0
//   TM_SEG_FUSED_B  its bias [4*h_pad + g_pad]: dst[row] = 1/2 * b_s[j] (0 without a bias)
// Sections s = 0..4 are left value, left gate, right value, right gate and output gate.
//
// Destinations are f16 or f32. An f16 destination gets NaN for a value outside f16's range
// (|v| > 65504) rather than infinity: a weight the f16 path cannot hold then makes the result
// NaN, which no check mistakes for a plausible answer.
#pragma once

#define TM_PREP_MAX_SEGMENTS 24
#define TM_PREP_THREADS 256
#define TM_SEG_PLAIN 0
#define TM_SEG_FUSED_W 1
#define TM_SEG_FUSED_B 2

typedef struct TmPrepSegment {
  const void* src;
  void* dst;
  tm_i64 count;   // destination elements
  int kind;       // TM_SEG_*
  int src_dtype;  // TM_IO_F32, TM_IO_BF16 or TM_IO_F16 (plain segments)
  int dst_f16;    // 1: f16 destination, 0: f32
  float scale;    // plain segments: the factor, or the value itself without a source
} TmPrepSegment;

// Mirrored by `PrepareParams` in src/backend/params.rs (#[repr(C)], size-asserted on both sides).
typedef struct TmPrepareParams {
  TmPrepSegment seg[TM_PREP_MAX_SEGMENTS];
  const void* fused_src[5];   // the five input linears' weights, [out, C] each
  const void* fused_bias[5];  // their biases [out], or null
  int fused_dtype[5];
  int fused_bias_dtype[5];
  int segments;
  int grid;  // blocks in the launch (the grid stride)
  int c, h, g, k_pad, h_pad, g_pad;
} TmPrepareParams;

#if defined(__cplusplus) && __cplusplus >= 201103L
static_assert(sizeof(TmPrepareParams) == 1112, "TmPrepareParams layout must match src/backend/params.rs");
#endif

TM_INLINE float prep_load(const void* src, tm_i64 i, int dtype) {
  if (dtype == TM_IO_F32) return ((const float*)src)[i];
  const unsigned short b = ((const unsigned short*)src)[i];
  return dtype == TM_IO_BF16 ? tm_bf2f(b) : tm_h2f(b);
}

TM_INLINE void prep_store(void* dst, tm_i64 i, int dst_f16, float v) {
  if (dst_f16) {
    // NaN stays NaN; anything beyond f16's largest finite value becomes NaN too.
    if (!(v <= 65504.f && v >= -65504.f)) v = tm_bf2f(0x7FC0);  // a quiet NaN
    ((tm_half*)dst)[i] = tm_f2h(v);
  } else {
    ((float*)dst)[i] = v;
  }
}

// Section and channel of fused row `row` (FusedInputLayout::source): -1 for a padding row.
TM_INLINE int prep_fused_source(const TmPrepareParams& p, int row, int* index) {
  if (row < 4 * p.h_pad) {
    const int within = row % 32;
    const int channel = (row / 32) * 8 + within % 8;
    *index = channel;
    return channel < p.h ? within / 8 : -1;
  }
  const int gi = row - 4 * p.h_pad;
  *index = gi;
  return gi < p.g ? 4 : -1;
}

extern "C" __global__ void TM_LAUNCH_BOUNDS(TM_PREP_THREADS) prepare_weights(const TmPrepareParams p) {
  const tm_i64 stride = (tm_i64)p.grid * tm_bdim();
  const tm_i64 first = (tm_i64)tm_bid() * tm_bdim() + tm_tid();
  for (int s = 0; s < p.segments; ++s) {
    const TmPrepSegment sg = p.seg[s];
    for (tm_i64 i = first; i < sg.count; i += stride) {
      float v = 0.f;
      if (sg.kind == TM_SEG_PLAIN) {
        v = sg.src ? sg.scale * prep_load(sg.src, i, sg.src_dtype) : sg.scale;
      } else if (sg.kind == TM_SEG_FUSED_W) {
        const int row = (int)(i / p.k_pad), k = (int)(i % p.k_pad);
        int index = 0;
        const int section = prep_fused_source(p, row, &index);
        if (section >= 0 && k < p.c) {
          v = 0.5f * prep_load(p.fused_src[section], (tm_i64)index * p.c + k, p.fused_dtype[section]);
        }
      } else {
        int index = 0;
        const int section = prep_fused_source(p, (int)i, &index);
        if (section >= 0 && p.fused_bias[section]) {
          v = 0.5f * prep_load(p.fused_bias[section], index, p.fused_bias_dtype[section]);
        }
      }
      prep_store(sg.dst, i, sg.dst_f16, v);
    }
  }
}
