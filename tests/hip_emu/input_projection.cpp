// Runs the real body of hip/input_projection.h on the CPU (tests/hip_emu/emu.h stands in for the
// GPU) and checks every element of left, right and the gate against an f64 evaluation of the
// stage's formula: z = LN_C(x) (rounded to f16, as the kernel keeps it), the five projections of
// z, bias, σ, mask and products. Elements outside the launched positions, and those of work items
// or channels the launch leaves out, must keep their sentinel.
//
// usage: input_projection BATCH N C H AF3 BIAS MASK IO ROW0 ROWS SEED [LR_H0 LR_H BEGIN END]
// (IO: 0 f32, 1 bf16, 2 f16 x; the optional four: left/right hold channels LR_H0 .. LR_H0 + LR_H
// (LR_H 0: all), and the launch runs work items BEGIN .. END (END 0: all), as a chunked plan's
// hidden and gate passes do). Exit status 0 when every check passes; the last line of stdout says
// why not.
#include "tests/hip_emu/emu.h"
#include "tests/hip_emu/harness.h"
#include "hip/input_projection.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>

static double h2d(tm_half h) { return (double)tm_h2f(h); }

int main(int argc, char** argv) {
  const emu::Args args(argc, argv, "BATCH N C H AF3 BIAS MASK IO ROW0 ROWS SEED [LR_H0 LR_H BEGIN END]");
  const int lr_h0 = args["LR_H0"], lr_h = args["LR_H"], begin = args["BEGIN"], end = args["END"];
  const int batch = args["BATCH"], n = args["N"], C = args["C"], H = args["H"];
  const int af3 = args["AF3"], with_bias = args["BIAS"], masked = args["MASK"];
  const int io = args["IO"];
  const long long row0 = args["ROW0"], rows = args["ROWS"];
  std::mt19937_64 rng((uint64_t)args["SEED"]);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);

  const long long nn = (long long)n * n, M = batch * nn;
  const int G = af3 ? C : H, P = 4 * H + G;
  const size_t smem = (size_t)TM_HIP_IP_SMEM(C);
  const int hidden_items = (H + 31) / 32, items = hidden_items + (G + 31) / 32;
  const int LH = lr_h > 0 ? lr_h : H, L0 = lr_h > 0 ? lr_h0 : 0, item_end = end > 0 ? end : items;
  if (row0 < 0 || rows < 1 || row0 + rows > M || C % 4 || smem > sizeof(tm_dyn_smem) || io < 0 || io > 2 ||
      L0 < 0 || L0 + LH > H || begin < 0 || begin >= item_end || item_end > items) {
    std::printf("bad arguments\n");
    return 2;
  }
  // Whether the launch computes hidden channel h (of the window) and gate column g.
  auto hidden_run = [&](int h) { return h / 32 >= begin && h / 32 < item_end; };
  auto gate_run = [&](int g) { return hidden_items + g / 32 >= begin && hidden_items + g / 32 < item_end; };
  // x in its I/O precision, and the values the kernel reads from it.
  std::vector<float> xf((size_t)(M * C)), xv((size_t)(M * C));
  std::vector<unsigned short> xh((size_t)(M * C));
  for (size_t i = 0; i < xf.size(); ++i) {
    const float v = (float)(0.5 + 2.0 * normal(rng));  // an offset, so the mean matters
    if (io == TM_IO_F32) {
      xf[i] = xv[i] = v;
    } else {
      xh[i] = io == TM_IO_BF16 ? tm_f2bf(v) : tm_f2h(v);
      xv[i] = io == TM_IO_BF16 ? tm_bf2f(xh[i]) : tm_h2f(xh[i]);
    }
  }
  std::vector<float> nw(C), nb(C), bias(P), mask(M);
  std::vector<tm_half> w((size_t)P * C);
  for (auto& v : nw) v = (float)(1.0 + 0.3 * normal(rng));
  for (auto& v : nb) v = (float)(0.3 * normal(rng));
  for (auto& v : bias) v = (float)(0.5 * normal(rng));
  for (auto& v : mask) v = unit(rng) < 0.3 ? 0.f : 1.f;
  for (auto& v : w) v = tm_f2h((float)(normal(rng) / std::sqrt((double)C)));
  // Sentinels: a NaN pattern no f16 result of the kernel has.
  const tm_half sentinel = 0x7e5a;
  // left/right with a guard band of one channel plane on each side: a write past the window
  // lands on sentinels there, not outside the vectors.
  const size_t guard = (size_t)nn * batch;
  std::vector<tm_half> left_all((size_t)(M * LH) + 2 * guard, sentinel), right_all(left_all);
  tm_half* left = left_all.data() + guard;
  tm_half* right = right_all.data() + guard;
  // The gate holds the positions from buf_row0 (the launch's first row here, as a row chunk's).
  const long long buf_row0 = row0;
  std::vector<tm_half> gate((size_t)(rows * G), sentinel);

  TmInputParams p{emu::problem(batch, n, C, H, af3, row0, rows)};
  p.x = io == TM_IO_F32 ? xf.data() : (const float*)xh.data();
  p.io_dtype = io;
  p.mask = masked ? mask.data() : nullptr;
  p.norm_in_w = nw.data();
  p.norm_in_b = nb.data();
  p.w_in = w.data();
  p.proj_bias = with_bias ? bias.data() : nullptr;
  p.left = left;
  p.right = right;
  p.gate = gate.data();
  p.buf_row0 = buf_row0;
  p.lr_h0 = lr_h0;
  p.lr_h = lr_h;
  p.chunk_begin = begin;
  p.chunk_end = end;

  if (!emu::launch_rows_within_lds(rows, IP_BM, INPUT_PROJECTION_THREADS, smem, [&] { input_projection(p); })) return 1;

  long long bad = 0, checked = 0;
  double worst = 0.0;
  auto check = [&](const char* what, long long row, int col, tm_half got, double want, double mag) {
    // z is f16 (relative error <= 2^-11 per term), the sums f32, the result rounded to f16.
    const double tol = 1.5e-3 * mag + 1e-3 * std::fabs(want) + 1e-6;
    const double err = std::fabs(h2d(got) - want);
    ++checked;
    if (!(err <= tol)) {  // also catches NaN and the sentinel
      if (bad++ < 5) std::printf("%s row %lld col %d: got %.6g want %.6g (tol %.3g)\n", what, row, col, h2d(got), want, tol);
    } else {
      worst = std::max(worst, err / tol);
    }
  };
  std::vector<double> z(C), pr(P), mag(P);
  for (long long row = 0; row < M; ++row) {
    const long long bb = row / nn, rem = row - bb * nn;
    const bool inside = row >= row0 && row < row0 + rows;
    // Channel h of the window, at its place in left/right.
    auto lr_at = [&](int h) { return (size_t)((bb * LH + (h - L0)) * nn + rem); };
    auto untouched = [&](const char* what, int col, tm_half a, tm_half b) {
      if ((a != sentinel || b != sentinel) && bad++ < 5)
        std::printf("row %lld %s %d outside the launch was written\n", row, what, col);
    };
    if (!inside) {
      for (int h = L0; h < L0 + LH; ++h) untouched("h", h, left[lr_at(h)], right[lr_at(h)]);
      continue;
    }
    double mean = 0.0, var = 0.0;
    for (int c = 0; c < C; ++c) mean += xv[(size_t)(row * C + c)];
    mean /= C;
    for (int c = 0; c < C; ++c) {
      const double d = xv[(size_t)(row * C + c)] - mean;
      var += d * d;
    }
    var /= C;
    for (int c = 0; c < C; ++c) {
      const double v = (xv[(size_t)(row * C + c)] - mean) / std::sqrt(var + 1e-5) * nw[c] + nb[c];
      z[c] = h2d(tm_f2h((float)v));
    }
    for (int q = 0; q < P; ++q) {
      double acc = with_bias ? bias[q] : 0.0, m = std::fabs(acc);
      for (int c = 0; c < C; ++c) {
        const double t = z[c] * h2d(w[(size_t)q * C + c]);
        acc += t;
        m += std::fabs(t);
      }
      pr[q] = acc;
      mag[q] = m;
    }
    const double mk = masked ? mask[row] : 1.0;
    auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
    for (int h = L0; h < L0 + LH; ++h) {
      const size_t at = lr_at(h);
      if (!hidden_run(h)) {
        untouched("h", h, left[at], right[at]);
        continue;
      }
      // d(lp·σ(lg)) is bounded by |lp|·|dlg|/4 + σ·|dlp|: the magnitudes of both sums.
      const double sl = sig(pr[H + h]), sr = sig(pr[3 * H + h]);
      check("left", row, h, left[at], pr[h] * mk * sl, mk * (mag[h] * sl + std::fabs(pr[h]) * mag[H + h] / 4));
      check("right", row, h, right[at], pr[2 * H + h] * mk * sr,
            mk * (mag[2 * H + h] * sr + std::fabs(pr[2 * H + h]) * mag[3 * H + h] / 4));
    }
    for (int g = 0; g < G; ++g) {
      if (!gate_run(g)) {
        const tm_half v = gate[(size_t)((row - buf_row0) * G + g)];
        untouched("gate column", g, v, v);
        continue;
      }
      const double s = sig(pr[4 * H + g]);
      check("gate", row, g, gate[(size_t)((row - buf_row0) * G + g)], s, s * (1 - s) * mag[4 * H + g]);
    }
  }
  for (size_t i = 0; i < guard; ++i) {
    const size_t hi = left_all.size() - 1 - i;
    if ((left_all[i] != sentinel || right_all[i] != sentinel || left_all[hi] != sentinel ||
         right_all[hi] != sentinel) &&
        bad++ < 5)
      std::printf("a write landed outside left/right's window of channels\n");
  }
  if (bad) {
    std::printf("FAIL: %lld of %lld elements wrong\n", bad, checked);
    return 1;
  }
  std::printf("ok: %lld elements within tolerance (worst at %.2f of it)\n", checked, worst);
  return 0;
}
