// Stage 3c (af3 only), the output-width gate applied after the output projection:
//   y = σ(z·Wgᵀ + bg) ⊙ y        (σ(...) was computed by input_gating and stored as `gate`)
#pragma once

#define OUTPUT_GATE_THREADS 256
static_assert(OUTPUT_GATE_THREADS == TM_STAGE_THREADS, "common/smem.h");

extern "C" __global__ void TM_LAUNCH_BOUNDS(OUTPUT_GATE_THREADS) output_gate(const TmOutputParams p) {
  const tm_i64 start = p.row0 * (tm_i64)p.c;
  const tm_i64 gstart = (p.row0 - p.buf_row0) * (tm_i64)p.c;  // gate holds rows from buf_row0
  const tm_i64 count = p.rows * (tm_i64)p.c;
  const tm_i64 stride = (tm_i64)tm_bdim() * p.gate_blocks;
  for (tm_i64 i = (tm_i64)tm_bid() * tm_bdim() + tm_tid(); i < count; i += stride) {
    p.y[start + i] *= tm_h2f(p.gate[gstart + i]);
  }
}
