// Runs the real bodies of the backward kernels of common/backward.h on the CPU, as wave64
// hardware runs them (tests/hip_emu/emu.h: 64-lane waves of two 32-lane groups each), and checks
// every output against an f64 evaluation of the kernel's formula (the comment at the top of
// common/backward.h), one kernel at a time on random inputs.
//
// usage: backward BATCH N C H BLOCKS AF3 SEED
// BLOCKS is the grid of the LayerNorm backward kernels, which loop over positions. Exit status 0
// when every check passes; the last line of stdout says why not.
#include "tests/hip_emu/emu.h"
#include "tests/hip_emu/harness.h"
#include "common/backward.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

static bool close(double got, double want, double tol) { return std::fabs(got - want) <= tol * (1.0 + std::fabs(want)); }

int main(int argc, char** argv) {
  const emu::Args args(argc, argv, "BATCH N C H BLOCKS AF3 SEED");
  const int batch = args["BATCH"], n = args["N"], C = args["C"], H = args["H"];
  const int blocks = args["BLOCKS"], af3 = args["AF3"];
  std::mt19937_64 rng((uint64_t)args["SEED"]);
  std::normal_distribution<double> normal(0.0, 1.0);
  const long long n2 = (long long)n * n, M = batch * n2;
  const float eps = 1e-5f;
  const size_t smem_in = TM_BWD_ACC_SMEM(C), smem_out = TM_BWD_T_ACC_SMEM(H);
  const int G = af3 ? C : H, F = 4 * H + G;
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  // offset + scale·N(0, 1) in every element.
  auto fill = [&](std::vector<float>& v, double offset, double scale) {
    for (auto& e : v) e = (float)(offset + scale * normal(rng));
  };
  auto hidden = [&](long long m, int h) { return (size_t)(((m / n2) * H + h) * n2 + m % n2); };
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  auto fail = [](const char* what, long long i, double got, double want) {
    std::printf("%s[%lld] = %g, want %g\n", what, i, got, want);
    return 1;
  };
  // P [M, F], its bias, and a 0/1 mask: the projections the gating kernels read.
  std::vector<float> P((size_t)(M * F)), pbias(F), mask((size_t)M);
  fill(P, 0.0, 2.0);
  fill(pbias, 0.0, 0.5);
  for (auto& v : mask) v = unit(rng) < 0.8 ? 1.f : 0.f;
  auto pb = [&](long long m, int col) { return (double)P[m * F + col] + pbias[col]; };
  // The kernels' argument with this problem's sizes; each check sets the tensors it uses, and the
  // others stay null, so that a kernel reading one it should not crashes the check.
  auto base = [&] {
    return TmBackwardParams{.rows = M, .n2 = n2, .c = C, .h = H, .f = F, .af3 = af3, .eps = eps, .blocks = blocks};
  };
  // The same with the projections P and their bias, and the mask where the kernel applies it.
  auto projected = [&](bool masked) {
    TmBackwardParams q = base();
    q.p = P.data();
    q.proj_bias = pbias.data();
    q.mask = masked ? mask.data() : nullptr;
    return q;
  };
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
  // Whether a LayerNorm backward kernel's 2W column sums, over the blocks' partial sums, match
  // the reference's (else says which does not).
  auto column_sums_match = [&](const char* what, const std::vector<double>& partial, int W,
                               const std::vector<double>& sums) {
    for (int c = 0; c < 2 * W; ++c) {
      double t = 0;
      for (int b = 0; b < blocks; ++b) t += partial[(size_t)b * 2 * W + c];
      if (!close(t, sums[c], 1e-4)) {
        std::printf("%s: column sum %d = %g, want %g\n", what, c, t, sums[c]);
        return false;
      }
    }
    return true;
  };
  // Blocks of `per` that cover `count` items.
  auto grid = [](long long count, long long per) { return (unsigned)((count + per - 1) / per); };

  // LN_C's backward: dx from dz.
  {
    std::vector<float> x((size_t)(M * C)), dz((size_t)(M * C)), w(C), dx((size_t)(M * C), NAN);
    fill(x, 1.5, 2.0);
    fill(dz, 0.0, 1.0);
    fill(w, 1.0, 0.5);
    const auto st = stats(C, [&](long long m, int c) { return (double)x[m * C + c]; });
    std::vector<double> partial((size_t)blocks * 2 * C, NAN);
    TmBackwardParams p = base();
    p.x = x.data();
    p.dz = dz.data();
    p.norm_in_w = w.data();
    p.stats_x = const_cast<float*>(st.data());
    p.dx = dx.data();
    p.partial = partial.data();
    emu::launch(blocks, TM_BWD_THREADS, [&] { backward_input_norm_grad(p); });
    std::vector<double> want, sums;
    reference(C, [&](long long m, int c) { return (double)x[m * C + c]; },
              [&](long long m, int c) { return (double)dz[m * C + c]; }, st, w, want, sums);
    for (long long i = 0; i < M * C; ++i)
      if (!close(dx[i], want[i], 1e-4)) {
        std::printf("input_norm_grad: dx[%lld] = %g, want %g\n", i, dx[i], want[i]);
        return 1;
      }
    if (!column_sums_match("input_norm_grad", partial, C, sums)) return 1;
  }

  // LN_H's backward: dt (hidden-major, over t) from du.
  {
    std::vector<float> t((size_t)(M * H)), du((size_t)(M * H)), w(H);
    fill(t, -1.0, 3.0);
    fill(du, 0.0, 1.0);
    fill(w, 1.0, 0.5);
    const std::vector<float> t0 = t;
    const auto st = stats(H, [&](long long m, int h) { return (double)t0[hidden(m, h)]; });
    std::vector<double> partial((size_t)blocks * 2 * H, NAN);
    TmBackwardParams p = base();
    p.t = t.data();
    p.du = du.data();
    p.norm_out_w = w.data();
    p.stats_t = const_cast<float*>(st.data());
    p.partial = partial.data();
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
    if (!column_sums_match("output_norm_grad", partial, H, sums)) return 1;
  }
  // LN_C forward: z and its statistics.
  {
    std::vector<float> x((size_t)(M * C)), w(C), b(C), z((size_t)(M * C), NAN), st((size_t)(2 * M), NAN);
    fill(x, 1.5, 2.0);
    fill(w, 1.0, 0.5);
    fill(b, 0.0, 1.0);
    TmBackwardParams p = base();
    p.x = x.data();
    p.norm_in_w = w.data();
    p.norm_in_b = b.data();
    p.z = z.data();
    p.stats_x = st.data();
    emu::launch(grid(M, TM_BWD_ROWS_PER_BLOCK), TM_BWD_THREADS, [&] { backward_input_norm(p); });
    const auto want = stats(C, [&](long long m, int c) { return (double)x[m * C + c]; });
    for (long long m = 0; m < M; ++m) {
      for (int k = 0; k < 2; ++k)
        if (!close(st[2 * m + k], want[2 * m + k], 1e-4)) return fail("input_norm stats", 2 * m + k, st[2 * m + k], want[2 * m + k]);
      for (int c = 0; c < C; ++c) {
        const double zw = (x[m * C + c] - (double)want[2 * m]) * want[2 * m + 1] * w[c] + b[c];
        if (!close(z[m * C + c], zw, 1e-4)) return fail("input_norm z", m * C + c, z[m * C + c], zw);
      }
    }
  }

  // The gated projections: left and right (hidden-major) from P, its bias and the mask.
  {
    std::vector<float> left((size_t)(M * H), NAN), right((size_t)(M * H), NAN);
    TmBackwardParams p = projected(true);
    p.left = left.data();
    p.right = right.data();
    emu::launch(grid(M, TM_BWD_TILE), TM_BWD_THREADS, [&] { backward_gating(p); });
    for (long long m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h) {
        const double l = pb(m, h) * sig(pb(m, H + h)) * mask[m], r = pb(m, 2 * H + h) * sig(pb(m, 3 * H + h)) * mask[m];
        if (!close(left[hidden(m, h)], l, 1e-4)) return fail("gating left", m * H + h, left[hidden(m, h)], l);
        if (!close(right[hidden(m, h)], r, 1e-4)) return fail("gating right", m * H + h, right[hidden(m, h)], r);
      }
  }

  // LN_H forward: u, its statistics, and gpumode's v = u⊙σ(P_G).
  {
    std::vector<float> t((size_t)(M * H)), w(H), b(H), u((size_t)(M * H), NAN), e((size_t)(M * H), NAN),
        st((size_t)(2 * M), NAN);
    fill(t, -1.0, 3.0);
    fill(w, 1.0, 0.5);
    fill(b, 0.0, 1.0);
    TmBackwardParams p = projected(false);
    p.t = t.data();
    p.norm_out_w = w.data();
    p.norm_out_b = b.data();
    p.u = u.data();
    p.e = e.data();
    p.stats_t = st.data();
    emu::launch(grid(M, TM_BWD_TILE), TM_BWD_THREADS, [&] { backward_output_norm(p); });
    const auto want = stats(H, [&](long long m, int h) { return (double)t[hidden(m, h)]; });
    for (long long m = 0; m < M; ++m) {
      for (int k = 0; k < 2; ++k)
        if (!close(st[2 * m + k], want[2 * m + k], 1e-4)) return fail("output_norm stats", 2 * m + k, st[2 * m + k], want[2 * m + k]);
      for (int h = 0; h < H; ++h) {
        const double uw = (t[hidden(m, h)] - (double)want[2 * m]) * want[2 * m + 1] * w[h] + b[h];
        if (!close(u[m * H + h], uw, 1e-4)) return fail("output_norm u", m * H + h, u[m * H + h], uw);
        const double vw = uw * sig(pb(m, 4 * H + h));
        if (!af3 && !close(e[m * H + h], vw, 1e-4)) return fail("output_norm v", m * H + h, e[m * H + h], vw);
      }
    }
  }

  // The output gate's backward: af3 ds and dG from dy and s; gpumode du and dG from dv and u.
  {
    std::vector<float> dy((size_t)(M * C)), e((size_t)(M * G)), u((size_t)(M * H)), du((size_t)(M * H)),
        obias(C), dcat((size_t)(M * F), NAN);
    fill(dy, 0.0, 1.0);
    fill(e, 0.0, 1.0);
    fill(u, 0.0, 1.0);
    fill(du, 0.0, 1.0);
    fill(obias, 0.0, 1.0);
    const std::vector<float> e0 = e, du0 = du;
    TmBackwardParams p = projected(false);
    p.dy = dy.data();
    p.e = e.data();
    p.u = u.data();
    p.du = du.data();
    p.out_bias = obias.data();
    p.dcat = dcat.data();
    emu::launch(grid(M * G, TM_BWD_THREADS), TM_BWD_THREADS, [&] { backward_output_gate(p); });
    for (long long m = 0; m < M; ++m)
      for (int col = 0; col < G; ++col) {
        const long long i = m * G + col;
        const double g = sig(pb(m, 4 * H + col));
        const double d = af3 ? dy[i] : du0[i], s = af3 ? e0[i] + (double)obias[col] : u[i];
        const double dd = d * g, dg = d * s * g * (1.0 - g);
        const double got = af3 ? e[i] : du[i];
        if (!close(got, dd, 1e-4)) return fail(af3 ? "output_gate ds" : "output_gate du", i, got, dd);
        if (!close(dcat[m * F + 4 * H + col], dg, 1e-4)) return fail("output_gate dG", i, dcat[m * F + 4 * H + col], dg);
      }
  }

  // The gated projections' backward: dcat's first 4H columns from dleft, dright and P.
  {
    std::vector<float> dl((size_t)(M * H)), dr((size_t)(M * H)), dcat((size_t)(M * F), NAN);
    fill(dl, 0.0, 1.0);
    fill(dr, 0.0, 1.0);
    TmBackwardParams p = projected(true);
    p.left = dl.data();
    p.right = dr.data();
    p.dcat = dcat.data();
    emu::launch(grid(M, TM_BWD_TILE), TM_BWD_THREADS, [&] { backward_gating_grad(p); });
    for (long long m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h)
        for (int side = 0; side < 2; ++side) {
          const double d = (side ? dr : dl)[hidden(m, h)] * (double)mask[m];
          const int cv = 2 * side * H + h, cg = cv + H;
          const double sg = sig(pb(m, cg)), want_v = d * sg, want_g = d * pb(m, cv) * sg * (1.0 - sg);
          if (!close(dcat[m * F + cv], want_v, 1e-4)) return fail("gating_grad dp", m * F + cv, dcat[m * F + cv], want_v);
          if (!close(dcat[m * F + cg], want_g, 1e-4)) return fail("gating_grad dq", m * F + cg, dcat[m * F + cg], want_g);
        }
  }

  // Column sums of P's columns (a leading dimension wider than the columns summed) in two passes.
  {
    const int cols = F - 3, row_blocks = 3, chunks = (int)grid(cols, 32);
    std::vector<double> partial((size_t)row_blocks * cols, NAN);
    std::vector<float> out(cols, NAN);
    TmColumnSums s{};
    s.a = P.data();
    s.partial = partial.data();
    s.out = out.data();
    s.rows = M;
    s.cols = cols;
    s.ld = F;
    s.row_blocks = row_blocks;
    emu::launch((unsigned)(row_blocks * chunks), TM_BWD_THREADS, [&] { backward_column_partials(s); });
    emu::launch(grid(cols, TM_BWD_THREADS), TM_BWD_THREADS, [&] { backward_column_finish(s); });
    for (int col = 0; col < cols; ++col) {
      double want = 0;
      for (long long m = 0; m < M; ++m) want += P[m * F + col];
      if (!close(out[col], want, 1e-5)) return fail("column sums", col, out[col], want);
    }
  }

  // Between precisions: f16 to f32 and to bf16 (the weights), bf16 and f16 to f32 (gpumode's dy),
  // f32 to bf16 and f16 (rounded to nearest even).
  {
    std::vector<float> src(1000);
    fill(src, 0.0, 3.0);
    std::vector<unsigned short> h16(src.size()), b16(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      h16[i] = tm_f2h(src[i]);
      b16[i] = tm_f2bf(src[i]);
    }
    auto decode = [](int t, const void* a, size_t i) {
      return t == TM_IO_F32 ? (double)((const float*)a)[i]
             : t == TM_IO_BF16 ? (double)tm_bf2f(((const unsigned short*)a)[i])
                               : (double)tm_h2f(((const unsigned short*)a)[i]);
    };
    const void* from_data[3] = {src.data(), b16.data(), h16.data()};
    for (int from = TM_IO_F32; from <= TM_IO_F16; ++from)
      for (int to = TM_IO_F32; to <= TM_IO_F16; ++to) {
        std::vector<float> out(src.size(), NAN);  // room for either width
        TmConvert w{from_data[from], out.data(), (tm_i64)src.size(), from, to};
        emu::launch(grid((long long)src.size(), TM_BWD_THREADS), TM_BWD_THREADS, [&] { backward_convert(w); });
        for (size_t i = 0; i < src.size(); ++i) {
          const double v = decode(from, from_data[from], i);
          // The value rounded once to `to`, as the host rounds it.
          const double want = to == TM_IO_F32 ? (double)(float)v
                              : to == TM_IO_BF16 ? (double)tm_bf2f(tm_f2bf((float)v))
                                                 : (double)tm_h2f(tm_f2h((float)v));
          const double got = decode(to, out.data(), i);
          if (got != want) return fail("convert", (long long)(from * 3 + to) * 100000 + (long long)i, got, want);
        }
      }
  }

  std::printf("ok\n");
  return 0;
}
