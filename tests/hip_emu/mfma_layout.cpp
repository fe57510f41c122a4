// Checks the emulation's v_mfma_f32_32x32x8f16 (tm_mfma_32x32x8_f16 in tests/hip_emu/emu.h)
// against AMD's published register layout of the instruction, which neither the emulation nor the
// kernel was written from: the tables in tests/hip_emu/mfma_tables/ are the output of AMD's Matrix
// Instruction Calculator (see the README there). A layout error shared by the kernel
// (hip/mfma.h's table) and the emulation would let the kernel pass its emulated tests and fail on
// hardware; this program is what catches it.
//
// For each of a few random cases it places integer-valued A (32x8), B (8x32) and C (32x32) in
// the 64 lanes' registers exactly where the published tables say the hardware reads them, runs
// the emulated instruction on one wave, reads D back from where the tables say the hardware
// writes it, and compares with A·B + C computed here directly (all values exact in f16 and f32).
//
// usage: mfma_layout TABLE_DIR ARCH   (ARCH: cdna1, cdna2 or cdna3; reads ARCH_{A,B,C,D}.csv)
// Exit status 0 when every element matches; the last line of stdout says why not.
#include "tests/hip_emu/emu.h"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

// Where one matrix element lives: its (row, column) for each lane and register slot.
struct Slot {
  int row = -1, col = -1;
};

// Reads "lane,slot0,slot1,..." rows of `X[r][c]` entries (the calculator's --csv output); the two
// lines before the header name the architecture and the instruction.
bool read_table(const std::string& path, char matrix, int slots, std::vector<std::vector<Slot>>* table,
                std::string* why) {
  std::ifstream f(path);
  if (!f) {
    *why = "cannot open " + path;
    return false;
  }
  table->assign(64, std::vector<Slot>(slots));
  std::string line;
  int lanes = 0;
  while (std::getline(f, line)) {
    if (line.empty() || line.rfind("lane,", 0) == 0 || line.find(':') != std::string::npos) continue;
    std::stringstream s(line);
    std::string cell;
    std::getline(s, cell, ',');
    const int lane = std::atoi(cell.c_str());
    if (lane < 0 || lane >= 64) {
      *why = path + ": bad lane in '" + line + "'";
      return false;
    }
    for (int k = 0; k < slots; ++k) {
      if (!std::getline(s, cell, ',')) {
        *why = path + ": too few entries in '" + line + "'";
        return false;
      }
      int r = -1, c = -1;
      char m = 0;
      if (std::sscanf(cell.c_str(), "%c[%d][%d]", &m, &r, &c) != 3 || m != matrix) {
        *why = path + ": cannot read '" + cell + "'";
        return false;
      }
      (*table)[lane][k] = Slot{r, c};
    }
    ++lanes;
  }
  if (lanes != 64) {
    *why = path + ": " + std::to_string(lanes) + " lanes, not 64";
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::printf("usage: %s TABLE_DIR ARCH\n", argv[0]);
    return 2;
  }
  const std::string base = std::string(argv[1]) + "/" + argv[2] + "_";
  std::vector<std::vector<Slot>> ta, tb, tc, td;
  std::string why;
  if (!read_table(base + "A.csv", 'A', 4, &ta, &why) || !read_table(base + "B.csv", 'B', 4, &tb, &why) ||
      !read_table(base + "C.csv", 'C', 16, &tc, &why) || !read_table(base + "D.csv", 'D', 16, &td, &why)) {
    std::printf("%s\n", why.c_str());
    return 1;
  }
  // Each table must name every element of its matrix exactly once.
  auto covers = [](const std::vector<std::vector<Slot>>& t, int rows, int cols) {
    std::vector<int> seen(rows * cols, 0);
    for (const auto& lane : t)
      for (const Slot& s : lane) {
        if (s.row < 0 || s.row >= rows || s.col < 0 || s.col >= cols) return false;
        ++seen[s.row * cols + s.col];
      }
    for (int v : seen)
      if (v != 1) return false;
    return true;
  };
  if (!covers(ta, 32, 8) || !covers(tb, 8, 32) || !covers(tc, 32, 32) || !covers(td, 32, 32)) {
    std::printf("a table does not name each element of its matrix exactly once\n");
    return 1;
  }

  std::mt19937_64 rng(20261126);
  std::uniform_int_distribution<int> small(-8, 8), wide(-1000, 1000);
  for (int round = 0; round < 4; ++round) {
    float A[32][8], B[8][32], C[32][32];
    for (auto& r : A)
      for (float& v : r) v = (float)small(rng);
    for (auto& r : B)
      for (float& v : r) v = (float)small(rng);
    for (auto& r : C)
      for (float& v : r) v = (float)wide(rng);
    // Registers per lane, filled from the published tables.
    std::vector<tm_half4> a(64), b(64);
    std::vector<tm_float16> c(64), d(64);
    for (int l = 0; l < 64; ++l) {
      for (int e = 0; e < 4; ++e) {
        a[l][e] = (_Float16)A[ta[l][e].row][ta[l][e].col];
        b[l][e] = (_Float16)B[tb[l][e].row][tb[l][e].col];
      }
      for (int r = 0; r < 16; ++r) c[l][r] = C[tc[l][r].row][tc[l][r].col];
    }
    emu::launch(1, 64, [&] {
      const unsigned l = tm_tid();
      d[l] = tm_mfma_32x32x8_f16(a[l], b[l], c[l]);
    });
    int bad = 0;
    for (int l = 0; l < 64; ++l)
      for (int r = 0; r < 16; ++r) {
        const int i = td[l][r].row, j = td[l][r].col;
        double want = C[i][j];
        for (int k = 0; k < 8; ++k) want += (double)A[i][k] * B[k][j];
        if ((double)d[l][r] != want) {
          if (bad < 5)
            std::printf("round %d: lane %d register %d (D[%d][%d]) holds %g, the published layout gives %g\n",
                        round, l, r, i, j, (double)d[l][r], want);
          ++bad;
        }
      }
    if (bad) {
      std::printf("%d of 1024 elements of D differ from A·B + C under the published layout of %s\n", bad, argv[2]);
      return 1;
    }
  }
  std::printf("%s: the emulation reads A, B, C and writes D where the published layout says (4 random cases)\n",
              argv[2]);
  return 0;
}
