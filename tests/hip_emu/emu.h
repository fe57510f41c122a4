// A CPU stand-in for common/compat.h and hip/mfma.h, so that a HIP kernel body (a header such as
// hip/output_projection.h) compiles as ordinary C++ and runs with one std::thread per GPU lane.
//
// What it models, and nothing more:
// - a block of tm_bdim() threads running one block at a time; tm_sync() is a block barrier;
// - waves of 64 consecutive threads; tm_shfl_xor() exchanges values within a wave, and with an
//   offset below 32 within the lane's 32-lane half only, which then waits for that half alone
//   (on hardware such a shuffle reads only lanes of its own half, so the other half may be
//   elsewhere: the kernels written for 32-lane groups rely on it);
// - tm_mfma_32x32x8_f16() as a wave-wide operation: every lane deposits its registers, the
//   32x32x8 product is formed from the operand table of hip/mfma.h (written here from matrix
//   coordinates to lanes, the direction the ISA guide states it, not copied from the kernel),
//   and each lane takes back its 16 elements;
// - LDS as one static array, filled with NaN before each block so reads of unwritten LDS show.
// It does not model timing, memory ordering beyond the barriers, or lanes diverging at a
// wave-wide operation: a kernel that did that would hang here (the test runner times out).
#pragma once

#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __shared__
#define TM_INLINE inline
#define TM_LAUNCH_BOUNDS(n)
#define TM_LAUNCH_BOUNDS_MIN(n, b)
#define TM_RESTRICT __restrict__

typedef long long tm_i64;
typedef unsigned short tm_half;
typedef _Float16 tm_half4 __attribute__((ext_vector_type(4)));
typedef float tm_float16 __attribute__((ext_vector_type(16)));

// Dynamic shared memory of the block being run (64 KiB, the LDS limit of gfx90a/gfx942).
// C linkage: the kernels declare it inside extern "C" functions.
extern "C" {
alignas(16) float tm_dyn_smem[16384];
}

namespace emu {
struct Lane {
  unsigned tid, bid, bdim;
};
inline thread_local Lane self;

struct Wave {
  std::unique_ptr<std::barrier<>> bar;
  std::unique_ptr<std::barrier<>> half[2];  // the two 32-lane halves
  float xchg[64];
  tm_half4 a[64], b[64];
  tm_float16 c[64];
  float d[32][32];
};
struct Block {
  std::unique_ptr<std::barrier<>> bar;
  std::vector<Wave> waves;
};
inline Block* block = nullptr;

inline Wave& wave() { return block->waves[self.tid / 64]; }
}  // namespace emu

inline unsigned tm_tid() { return emu::self.tid; }
inline unsigned tm_bid() { return emu::self.bid; }
inline unsigned tm_bdim() { return emu::self.bdim; }
inline void tm_sync() { emu::block->bar->arrive_and_wait(); }

inline float tm_shfl_xor(float v, int offset) {
  emu::Wave& w = emu::wave();
  const unsigned lane = tm_tid() % 64;
  std::barrier<>& bar = offset < 32 ? *w.half[lane / 32] : *w.bar;
  w.xchg[lane] = v;
  bar.arrive_and_wait();
  const float r = w.xchg[(lane ^ (unsigned)offset) % 64];
  bar.arrive_and_wait();
  return r;
}
inline float tm_h2f(tm_half h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return (float)f;
}
inline tm_half tm_f2h(float f) {
  const _Float16 h = (_Float16)f;
  tm_half r;
  std::memcpy(&r, &h, 2);
  return r;
}
inline float tm_exp(float x) { return std::exp(x); }
inline float tm_rsqrt(float x) { return 1.0f / std::sqrt(x); }
// The common tail of common/compat.h, mirrored (tests/hip_host.rs checks that every tm_* name
// defined there is defined here too).
typedef struct __attribute__((aligned(16))) {
  unsigned v[4];
} tm_u128;
typedef struct __attribute__((aligned(16))) {
  float v[4];
} tm_f4;
typedef struct __attribute__((aligned(8))) {
  unsigned v[2];
} tm_u64h;
// bf16 is the top half of an f32.
inline float tm_bf2f(unsigned short b) {
  unsigned u = (unsigned)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned tm_f2u(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline unsigned short tm_f2bf(float f) {  // written from the rule (round to nearest even), not copied
  const unsigned u = tm_f2u(f);
  if (std::isnan(f)) return (unsigned short)((u >> 16) | 0x40u);
  const unsigned lower = u & 0xFFFFu, upper = u >> 16;
  const bool up = lower > 0x8000u || (lower == 0x8000u && (upper & 1u));
  return (unsigned short)(upper + (up ? 1u : 0u));
}
inline float tm_lo(unsigned w) { return tm_h2f((unsigned short)(w & 0xFFFFu)); }
inline float tm_hi(unsigned w) { return tm_h2f((unsigned short)(w >> 16)); }
inline unsigned tm_pack2(float lo, float hi) { return (unsigned)tm_f2h(lo) | ((unsigned)tm_f2h(hi) << 16); }
inline float tm_group32_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += tm_shfl_xor(v, o);
  return v;
}
inline float tm_sigmoid(float x) { return 1.0f / (1.0f + tm_exp(-x)); }

inline tm_half4 tm_load_half4(const tm_half* p) {
  if (reinterpret_cast<unsigned long long>(p) % 8 != 0) {
    std::fprintf(stderr, "misaligned 8-byte operand load at %p\n", (const void*)p);
    std::abort();  // the GPU would fault or load the wrong bytes
  }
  tm_half4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The D row of element e of a lane's accumulator (hip/mfma.h's helper; the emulated instruction
// below places D by its own loops, checked against AMD's tables by tests/hip_emu/mfma_layout.cpp).
inline int tm_mfma_d_row(int e, unsigned lane) { return 8 * (e >> 2) + (int)((lane & 63u) >> 5) * 4 + (e & 3); }

// D = A·B + C for the wave, with the layout of hip/mfma.h:
//   A[i][k] in lane i + 32*(k/4), element k%4;   B[k][j] in lane j + 32*(k/4), element k%4;
//   C/D[i][j] in lane j + 32*((i/4)%2), element 4*(i/8) + i%4.
// Products are exact in f32 (f16 x f16) and summed in f32, as the hardware does.
inline tm_float16 tm_mfma_32x32x8_f16(tm_half4 a, tm_half4 b, tm_float16 c) {
  emu::Wave& w = emu::wave();
  const unsigned lane = tm_tid() % 64;
  w.a[lane] = a;
  w.b[lane] = b;
  w.c[lane] = c;
  w.bar->arrive_and_wait();
  if (lane == 0) {  // one lane forms the product for the wave
    float A[32][8], B[8][32];
    for (int i = 0; i < 32; ++i)
      for (int k = 0; k < 8; ++k) A[i][k] = (float)w.a[i + 32 * (k / 4)][k % 4];
    for (int k = 0; k < 8; ++k)
      for (int j = 0; j < 32; ++j) B[k][j] = (float)w.b[j + 32 * (k / 4)][k % 4];
    for (int i = 0; i < 32; ++i)
      for (int j = 0; j < 32; ++j) {
        float s = w.c[j + 32 * ((i / 4) % 2)][4 * (i / 8) + i % 4];
        for (int k = 0; k < 8; ++k) s += A[i][k] * B[k][j];
        w.d[i][j] = s;
      }
  }
  w.bar->arrive_and_wait();
  tm_float16 d;
  int taken = 0;
  for (int i = 0; i < 32; ++i)
    for (int j = 0; j < 32; ++j)
      if ((unsigned)(j + 32 * ((i / 4) % 2)) == lane) {
        d[4 * (i / 8) + i % 4] = w.d[i][j];
        ++taken;
      }
  if (taken != 16) {
    std::fprintf(stderr, "layout table gives lane %u %d elements, not 16\n", lane, taken);
    std::abort();
  }
  w.bar->arrive_and_wait();  // nobody deposits the next operands before every lane has read D
  return d;
}

namespace emu {
inline Block* make_block(unsigned threads) {
  Block* blk = new Block;
  blk->bar = std::make_unique<std::barrier<>>(threads);
  blk->waves.resize((threads + 63) / 64);
  for (unsigned w = 0; w < blk->waves.size(); ++w) {
    const unsigned n = (w + 1) * 64 <= threads ? 64 : threads - w * 64;
    blk->waves[w].bar = std::make_unique<std::barrier<>>(n);
    // Each half's lanes; an empty half gets a barrier nobody waits at.
    blk->waves[w].half[0] = std::make_unique<std::barrier<>>(n < 32 ? n : 32);
    blk->waves[w].half[1] = std::make_unique<std::barrier<>>(n > 32 ? n - 32 : 1);
  }
  return blk;
}

// Runs `kernel()` over `grid` blocks of `threads` lanes, one block at a time, on `threads` host
// threads created once per launch. `after_block(b)` runs on one thread after block b, with every
// lane finished (to inspect LDS, for instance).
template <class F, class G>
void launch(unsigned grid, unsigned threads, F kernel, G after_block) {
  std::barrier<> grid_bar(threads);
  std::unique_ptr<Block> current;
  std::vector<std::thread> lanes;
  lanes.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) {
    lanes.emplace_back([&, t] {
      for (unsigned b = 0; b < grid; ++b) {
        if (t == 0) {
          std::memset(tm_dyn_smem, 0xff, sizeof(tm_dyn_smem));  // NaN: unwritten LDS shows
          current.reset(make_block(threads));
          block = current.get();
        }
        grid_bar.arrive_and_wait();
        self = Lane{t, b, threads};
        kernel();
        // A lane that leaves stops counting at the block's barriers, as a finished GPU lane does.
        current->waves[t / 64].bar->arrive_and_drop();
        current->waves[t / 64].half[(t % 64) / 32]->arrive_and_drop();
        current->bar->arrive_and_drop();
        grid_bar.arrive_and_wait();
        if (t == 0) after_block(b);
      }
    });
  }
  for (auto& l : lanes) l.join();
  block = nullptr;
}

template <class F>
void launch(unsigned grid, unsigned threads, F kernel) {
  launch(grid, threads, kernel, [](unsigned) {});
}

// Runs `kernel` over `grid` blocks of `threads` lanes; true when any block wrote LDS past the
// `smem` bytes the host reserves for it (LDS is filled with 0xff before each block).
template <class F>
bool launch_within_lds(unsigned grid, unsigned threads, size_t smem, F kernel) {
  bool overrun = false;
  launch(grid, threads, kernel, [&](unsigned) {
    const unsigned char* lds = (const unsigned char*)tm_dyn_smem;
    for (size_t i = smem; i < sizeof(tm_dyn_smem); ++i) overrun |= lds[i] != 0xff;
  });
  return overrun;
}
}  // namespace emu
