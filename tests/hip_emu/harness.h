// What the kernel tests on the emulation (tests/hip_emu/*.cpp) share besides the GPU stand-in of
// emu.h: their command line, and the problem part of the stage kernels' argument.
#pragma once

#include "tests/hip_emu/emu.h"
#include "common/params.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace emu {
// A test's command line: whole numbers named, in order, by its usage line; a bracketed tail is
// optional (all of it or none, 0 when left out). With any other count it prints the usage line and
// exits with status 2.
class Args {
 public:
  Args(int argc, char** argv, const char* usage) {
    std::istringstream words(usage);
    size_t required = 0;
    for (std::string w; words >> w;) {
      if (w.front() == '[') required = names_.size();
      names_.push_back(w.substr(w.front() == '[', w.size() - (w.front() == '[') - (w.back() == ']')));
    }
    if (required == 0) required = names_.size();
    const size_t given = (size_t)argc - 1;
    if (given != required && given != names_.size()) {
      std::printf("usage: %s %s\n", argv[0], usage);
      std::exit(2);
    }
    values_.assign(names_.size(), 0);
    for (size_t i = 0; i < given; ++i) values_[i] = std::atoll(argv[i + 1]);
  }
  // The argument the usage line calls `name`.
  long long operator[](const char* name) const {
    for (size_t i = 0; i < names_.size(); ++i)
      if (names_[i] == name) return values_[i];
    std::fprintf(stderr, "no argument %s in the usage line\n", name);
    std::abort();
  }

 private:
  std::vector<std::string> names_;
  std::vector<long long> values_;
};

// The problem part of an input or output stage's argument: positions [row0, row0 + rows) of
// batch·n·n, widths C and H, the formulation (af3 gates y, C wide; gpumode gates LN_H(t), H wide)
// and the LayerNorm's eps; the rest is zero.
inline TmParams problem(int batch, int n, int C, int H, bool af3, long long row0, long long rows) {
  return TmParams{.row0 = row0, .rows = rows, .batch = batch, .n = n, .c = C, .h = H, .g = af3 ? C : H,
                  .formulation = af3 ? TM_AF3 : TM_GPUMODE, .eps = 1e-5f};
}

// Runs a stage kernel over `rows` positions in blocks of `bm`, the whole grid in one launch as the
// host launches it (tm_bid() > 0 in every block past the first); false, with the reason printed,
// when a block wrote LDS beyond the `smem` bytes the host reserves.
template <class F>
bool launch_rows_within_lds(long long rows, int bm, unsigned threads, size_t smem, F kernel) {
  if (!launch_overruns_lds((unsigned)((rows + bm - 1) / bm), threads, smem, kernel)) return true;
  std::printf("FAIL: the kernel wrote LDS beyond the %zu bytes the host reserves\n", smem);
  return false;
}
}  // namespace emu
