// Runs the real body of hip/output_projection.h on the CPU (tests/hip_emu/emu.h stands in for the
// GPU) and checks every output element against an f64 evaluation of the stage's formula.
//
// usage: output_projection BATCH N H C AF3 BIAS ROW0 ROWS SMEM_BYTES SEED
// SMEM_BYTES is what the Rust host code would pass as dynamic LDS; the run fails if the kernel
// touches LDS beyond it. Exit status 0 when every check passes; the last line of stdout says why not.
#include "tests/hip_emu/emu.h"
#include "tests/hip_emu/harness.h"
#include "hip/output_projection.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>

static tm_half to_half(double v) { return tm_f2h((float)v); }

int main(int argc, char** argv) {
  const emu::Args args(argc, argv, "BATCH N H C AF3 BIAS ROW0 ROWS SMEM_BYTES SEED");
  const int batch = args["BATCH"], n = args["N"], H = args["H"], C = args["C"];
  const int af3 = args["AF3"], with_bias = args["BIAS"];
  const long long row0 = args["ROW0"], rows = args["ROWS"];
  const size_t smem = (size_t)args["SMEM_BYTES"];
  std::mt19937_64 rng((uint64_t)args["SEED"]);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);

  const long long nn = (long long)n * n, M = batch * nn;
  const int G = af3 ? C : H;
  if (row0 < 0 || rows < 1 || row0 + rows > M || smem > sizeof(tm_dyn_smem)) {
    std::printf("bad arguments\n");
    return 2;
  }
  std::vector<tm_half> t((size_t)(M * H)), gate((size_t)(M * G)), wout((size_t)C * H);
  std::vector<float> w(H), b(H), bias(C);
  for (auto& v : t) v = to_half(2.0 + 3.0 * normal(rng));  // an offset, so the mean matters
  for (auto& v : gate) v = to_half(unit(rng));
  for (auto& v : wout) v = to_half(normal(rng) / std::sqrt((double)H));
  for (auto& v : w) v = (float)normal(rng);
  for (auto& v : b) v = (float)normal(rng);
  for (auto& v : bias) v = (float)normal(rng);
  // A NaN with a payload: every element the kernel should not write must keep these bits.
  const uint32_t sentinel_bits = 0x7fc0deadu;
  float sentinel;
  std::memcpy(&sentinel, &sentinel_bits, 4);
  std::vector<float> y((size_t)(M * C), sentinel);

  TmOutputParams p{emu::problem(batch, n, C, H, af3, row0, rows)};
  p.norm_out_w = w.data();
  p.norm_out_b = b.data();
  p.gate = gate.data();
  p.t = t.data();
  p.y = y.data();
  p.w_out = wout.data();
  p.out_bias = with_bias ? bias.data() : nullptr;

  if (!emu::launch_rows_within_lds(rows, OP_BM, OUTPUT_PROJECTION_THREADS, smem, [&] { output_projection(p); })) return 1;

  long long bad = 0, checked = 0;
  double worst = 0.0;
  for (long long row = 0; row < M; ++row) {
    const bool inside = row >= row0 && row < row0 + rows;
    double a[4096];
    if (inside) {
      const long long bb = row / nn, rem = row - bb * nn;
      double mean = 0.0, var = 0.0;
      for (int h = 0; h < H; ++h) mean += tm_h2f(t[(size_t)((bb * H + h) * nn + rem)]);
      mean /= H;
      for (int h = 0; h < H; ++h) {
        const double d = tm_h2f(t[(size_t)((bb * H + h) * nn + rem)]) - mean;
        var += d * d;
      }
      var /= H;
      for (int h = 0; h < H; ++h) {
        const double tv = tm_h2f(t[(size_t)((bb * H + h) * nn + rem)]);
        a[h] = (tv - mean) / std::sqrt(var + 1e-5) * w[h] + b[h];
        if (!af3) a[h] *= tm_h2f(gate[(size_t)(row * G + h)]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const float got = y[(size_t)(row * C + c)];
      uint32_t bits;
      std::memcpy(&bits, &got, 4);
      if (!inside) {
        if (bits != sentinel_bits) {
          if (bad++ < 5) std::printf("row %lld c %d outside the chunk was written\n", row, c);
        }
        continue;
      }
      double acc = 0.0, mag = 0.0;
      for (int h = 0; h < H; ++h) {
        const double term = a[h] * tm_h2f(wout[(size_t)c * H + h]);
        acc += term;
        mag += std::fabs(term);
      }
      double g = 1.0;
      if (with_bias) acc += bias[c];
      if (af3) g = tm_h2f(gate[(size_t)(row * G + c)]);
      const double want = g * acc;
      // a is rounded to f16 (relative error <= 2^-11 per term) and summed in f32.
      const double tol = 1e-3 * g * mag + 1e-5 * (std::fabs(want) + 1.0);
      const double err = std::fabs((double)got - want);
      ++checked;
      if (!(err <= tol)) {  // also catches NaN
        if (bad++ < 5) std::printf("row %lld c %d: got %.7g want %.7g (tol %.3g)\n", row, c, got, want, tol);
      } else if (tol > 0) {
        worst = std::max(worst, err / tol);
      }
    }
  }
  if (bad) {
    std::printf("FAIL: %lld of %lld elements wrong\n", bad, checked + (M - rows) * C);
    return 1;
  }
  std::printf("ok: %lld outputs checked, worst error %.3f of tolerance\n", checked, worst);
  return 0;
}
