// A CPU stand-in for common/compat.h and hip/mfma.h, so that a HIP kernel body (a header such as
// hip/output_projection.h) compiles as ordinary C++ and runs with one fiber per GPU lane.
//
// What it models, and nothing more:
// - a block of tm_bdim() lanes, one block at a time on each host thread; tm_sync() is a block
//   barrier;
// - waves of 64 consecutive lanes; tm_shfl_xor() exchanges values within a wave, and with an
//   offset below 32 within the lane's 32-lane half only, which then waits for that half alone
//   (on hardware such a shuffle reads only lanes of its own half, so the other half may be
//   elsewhere: the kernels written for 32-lane groups rely on it);
// - tm_mfma_32x32x8_f16() as a wave-wide operation: every lane deposits its registers, the
//   32x32x8 product is formed from the operand table of hip/mfma.h (written here from matrix
//   coordinates to lanes, the direction the ISA guide states it, not copied from the kernel),
//   and each lane takes back its 16 elements;
// - LDS as one array per host thread, filled with NaN before each block so reads of unwritten LDS
//   show.
// Lanes are fibers (user-level contexts with stacks of their own) on the host thread that runs the
// block: a lane runs until it waits at a barrier, then the next lane runs. That costs a register
// switch, not a kernel round trip as with a host thread per lane, so the fake ROCm runs whole
// forwards in seconds. It does not model timing, memory ordering beyond the barriers, or lanes
// diverging at a wave-wide operation. Divergence that leaves every lane waiting at a barrier no
// other lane will reach is detected and ends the process with a message; lanes that meet at the
// same wave barrier from different operations (a shuffle and an MFMA) are not detected.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#define __global__
#define __device__
// Dynamic LDS is declared `extern __shared__` inside the kernels: one array per host thread here,
// so that blocks can run on several host threads at once (see emu::launch).
#define __shared__ thread_local
#define TM_INLINE inline
#define TM_LAUNCH_BOUNDS(n)
#define TM_LAUNCH_BOUNDS_MIN(n, b)
#define TM_RESTRICT __restrict__

#include "common/storage_types.h"  // tm_i64, tm_half, tm_u128, tm_f4 and tm_u64h, as the kernels have them

typedef _Float16 tm_half4 __attribute__((ext_vector_type(4)));
typedef float tm_float16 __attribute__((ext_vector_type(16)));

// Dynamic shared memory of the block being run on this host thread (64 KiB, the LDS limit of
// gfx90a/gfx942). C linkage: the kernels declare it inside extern "C" functions.
extern "C" {
alignas(16) thread_local float tm_dyn_smem[16384];
}

namespace emu {
struct Lane {
  unsigned tid, bid, bdim;
};
inline thread_local Lane self;

// ---- Fibers: one per lane of the block, all on one host thread. ----

constexpr size_t kStackBytes = 256 << 10;  // per lane; the kernels' frames are a few KiB
constexpr size_t kGuardBytes = 64 << 10;   // unmapped below each stack: an overflow faults

#if defined(__x86_64__)
// Saves the callee-saved registers and the stack pointer of the running context in *from and
// resumes the context whose stack pointer is `to` (System V: rbx, rbp, r12-r15 survive calls).
__attribute__((naked, noinline)) static void switch_stack(void** /*from*/, void* /*to*/) {
  asm volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
struct Context {
  void* sp = nullptr;
};
// A fresh context that starts in `entry` on the stack ending at `top` (16-byte aligned): the six
// registers switch_stack pops, then `entry` as the return address, so that `entry` starts with
// its stack aligned as after a call.
inline void make_context(Context& c, char* top, void (*entry)()) {
  void** sp = (void**)(top - 64);
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  sp[6] = (void*)entry;
  c.sp = sp;
}
inline void switch_context(Context& from, Context& to) { switch_stack(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};
inline void make_context(Context& c, char* top, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = top - kStackBytes;
  c.uc.uc_stack.ss_size = kStackBytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

struct Fiber {
  Context ctx;
  Lane lane;
  bool done;
};

// The lanes of the block this host thread runs, and the launcher's own context.
struct Scheduler {
  std::vector<Fiber> fibers;
  Context launcher;
  unsigned current = 0, live = 0;
  // Barrier arrivals and finished lanes so far; a full round of switches without any means every
  // lane waits for one that never comes.
  unsigned long long progress = 0, last_progress = 0;
  size_t idle_switches = 0;
  void (*body)(const void*) = nullptr;
  const void* kernel = nullptr;
};
inline thread_local Scheduler* scheduler = nullptr;

[[noreturn]] inline void deadlock() {
  std::fprintf(stderr,
               "emu: every lane of block %u waits at a barrier no other lane will reach (lanes diverged at a "
               "barrier or wave-wide operation)\n",
               self.bid);
  std::abort();
}

// Runs the next lane that has not finished (the same one when it is the only one).
inline void yield() {
  Scheduler& s = *scheduler;
  if (s.progress != s.last_progress) {
    s.last_progress = s.progress;
    s.idle_switches = 0;
  } else if (++s.idle_switches > 2 * s.fibers.size() + 2) {
    deadlock();
  }
  const unsigned n = (unsigned)s.fibers.size(), from = s.current;
  unsigned to = from;
  do to = (to + 1) % n;
  while (s.fibers[to].done);
  if (to == from) return;
  s.current = to;
  self = s.fibers[to].lane;
  switch_context(s.fibers[from].ctx, s.fibers[to].ctx);
}

// std::barrier's arrive_and_wait / arrive_and_drop for fibers.
struct Barrier {
  unsigned expected = 0, arrived = 0;
  unsigned long long phase = 0;
  void complete_if_full() {
    if (arrived >= expected) {
      arrived = 0;
      ++phase;
    }
  }
  void arrive_and_wait() {
    ++scheduler->progress;
    ++arrived;
    const unsigned long long mine = phase;
    complete_if_full();
    while (phase == mine) yield();
  }
  // Arrives for this phase and leaves the count of later ones (a finished lane).
  void arrive_and_drop() {
    ++scheduler->progress;
    --expected;
    complete_if_full();
  }
};

struct Wave {
  Barrier bar;
  Barrier half[2];  // the two 32-lane halves
  float xchg[64];
  tm_half4 a[64], b[64];
  tm_float16 c[64], d[64];
};
struct Block {
  Barrier bar;
  std::vector<Wave> waves;
};
inline thread_local Block* block = nullptr;

inline Wave& wave() { return block->waves[self.tid / 64]; }
}  // namespace emu

inline unsigned tm_tid() { return emu::self.tid; }
inline unsigned tm_bid() { return emu::self.bid; }
inline unsigned tm_bdim() { return emu::self.bdim; }
inline void tm_sync() { emu::block->bar.arrive_and_wait(); }

inline float tm_shfl_xor(float v, int offset) {
  emu::Wave& w = emu::wave();
  const unsigned lane = tm_tid() % 64;
  emu::Barrier& bar = offset < 32 ? w.half[lane / 32] : w.bar;
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
  w.bar.arrive_and_wait();
  if (lane == 0) {  // one lane forms the product for the wave and hands each lane its elements
    float A[32][8], B[8][32];
    for (int i = 0; i < 32; ++i)
      for (int k = 0; k < 8; ++k) A[i][k] = (float)w.a[i + 32 * (k / 4)][k % 4];
    for (int k = 0; k < 8; ++k)
      for (int j = 0; j < 32; ++j) B[k][j] = (float)w.b[j + 32 * (k / 4)][k % 4];
    unsigned char placed[64][16] = {};
    for (int i = 0; i < 32; ++i)
      for (int j = 0; j < 32; ++j) {
        const int l = j + 32 * ((i / 4) % 2), e = 4 * (i / 8) + i % 4;
        float s = w.c[l][e];
        for (int k = 0; k < 8; ++k) s += A[i][k] * B[k][j];
        w.d[l][e] = s;
        ++placed[l][e];
      }
    for (int l = 0; l < 64; ++l)
      for (int e = 0; e < 16; ++e)
        if (placed[l][e] != 1) {
          std::fprintf(stderr, "layout table places %d elements of D in lane %d register %d, not 1\n",
                       placed[l][e], l, e);
          std::abort();
        }
  }
  w.bar.arrive_and_wait();
  const tm_float16 d = w.d[lane];
  w.bar.arrive_and_wait();  // nobody deposits the next operands before every lane has read D
  return d;
}

namespace emu {
inline void make_block(Block& blk, unsigned threads) {
  blk.bar = Barrier{threads};
  blk.waves.assign((threads + 63) / 64, Wave{});
  for (unsigned w = 0; w < blk.waves.size(); ++w) {
    const unsigned n = (w + 1) * 64 <= threads ? 64 : threads - w * 64;
    blk.waves[w].bar = Barrier{n};
    // Each half's lanes; an empty half gets a barrier nobody waits at.
    blk.waves[w].half[0] = Barrier{n < 32 ? n : 32};
    blk.waves[w].half[1] = Barrier{n > 32 ? n - 32 : 1};
  }
}

// Where a lane's fiber starts: the kernel, then out of the block's barriers (a finished GPU lane
// stops counting at them), then on to the next lane, or back to the launcher after the last.
[[noreturn]] inline void lane_entry() {
  Scheduler& s = *scheduler;
  s.body(s.kernel);
  const unsigned t = self.tid;
  block->waves[t / 64].bar.arrive_and_drop();
  block->waves[t / 64].half[(t % 64) / 32].arrive_and_drop();
  block->bar.arrive_and_drop();
  Fiber& me = s.fibers[s.current];
  me.done = true;
  ++s.progress;
  if (--s.live == 0) switch_context(me.ctx, s.launcher);
  yield();  // another lane runs; this one is never resumed
  std::abort();
}

// Stacks for `lanes` fibers, each above an unmapped guard.
struct Stacks {
  char* base = nullptr;
  size_t bytes = 0;
  explicit Stacks(unsigned lanes) : bytes(lanes * (kStackBytes + kGuardBytes)) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("emu: mmap of the lanes' stacks");
      std::abort();
    }
    base = (char*)p;
    for (unsigned l = 0; l < lanes; ++l) mprotect(base + l * (kStackBytes + kGuardBytes), kGuardBytes, PROT_NONE);
  }
  char* top(unsigned lane) const { return base + (lane + 1) * (kStackBytes + kGuardBytes); }
  ~Stacks() { munmap(base, bytes); }
};

// Runs `kernel()` over `grid` blocks of `threads` lanes. Blocks are dealt to up to as many host
// threads as the machine has cores (each with its own LDS), and a block's lanes run as fibers on
// its host thread. `after_block(b)` runs after block b on the thread that ran it, with every lane
// finished (to inspect LDS, for instance); calls of it never overlap.
template <class F, class G>
void launch(unsigned grid, unsigned threads, F kernel, G after_block) {
  std::atomic<unsigned> next{0};
  std::mutex after_lock;
  auto worker = [&] {
    Stacks stacks(threads);
    Scheduler s;
    s.body = [](const void* k) { (*(const F*)k)(); };
    s.kernel = &kernel;
    s.fibers.resize(threads);
    Block blk;
    scheduler = &s;
    block = &blk;
    for (unsigned b; (b = next.fetch_add(1)) < grid;) {
      std::memset(tm_dyn_smem, 0xff, sizeof(tm_dyn_smem));  // NaN: unwritten LDS shows
      make_block(blk, threads);
      for (unsigned t = 0; t < threads; ++t) {
        s.fibers[t].lane = Lane{t, b, threads};
        s.fibers[t].done = false;
        make_context(s.fibers[t].ctx, stacks.top(t), lane_entry);
      }
      s.current = 0;
      s.live = threads;
      s.idle_switches = 0;
      self = s.fibers[0].lane;
      switch_context(s.launcher, s.fibers[0].ctx);  // back here when every lane has finished
      std::lock_guard<std::mutex> g(after_lock);
      after_block(b);
    }
    scheduler = nullptr;
    block = nullptr;
  };
  if (grid == 0) return;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const unsigned helpers = std::min(grid, cores) - 1;
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < helpers; ++i) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

template <class F>
void launch(unsigned grid, unsigned threads, F kernel) {
  launch(grid, threads, kernel, [](unsigned) {});
}

// Runs `kernel` over `grid` blocks of `threads` lanes; true when any block wrote LDS past the
// `smem` bytes the host reserves for it (LDS is filled with 0xff before each block).
template <class F>
bool launch_overruns_lds(unsigned grid, unsigned threads, size_t smem, F kernel) {
  bool overrun = false;
  launch(grid, threads, kernel, [&](unsigned) {
    const unsigned char* lds = (const unsigned char*)tm_dyn_smem;
    for (size_t i = smem; i < sizeof(tm_dyn_smem); ++i) overrun |= lds[i] != 0xff;
  });
  return overrun;
}
}  // namespace emu
