// Runs the real bodies of the LayerNorm backward kernels of common/backward.h
// (backward_input_norm_grad, backward_output_norm_grad) on the CPU, as wave64 hardware runs them
// (tests/hip_emu/emu.h: 64-lane waves of two 32-lane groups each), and checks dx, dt and the
// column sums against an f64 evaluation of the formulas.
//
// usage: backward_norms BATCH N C H BLOCKS SEED
// Exit status 0 when every check passes; the last line of stdout says why not.
#include "tests/hip_emu/emu.h"
#include "common/backward.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

static bool close(double got, double want, double tol) { return std::fabs(got - want) <= tol * (1.0 + std::fabs(want)); }

int main(int argc, char** argv) {
  if (argc != 7) {
    std::printf("usage: %s BATCH N C H BLOCKS SEED\n", argv[0]);
    return 2;
  }
  const int batch = std::atoi(argv[1]), n = std::atoi(argv[2]), C = std::atoi(argv[3]), H = std::atoi(argv[4]);
  const int blocks = std::atoi(argv[5]);
  std::mt19937_64 rng((uint64_t)std::atoll(argv[6]));
  std::normal_distribution<double> normal(0.0, 1.0);
  const long long n2 = (long long)n * n, M = batch * n2;
  const float eps = 1e-5f;
  const size_t smem_in = TM_BWD_ACC_SMEM(C), smem_out = TM_BWD_T_ACC_SMEM(H);
  if (batch < 1 || n < 1 || C < 1 || H < 1 || blocks < 1 || smem_in > sizeof(tm_dyn_smem) ||
      smem_out > sizeof(tm_dyn_smem)) {
    std::printf("bad arguments\n");
    return 2;
  }
  // A LayerNorm over width W of rows `v` (row-major [M, W] through `at`): the statistics the
  // forward kernels store, (mean, 1/σ) per row.
  auto stats = [&](int W, auto at) {
    std::vector<float> s((size_t)(2 * M));
    for (long long m = 0; m < M; ++m) {
      double mean = 0, var = 0;
      for (int c = 0; c < W; ++c) mean += at(m, c);
      mean /= W;
      for (int c = 0; c < W; ++c) var += (at(m, c) - mean) * (at(m, c) - mean);
      s[2 * m] = (float)mean;
      s[2 * m + 1] = (float)(1.0 / std::sqrt(var / W + eps));
    }
    return s;
  };
  // The backward of one LayerNorm: d_in from d_out (f64), and the column sums of d_out⊙x̂, d_out.
  auto reference = [&](int W, auto x, auto dout, const std::vector<float>& st, const std::vector<float>& gamma,
                       std::vector<double>& din, std::vector<double>& sums) {
    din.assign((size_t)(M * W), 0.0);
    sums.assign((size_t)(2 * W), 0.0);
    for (long long m = 0; m < M; ++m) {
      const double mean = st[2 * m], rstd = st[2 * m + 1];
      double mg = 0, mgh = 0;
      for (int c = 0; c < W; ++c) {
        const double g = dout(m, c) * gamma[c], xh = (x(m, c) - mean) * rstd;
        mg += g;
        mgh += g * xh;
      }
      mg /= W;
      mgh /= W;
      for (int c = 0; c < W; ++c) {
        const double xh = (x(m, c) - mean) * rstd;
        din[m * W + c] = rstd * (dout(m, c) * gamma[c] - mg - xh * mgh);
        sums[c] += dout(m, c) * xh;
        sums[W + c] += dout(m, c);
      }
    }
  };
  auto block_sums = [&](const std::vector<double>& partial, int W, int c) {
    double t = 0;
    for (int b = 0; b < blocks; ++b) t += partial[(size_t)b * 2 * W + c];
    return t;
  };

  // LN_C's backward: dx from dz.
  {
    std::vector<float> x((size_t)(M * C)), dz((size_t)(M * C)), w(C), dx((size_t)(M * C), NAN);
    for (auto& v : x) v = (float)(1.5 + 2.0 * normal(rng));
    for (auto& v : dz) v = (float)normal(rng);
    for (auto& v : w) v = (float)(1.0 + 0.5 * normal(rng));
    const auto st = stats(C, [&](long long m, int c) { return (double)x[m * C + c]; });
    std::vector<double> partial((size_t)blocks * 2 * C, NAN);
    TmBackwardParams p{};
    p.x = x.data();
    p.dz = dz.data();
    p.norm_in_w = w.data();
    p.stats_x = const_cast<float*>(st.data());
    p.dx = dx.data();
    p.partial = partial.data();
    p.rows = M;
    p.n2 = n2;
    p.c = C;
    p.h = H;
    p.blocks = blocks;
    emu::launch(blocks, TM_BWD_THREADS, [&] { backward_input_norm_grad(p); });
    std::vector<double> want, sums;
    reference(C, [&](long long m, int c) { return (double)x[m * C + c]; },
              [&](long long m, int c) { return (double)dz[m * C + c]; }, st, w, want, sums);
    for (long long i = 0; i < M * C; ++i)
      if (!close(dx[i], want[i], 1e-4)) {
        std::printf("input_norm_grad: dx[%lld] = %g, want %g\n", i, dx[i], want[i]);
        return 1;
      }
    for (int c = 0; c < 2 * C; ++c)
      if (!close(block_sums(partial, C, c), sums[c], 1e-4)) {
        std::printf("input_norm_grad: column sum %d = %g, want %g\n", c, block_sums(partial, C, c), sums[c]);
        return 1;
      }
  }

  // LN_H's backward: dt (hidden-major, over t) from du.
  {
    std::vector<float> t((size_t)(M * H)), du((size_t)(M * H)), w(H);
    for (auto& v : t) v = (float)(-1.0 + 3.0 * normal(rng));
    for (auto& v : du) v = (float)normal(rng);
    for (auto& v : w) v = (float)(1.0 + 0.5 * normal(rng));
    auto hidden = [&](long long m, int h) { return (size_t)(((m / n2) * H + h) * n2 + m % n2); };
    const std::vector<float> t0 = t;
    const auto st = stats(H, [&](long long m, int h) { return (double)t0[hidden(m, h)]; });
    std::vector<double> partial((size_t)blocks * 2 * H, NAN);
    TmBackwardParams p{};
    p.t = t.data();
    p.du = du.data();
    p.norm_out_w = w.data();
    p.stats_t = const_cast<float*>(st.data());
    p.partial = partial.data();
    p.rows = M;
    p.n2 = n2;
    p.c = C;
    p.h = H;
    p.blocks = blocks;
    emu::launch(blocks, TM_BWD_THREADS, [&] { backward_output_norm_grad(p); });
    std::vector<double> want, sums;
    reference(H, [&](long long m, int h) { return (double)t0[hidden(m, h)]; },
              [&](long long m, int h) { return (double)du[m * H + h]; }, st, w, want, sums);
    for (long long m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h)
        if (!close(t[hidden(m, h)], want[m * H + h], 1e-4)) {
          std::printf("output_norm_grad: dt[%lld, %d] = %g, want %g\n", m, h, t[hidden(m, h)], want[m * H + h]);
          return 1;
        }
    for (int c = 0; c < 2 * H; ++c)
      if (!close(block_sums(partial, H, c), sums[c], 1e-4)) {
        std::printf("output_norm_grad: column sum %d = %g, want %g\n", c, block_sums(partial, H, c), sums[c]);
        return 1;
      }
  }
  std::printf("ok\n");
  return 0;
}
