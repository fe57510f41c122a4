// A fake ROCm for testing the HIP backend on a machine with no AMD GPU: one shared library that
// exports the HIP runtime and rocBLAS entry points the backend loads (src/backend/hip/sys.rs),
// implemented on the host.
//
// - "Device memory" is host memory with guard zones; every copy, memset and GEMM operand range is
//   checked against the allocation it falls in, and guards are checked after every launch.
// - hipModuleLoadData accepts only linked AMDGPU code objects (ELF ET_DYN, EM_AMDGPU) for the
//   fake device's processor, and hipModuleGetFunction only names found in the object.
// - hipModuleLaunchKernel runs the *real kernel bodies* (common/*.h, hip/output_projection.h),
//   compiled for the host against tests/hip_emu/emu.h, block by block, and checks that no block
//   touches LDS beyond the dynamic size the launch passed.
//   The backward kernels (common/backward.h, seventeen entry points) are dispatched too
//   (launch_backward), each after checking its buffers (sized by the I/O precision), that its
//   grid covers the work as the kernel divides it, that its dynamic LDS is the size the kernel's
//   macros give, and that a 16-bit entry point gets 16-bit I/O and an f32 one f32.
// - rocblas_gemm_ex / _strided_batched_ex implement rocBLAS's column-major semantics for f16, bf16
//   and f32 operands (f16 A/B with f16 or f32 C/D: the forward; f32 throughout, or bf16 A/B with
//   bf16 or f32 C/D: the backward) with f32 compute and accumulation, after checking every
//   operand span.
// A violation makes the call that detects it fail with code 999, whose hipGetErrorName is the
// violation's text, so the Rust side surfaces it as an ordinary error.
//
// - hipRTC compiles with a real clang (see hiprtcCompileProgram), so the run-time compilation
//   path, options included, runs too.
// The device's target id is $TRIMUL_FAKE_ROCM_ARCH (default gfx942:sramecc+:xnack-).
#include "tests/hip_emu/emu.h"
#include "common/params.h"
#include "common/input_norm.h"
#include "common/input_gating.h"
#include "common/output_norm.h"
#include "common/output_gate.h"
#include "common/prepare_weights.h"
#include "common/backward.h"
#include "hip/output_projection.h"
#include "hip/input_projection.h"

#include <algorithm>
#include <system_error>
#include <thread>
#include <vector>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unistd.h>

namespace {
constexpr int kFail = 999;
constexpr size_t kGuard = 256;
constexpr unsigned char kGuardByte = 0xA5;
constexpr size_t kMemory = size_t(64) << 30;  // what the fake device reports

std::recursive_mutex mu;
std::string violation;       // first violation not yet reported
std::string last_reported;   // what hipGetErrorName(999) says
std::map<uintptr_t, size_t> allocs;  // user address -> bytes
size_t allocated = 0;

void fail(const std::string& what) {
  if (violation.empty()) violation = what;
  std::fprintf(stderr, "fake ROCm: %s\n", what.c_str());
}
// kFail once for each violation: the call that detects it reports it, later calls run normally
// (one test's deliberate violation must not poison the others sharing the process).
int status() {
  if (violation.empty()) return 0;
  last_reported = violation;
  violation.clear();
  return kFail;
}

// Failure injection for the device-fault tests: $TRIMUL_FAKE_ROCM_FAIL = "<entry point>:<k>"
// makes the k-th call of that entry point, counted from when the variable took this value, fail
// as a device would (a launch that faults, a copy or GEMM that fails, memory refused). The call
// returns its failure code and the error name says "injected failure of <entry point>". The
// entry points: hipMalloc, hipMemcpyHtoDAsync, hipMemcpyDtoHAsync, hipMemsetAsync,
// hipStreamSynchronize, hipModuleLaunchKernel, rocblas_gemm (both GEMM calls).
bool inject(const char* call) {
  static std::string armed;
  static long count = 0;
  const char* v = std::getenv("TRIMUL_FAKE_ROCM_FAIL");
  const std::string spec = v ? v : "";
  if (spec != armed) {
    armed = spec;
    count = 0;
  }
  const size_t colon = spec.rfind(':');
  if (colon == std::string::npos || spec.compare(0, colon, call) != 0 || colon != std::strlen(call)) return false;
  if (++count != std::atol(spec.c_str() + colon + 1)) return false;
  fail(std::string("injected failure of ") + call);
  return true;
}

// Fast-path validation hooks (the self-validation tests): $TRIMUL_FAKE_ROCM_CORRUPT = "<kernel>"
// makes every launch of that kernel (output_projection or input_projection) finish with a few
// of its output elements wrong (one in about 97 of the rows it wrote), a kernel subtly broken
// rather than wrong everywhere; $TRIMUL_FAKE_ROCM_SLOW = "<kernel>:<ms>" makes each launch of
// it take that many milliseconds more on the device's clock (what events measure), so a test
// decides which path is faster. Both take comma-separated lists.
bool hook_names(const char* var, const std::string& kernel, long* value) {
  const char* v = std::getenv(var);
  if (!v || !*v) return false;
  // A comma-separated list of "<kernel>" or "<kernel>:<value>".
  const std::string all = v;
  for (size_t at = 0; at <= all.size();) {
    const size_t comma = std::min(all.find(',', at), all.size());
    const std::string spec = all.substr(at, comma - at);
    at = comma + 1;
    const size_t colon = spec.find(':');
    if (spec.substr(0, colon) != kernel) continue;
    if (value) *value = colon == std::string::npos ? 0 : std::atol(spec.c_str() + colon + 1);
    return true;
  }
  return false;
}

// The device's clock, which events read: the host's, plus the time $TRIMUL_FAKE_ROCM_SLOW adds to
// slowed launches. Added, not slept: a slowed kernel is slower by exactly that much whatever the
// host's load (the emulation's own speed varies by far more than a test's margin on a busy host).
std::atomic<long long> added_ns{0};
void slow_down(long ms) { added_ns += (long long)ms * 1000000; }
std::chrono::steady_clock::time_point fake_now() {
  return std::chrono::steady_clock::now() + std::chrono::nanoseconds(added_ns.load());
}

// The launch record: how many times each kernel was launched (and ran to completion) in this
// process, so tests can show which kernels a forward used. `trimul_fake_launches(name)` reads it,
// `trimul_fake_thread_launches(name)` the calling thread's part.
std::mutex launches_lock;
std::map<std::string, long> launches;
// The same per calling thread (a launch runs on the thread that makes it), so that a test among
// others running at once can tell which kernels its own forwards used.
thread_local std::map<std::string, long> thread_launches;

std::string arch_id() {
  const char* a = std::getenv("TRIMUL_FAKE_ROCM_ARCH");
  return a && *a ? a : "gfx942:sramecc+:xnack-";
}
std::string processor() {
  std::string id = arch_id();
  return id.substr(0, id.find(':'));
}

// The allocation holding [p, p + len), or false.
bool in_alloc(uintptr_t p, size_t len) {
  auto it = allocs.upper_bound(p);
  if (it == allocs.begin()) return false;
  --it;
  return p >= it->first && p + len <= it->first + it->second;
}
void need(const void* p, size_t len, const char* what) {
  if (len && !in_alloc((uintptr_t)p, len)) fail(std::string(what) + ": range outside any device allocation");
}
// The copies and the fill that touch one device range: the injected failure of `call` if armed,
// else `op` once [p, p + len) is known to lie in an allocation (a fault, as `need` says, if not).
template <class Op>
int on_device_range(const char* call, const void* p, size_t len, const char* what, Op op) {
  std::lock_guard<std::recursive_mutex> g(mu);
  if (inject(call)) return status();
  need(p, len, what);
  if (status()) return kFail;
  op();
  return 0;
}
void check_guards(const char* after) {
  for (auto& [user, bytes] : allocs) {
    const unsigned char* lo = (const unsigned char*)user - kGuard;
    const unsigned char* hi = (const unsigned char*)user + bytes;
    for (size_t i = 0; i < kGuard; ++i)
      if (lo[i] != kGuardByte || hi[i] != kGuardByte) {
        fail(std::string(after) + " wrote outside a device allocation");
        return;
      }
  }
}

struct Module {
  std::string names;  // the NUL-separated strings of the code object, for symbol look-ups
};
struct Function {
  std::string name;
};

// e_flags machine byte of the processors the fake knows.
int mach_of(const std::string& p) {
  if (p == "gfx942") return 0x4c;
  if (p == "gfx90a") return 0x3f;
  if (p == "gfx908") return 0x30;
  if (p == "gfx1100") return 0x41;
  return -1;
}

// The backward kernels of common/backward.h (src/backend/hip/backward.rs launches them): every
// buffer a kernel will touch must lie in device memory before it runs, the grid must cover the
// work as the kernel divides it, and the dynamic LDS must be what the kernel's macros say.
int launch_backward(const std::string& entry, unsigned gx, unsigned smem, void** args) {
  // A per-position kernel's 16-bit entry point (`<name>_16`) gets its f32 one's checks.
  const bool sixteen = entry.size() > 3 && entry.compare(entry.size() - 3, 3, "_16") == 0;
  const std::string name = sixteen ? entry.substr(0, entry.size() - 3) : entry;
  auto geometry = [&](bool ok, const char* what) {
    if (!ok) fail(name + ": " + what);
  };
  auto lds = [&](size_t want) { geometry(smem == want, "dynamic LDS is not the size the kernel needs"); };
  bool lds_overrun = false;
  auto after = [&](unsigned) {
    const unsigned char* l = (const unsigned char*)tm_dyn_smem;
    for (size_t i = smem; i < sizeof(tm_dyn_smem); ++i) lds_overrun |= l[i] != 0xff;
  };
  auto finish = [&] {
    if (lds_overrun) fail(name + ": a block used LDS beyond the dynamic size passed at launch");
    check_guards(name.c_str());
    return status();
  };
  // Bytes of an element of precision `t` (a TM_IO_ value); an unknown one is a violation.
  auto bytes = [&](int t) -> size_t {
    if (t < TM_IO_F32 || t > TM_IO_F16) fail(name + ": unknown precision " + std::to_string(t));
    return t == TM_IO_F32 ? 4 : 2;
  };
  if (name == "backward_convert") {
    const TmConvert w = *(const TmConvert*)args[0];
    if (w.n < 0) fail(name + ": negative length");
    geometry((tm_i64)gx * TM_BWD_THREADS >= w.n, "the grid does not cover every element");
    lds(0);
    need(w.src, (size_t)w.n * bytes(w.from), "backward_convert source");
    need(w.dst, (size_t)w.n * bytes(w.to), "backward_convert destination");
    if (!violation.empty()) return status();
    emu::launch(gx, TM_BWD_THREADS, [&] { backward_convert(w); }, after);
    return finish();
  }
  if (name == "backward_column_partials" || name == "backward_column_finish") {
    const TmColumnSums s = *(const TmColumnSums*)args[0];
    const bool partials = name == "backward_column_partials";
    if (s.cols < 1 || s.row_blocks < 1 || s.rows < 0 || (partials && s.ld < s.cols)) fail(name + ": bad sizes");
    if (!violation.empty()) return status();
    const size_t cols = (size_t)s.cols, rb = (size_t)s.row_blocks;
    need(s.partial, rb * cols * 8, (name + " partial").c_str());
    if (partials) {
      geometry(gx == rb * ((cols + 31) / 32), "the grid is not row_blocks x 32-column chunks");
      lds(TM_BWD_PARTIALS_SMEM);
      if (s.rows > 0)
        need(s.a, ((size_t)(s.rows - 1) * s.ld + cols) * bytes(s.dtype), "backward_column_partials matrix");
    } else {
      geometry((size_t)gx * TM_BWD_THREADS >= cols, "the grid does not cover every column");
      lds(0);
      need(s.out, cols * 4, "backward_column_finish output");
    }
    if (!violation.empty()) return status();
    if (partials)
      emu::launch(gx, TM_BWD_THREADS, [&] { backward_column_partials(s); }, after);
    else
      emu::launch(gx, TM_BWD_THREADS, [&] { backward_column_finish(s); }, after);
    return finish();
  }
  const TmBackwardParams p = *(const TmBackwardParams*)args[0];
  if (p.rows < 1 || p.n2 < 1 || p.rows % p.n2 != 0 || p.c < 1 || p.h < 1 || (p.af3 != 0 && p.af3 != 1) ||
      p.f != 4 * p.h + (p.af3 ? p.c : p.h))
    fail(name + ": bad sizes");
  if (sixteen != (p.io != TM_IO_F32)) fail(entry + ": not the entry point for I/O precision " + std::to_string(p.io));
  if (!violation.empty()) return status();
  const size_t M = (size_t)p.rows, C = (size_t)p.c, H = (size_t)p.h, F = (size_t)p.f;
  // x, dy and dx in the I/O precision; z, P, left, right, t (then dt) and dcat 16-bit where it is
  // 16-bit (with bf16 copies of z, left and right), the rest f32.
  const size_t io = bytes(p.io), mid = io;
  const size_t tiles = (M + TM_BWD_TILE - 1) / TM_BWD_TILE;
  auto mask_and_bias = [&] {
    if (p.mask) need(p.mask, M * 4, (name + " mask").c_str());
    if (p.proj_bias) need(p.proj_bias, F * 4, (name + " input bias").c_str());
  };
  // The LayerNorm backward kernels loop over positions with `blocks` blocks, each writing one
  // row of 2W doubles of partial sums.
  auto looping = [&](size_t w) {
    geometry(p.blocks >= 1 && (unsigned)p.blocks == gx, "blocks is not the grid size");
    need(p.partial, gx * 2 * w * 8, (name + " partial").c_str());
  };
  if (name == "backward_input_norm") {
    geometry(gx == (M + TM_BWD_ROWS_PER_BLOCK - 1) / TM_BWD_ROWS_PER_BLOCK, "the grid is not one warp per position");
    lds(0);
    need(p.x, M * C * io, "backward_input_norm x");
    need(p.z, M * C * mid, "backward_input_norm z");
    if (p.io != TM_IO_F32) need(p.z_bf16, M * C * 2, "backward_input_norm bf16 z");
    need(p.stats_x, M * 2 * 4, "backward_input_norm stats");
    need(p.norm_in_w, C * 4, "LN_C weight");
    need(p.norm_in_b, C * 4, "LN_C bias");
  } else if (name == "backward_gating" || name == "backward_gating_grad") {
    geometry(gx == tiles, "the grid is not one block per tile");
    lds(TM_BWD_GATING_SMEM);
    mask_and_bias();
    need(p.p, M * F * mid, (name + " P").c_str());
    // gating writes left and right; gating_grad reads dleft and dright there, f32.
    const size_t lr = name == "backward_gating" ? mid : 4;
    need(p.left, M * H * lr, (name + " left").c_str());
    need(p.right, M * H * lr, (name + " right").c_str());
    if (p.io != TM_IO_F32 && name == "backward_gating") {
      need(p.left_bf16, M * H * 2, "backward_gating bf16 left");
      need(p.right_bf16, M * H * 2, "backward_gating bf16 right");
    }
    if (name == "backward_gating_grad") need(p.dcat, M * F * mid, "backward_gating_grad dcat");
  } else if (name == "backward_output_norm") {
    geometry(gx == tiles, "the grid is not one block per tile");
    lds(TM_BWD_T_SMEM(H));
    need(p.t, M * H * mid, "backward_output_norm t");
    need(p.u, M * H * 4, "backward_output_norm u");
    need(p.stats_t, M * 2 * 4, "backward_output_norm stats");
    need(p.norm_out_w, H * 4, "LN_H weight");
    need(p.norm_out_b, H * 4, "LN_H bias");
    if (!p.af3) {
      mask_and_bias();
      need(p.p, M * F * mid, "backward_output_norm P");
      need(p.e, M * H * 4, "backward_output_norm v");
    }
  } else if (name == "backward_output_gate") {
    const size_t W = p.af3 ? C : H;
    geometry((size_t)gx * TM_BWD_THREADS >= M * W, "the grid does not cover every element");
    lds(0);
    mask_and_bias();
    need(p.p, M * F * mid, "backward_output_gate P");
    need(p.dcat, M * F * mid, "backward_output_gate dcat");
    if (p.af3) {
      need(p.dy, M * C * io, "backward_output_gate dy");
      need(p.e, M * C * 4, "backward_output_gate s");
      if (p.out_bias) need(p.out_bias, C * 4, "backward_output_gate output bias");
    } else {
      need(p.du, M * H * 4, "backward_output_gate dv");
      need(p.u, M * H * 4, "backward_output_gate u");
    }
  } else if (name == "backward_output_norm_grad") {
    lds(TM_BWD_T_ACC_SMEM(H));
    looping(H);
    need(p.t, M * H * mid, "backward_output_norm_grad t");
    need(p.du, M * H * 4, "backward_output_norm_grad du");
    need(p.stats_t, M * 2 * 4, "backward_output_norm_grad stats");
    need(p.norm_out_w, H * 4, "LN_H weight");
  } else if (name == "backward_input_norm_grad") {
    lds(TM_BWD_ACC_SMEM(C));
    looping(C);
    need(p.x, M * C * io, "backward_input_norm_grad x");
    need(p.dz, M * C * 4, "backward_input_norm_grad dz");
    need(p.dx, M * C * io, "backward_input_norm_grad dx");
    need(p.stats_x, M * 2 * 4, "backward_input_norm_grad stats");
    need(p.norm_in_w, C * 4, "LN_C weight");
  } else {
    fail("launch of unknown kernel " + name);
    return kFail;
  }
  if (!violation.empty()) return status();
  // The entry point launched, as the kernel's name says.
  using Kernel = void (*)(TmBackwardParams);
  struct Entries {
    const char* name;
    Kernel f32, f16;
  };
  static const Entries entries[] = {
      {"backward_input_norm", backward_input_norm, backward_input_norm_16},
      {"backward_gating", backward_gating, backward_gating_16},
      {"backward_output_norm", backward_output_norm, backward_output_norm_16},
      {"backward_output_gate", backward_output_gate, backward_output_gate_16},
      {"backward_output_norm_grad", backward_output_norm_grad, backward_output_norm_grad_16},
      {"backward_gating_grad", backward_gating_grad, backward_gating_grad_16},
      {"backward_input_norm_grad", backward_input_norm_grad, backward_input_norm_grad_16},
  };
  Kernel kernel = nullptr;
  for (const Entries& e : entries)
    if (name == e.name) kernel = sixteen ? e.f16 : e.f32;
  emu::launch(gx, TM_BWD_THREADS, [&] { kernel(p); }, after);
  return finish();
}
}  // namespace

extern "C" {
// ------------------------------------------------------------------------------------ HIP
int hipInit(unsigned) { return 0; }
int hipGetDeviceCount(int* n) {
  *n = 1;
  return 0;
}
int hipSetDevice(int d) { return d == 0 ? 0 : 101; }
int hipDeviceGetAttribute(int* v, int attr, int) {
  switch (attr) {
    case 63: *v = 304; return 0;           // multiprocessor count (MI300X)
    case 74: *v = 65536; return 0;         // max shared memory per block
    case 87: *v = 64; return 0;            // warp size
    default: *v = 0; return 0;
  }
}
int hipDeviceGetName(char* name, int len, int) {
  std::snprintf(name, len, "Fake AMD Instinct (%s)", processor().c_str());
  return 0;
}
int hipDeviceGetPCIBusId(char* s, int len, int) {
  std::snprintf(s, len, "0000:fa:ce.0");
  return 0;
}
int hipDeviceTotalMem(size_t* b, int) {
  *b = kMemory;
  return 0;
}
// Writes hipDeviceProp_tR0600 as ROCm 6 does: name at 0, gcnArchName at 1160, 1472 bytes.
int hipGetDevicePropertiesR0600(void* prop, int) {
  char* p = (char*)prop;
  std::memset(p, 0, 1472);
  std::snprintf(p, 256, "Fake AMD Instinct");
  std::snprintf(p + 1160, 256, "%s", arch_id().c_str());
  return 0;
}
int hipMalloc(void** out, size_t bytes) {
  std::lock_guard<std::recursive_mutex> g(mu);
  if (inject("hipMalloc")) return status();
  if (bytes == 0) return 1;
  unsigned char* base = (unsigned char*)std::aligned_alloc(256, ((bytes + 2 * kGuard + 255) / 256) * 256);
  if (!base) return 2;
  std::memset(base, kGuardByte, kGuard);
  std::memset(base + kGuard, 0x5A, bytes);  // garbage, like fresh device memory
  std::memset(base + kGuard + bytes, kGuardByte, kGuard);
  *out = base + kGuard;
  allocs[(uintptr_t)*out] = bytes;
  allocated += bytes;
  return 0;
}
int hipFree(void* p) {
  std::lock_guard<std::recursive_mutex> g(mu);
  auto it = allocs.find((uintptr_t)p);
  if (it == allocs.end()) {
    fail("hipFree of an address hipMalloc did not return");
    return status();
  }
  check_guards("a kernel or copy before hipFree");
  allocated -= it->second;
  allocs.erase(it);
  std::free((unsigned char*)p - kGuard);
  return status();
}
int hipMemGetInfo(size_t* free_b, size_t* total) {
  std::lock_guard<std::recursive_mutex> g(mu);
  *free_b = kMemory - allocated;
  *total = kMemory;
  return 0;
}
int hipMemcpyHtoDAsync(void* dst, const void* src, size_t n, void*) {
  return on_device_range("hipMemcpyHtoDAsync", dst, n, "hipMemcpyHtoDAsync destination", [&] { std::memcpy(dst, src, n); });
}
int hipMemcpyDtoHAsync(void* dst, const void* src, size_t n, void*) {
  return on_device_range("hipMemcpyDtoHAsync", src, n, "hipMemcpyDtoHAsync source", [&] { std::memcpy(dst, src, n); });
}
int hipMemcpyDtoDAsync(void* dst, const void* src, size_t n, void*) {
  std::lock_guard<std::recursive_mutex> g(mu);
  need(dst, n, "hipMemcpyDtoDAsync destination");
  need(src, n, "hipMemcpyDtoDAsync source");
  if (status()) return kFail;
  std::memmove(dst, src, n);
  return 0;
}
int hipMemsetAsync(void* dst, int v, size_t n, void*) {
  return on_device_range("hipMemsetAsync", dst, n, "hipMemsetAsync", [&] { std::memset(dst, v, n); });
}
int hipStreamCreate(void** s) {
  *s = new int(1);
  return 0;
}
int hipStreamSynchronize(void*) {
  std::lock_guard<std::recursive_mutex> g(mu);
  inject("hipStreamSynchronize");
  return status();
}
int hipStreamDestroy(void* s) {
  delete (int*)s;
  return 0;
}
int hipModuleLoadData(void** module, const void* image) {
  std::lock_guard<std::recursive_mutex> g(mu);
  const unsigned char* b = (const unsigned char*)image;
  if (((uintptr_t)image) % 8) fail("hipModuleLoadData: image not 8-byte aligned");
  if (std::memcmp(b, "\x7f" "ELF", 4) != 0 || b[4] != 2) return 200;  // hipErrorInvalidImage
  uint16_t type, machine;
  uint32_t flags;
  uint64_t shoff;
  uint16_t shentsize, shnum;
  std::memcpy(&type, b + 16, 2);
  std::memcpy(&machine, b + 18, 2);
  std::memcpy(&shoff, b + 40, 8);
  std::memcpy(&flags, b + 48, 4);
  std::memcpy(&shentsize, b + 58, 2);
  std::memcpy(&shnum, b + 60, 2);
  if (machine != 224 || type != 3) return 200;
  if ((int)(flags & 0xff) != mach_of(processor())) return 209;  // hipErrorNoBinaryForGpu
  // The code object's size is where its section headers end.
  size_t size = shoff + (size_t)shentsize * shnum;
  Module* m = new Module;
  m->names.assign((const char*)b, size);
  *module = m;
  return 0;
}
int hipModuleUnload(void* m) {
  delete (Module*)m;
  return 0;
}
int hipModuleGetFunction(void** f, void* module, const char* name) {
  Module* m = (Module*)module;
  // A kernel has a symbol `name` and its descriptor `name.kd` in the object's string table.
  if (m->names.find(std::string(name) + ".kd") == std::string::npos) return 500;  // hipErrorNotFound
  *f = new Function{name};
  return 0;
}

int hipModuleLaunchKernel(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned smem, void*, void** args, void** extra) {
  std::lock_guard<std::recursive_mutex> g(mu);
  inject("hipModuleLaunchKernel");
  if (status()) return kFail;
  const std::string& name = ((Function*)fn)->name;
  // $TRIMUL_FAKE_ROCM_ABORT = "<kernel>": a launch of it ends the process, as a memory fault in a
  // kernel ends a ROCm process (the self-validation test's crash case).
  if (hook_names("TRIMUL_FAKE_ROCM_ABORT", name, nullptr)) {
    std::fprintf(stderr, "fake ROCm: %s faulted (TRIMUL_FAKE_ROCM_ABORT)\n", name.c_str());
    std::_Exit(134);
  }
  if (gy != 1 || gz != 1 || by != 1 || bz != 1 || bx != 256 || gx == 0 || extra || !args) {
    fail(name + ": unexpected launch geometry or argument form");
    return kFail;
  }
  if (smem > 65536) {
    fail(name + ": more than 64 KiB of LDS");
    return kFail;
  }
  if (name == "prepare_weights") {
    // Every segment's destination, and every source it reads, must lie in device memory.
    const TmPrepareParams q = *(const TmPrepareParams*)args[0];
    if (q.segments < 0 || q.segments > TM_PREP_MAX_SEGMENTS || q.grid != (int)gx) fail(name + ": bad segment count or grid");
    const size_t c = (size_t)q.c, h = (size_t)q.h, g = (size_t)q.g;
    auto elem = [](int dtype) -> size_t { return dtype == TM_IO_F32 ? 4 : 2; };
    for (int s = 0; s < q.segments && violation.empty(); ++s) {
      const TmPrepSegment& sg = q.seg[s];
      const size_t count = (size_t)sg.count;
      need(sg.dst, count * (sg.dst_f16 ? 2 : 4), "prepare_weights destination");
      if (sg.kind == TM_SEG_PLAIN && sg.src) need(sg.src, count * elem(sg.src_dtype), "prepare_weights source");
      if (sg.kind != TM_SEG_PLAIN) {
        for (int k = 0; k < 5; ++k) {
          const size_t out = k < 4 ? h : g;
          if (sg.kind == TM_SEG_FUSED_W) need(q.fused_src[k], out * c * elem(q.fused_dtype[k]), "fused weight source");
          if (sg.kind == TM_SEG_FUSED_B && q.fused_bias[k]) need(q.fused_bias[k], out * elem(q.fused_bias_dtype[k]), "fused bias source");
        }
      }
    }
    if (!violation.empty()) return status();
    emu::launch(gx, bx, [&] { prepare_weights(q); }, [](unsigned) {});
    check_guards(name.c_str());
    return status();
  }
  if (name.rfind("backward_", 0) == 0) return launch_backward(name, gx, smem, args);
  // The input stage's kernels take TmInputParams, the output stage's TmOutputParams; both begin
  // with the common TmParams.
  const bool input = name == "input_norm" || name == "input_gating" || name == "input_projection";
  const TmInputParams in = input ? *(const TmInputParams*)args[0] : TmInputParams{};
  const TmOutputParams out = input ? TmOutputParams{} : *(const TmOutputParams*)args[0];
  const TmParams& p = input ? (const TmParams&)in : (const TmParams&)out;
  // Every buffer the kernel will touch must lie in device memory *before* it runs: the emulated
  // kernel writes host memory directly, so a bad pointer must be refused, not executed.
  const size_t M = (size_t)p.batch * p.n * p.n, C = p.c, H = p.h, G = p.g;
  const size_t rows = (size_t)p.rows, row0 = (size_t)p.row0;
  if (p.row0 < 0 || p.rows < 0 || row0 + rows > M) fail(name + ": rows outside the problem");
  if (p.formulation != TM_GPUMODE && p.formulation != TM_AF3) fail(name + ": bad formulation");
  // gate and a hold the positions buf_row0 .. (every position in a one-pass plan, one row chunk
  // in a chunked plan): a launch touches its rows of them, counted from buf_row0.
  const tm_i64 buf_row0 = input ? in.buf_row0 : out.buf_row0;
  if (buf_row0 < 0 || buf_row0 > p.row0) fail(name + ": buf_row0 after the launch's first row");
  const size_t brow = row0 - (size_t)buf_row0;
  // x and y in the launch's I/O precision; output_gate (the rocBLAS path) reads and writes f32 y.
  if (p.io_dtype != TM_IO_F32 && p.io_dtype != TM_IO_BF16 && p.io_dtype != TM_IO_F16) fail(name + ": bad io_dtype");
  const size_t io = p.io_dtype == TM_IO_F32 ? 4 : 2;
  if (io != 4 && name != "input_norm" && name != "output_projection" && name != "input_gating" &&
      name != "output_norm" && name != "input_projection")
    fail(name + ": 16-bit x and y given to a kernel that reads or writes them as f32");
  const char* xb = (const char*)p.x;
  const char* yb = (const char*)p.y;
  bool writes_gate = false;  // input_projection: whether this launch runs gate work items
  if (name == "input_norm") {
    need(xb + row0 * C * io, rows * C * io, "input_norm x");
    need(in.z, rows * C * 2, "input_norm z");
    need(p.norm_in_w, C * 4, "input_norm weight");
    need(p.norm_in_b, C * 4, "input_norm bias");
  } else if (name == "input_gating") {
    // The channels and gate columns this launch gates (a hidden pass's, or the gate alone).
    const size_t GH = in.proj_h, GG = in.proj_g, P = 4 * GH + GG;
    if (in.proj_h < 0 || in.proj_g < 0 || in.tile_rows < 1) fail(name + ": bad widths or tile");
    need(in.proj, rows * P * 2, "input_gating proj");
    if (p.mask) need(p.mask, M * 4, "input_gating mask");
    if (in.proj_bias) need(in.proj_bias, P * 4, "input_gating bias");
    need(in.left, M * GH * 2, "input_gating left");
    need(in.right, M * GH * 2, "input_gating right");
    need(in.gate + brow * GG, rows * GG * 2, "input_gating gate");
  } else if (name == "input_projection") {
    // The fused MFMA input stage: x's rows, the [4H + G, C] weights; for its hidden work items the
    // window's channels of left and right (the contraction layout, every position), for its gate
    // items the gate's rows from buf_row0. The grid covers the rows, 64 per block.
    const size_t P = 4 * H + G;
    const int hidden_items = (int)((H + 31) / 32), items = hidden_items + (int)((G + 31) / 32);
    const int begin = in.chunk_begin, end = in.chunk_end > 0 ? in.chunk_end : items;
    if (begin < 0 || begin >= end || end > items) fail(name + ": work items outside the kernel's");
    const size_t LH = in.lr_h > 0 ? (size_t)in.lr_h : H;
    if (in.lr_h < 0 || in.lr_h0 < 0 || (size_t)in.lr_h0 + LH > H) fail(name + ": left/right window outside H");
    if ((size_t)gx * IP_BM < rows) fail(name + ": the grid does not cover the rows");
    need(xb + row0 * C * io, rows * C * io, "input_projection x");
    need(p.w_in, P * C * 2, "input_projection w_in");
    if (in.proj_bias) need(in.proj_bias, P * 4, "input_projection bias");
    need(p.norm_in_w, C * 4, "input_projection LN_C weight");
    need(p.norm_in_b, C * 4, "input_projection LN_C bias");
    if (begin < hidden_items) {
      if (p.mask) need(p.mask, M * 4, "input_projection mask");
      need(in.left, M * LH * 2, "input_projection left");
      need(in.right, M * LH * 2, "input_projection right");
    }
    writes_gate = end > hidden_items;
    if (writes_gate) need(in.gate + brow * G, rows * G * 2, "input_projection gate");
    if (C % 4 != 0) fail(name + ": C is not a multiple of 4");
  } else if (name == "output_norm" || name == "output_projection") {
    need(out.t, M * H * 2, "t");
    need(out.gate + brow * G, rows * G * 2, "gate");
    need(p.norm_out_w, H * 4, "LN_H weight");
    need(p.norm_out_b, H * 4, "LN_H bias");
    if (name == "output_norm") need(out.a + brow * H, rows * H * 2, "output_norm a");
    if (name == "output_projection") {
      need(yb + row0 * C * io, rows * C * io, "output_projection y");
      need(p.w_out, C * H * 2, "output_projection wout");
      if (p.out_bias) need(p.out_bias, C * 4, "output_projection bias");
    }
  } else if (name == "output_gate") {
    // The grid-stride loop strides by the grid the kernel is told, which must be the launch's.
    if (out.gate_blocks != (int)gx) fail(name + ": gate_blocks is not the grid size");
    need(p.y + row0 * C, rows * C * 4, "output_gate y");
    need(out.gate + brow * C, rows * C * 2, "output_gate gate");
  }
  if (!violation.empty()) return status();
  bool lds_overrun = false;
  auto after = [&](unsigned) {
    const unsigned char* lds = (const unsigned char*)tm_dyn_smem;
    for (size_t i = smem; i < sizeof(tm_dyn_smem); ++i) lds_overrun |= lds[i] != 0xff;
  };
  if (name == "input_norm") {
    emu::launch(gx, bx, [&] { input_norm(in); }, after);
  } else if (name == "input_gating") {
    emu::launch(gx, bx, [&] { input_gating(in); }, after);
  } else if (name == "output_norm") {
    emu::launch(gx, bx, [&] { output_norm(out); }, after);
  } else if (name == "output_gate") {
    emu::launch(gx, bx, [&] { output_gate(out); }, after);
  } else if (name == "output_projection") {
    emu::launch(gx, bx, [&] { output_projection(out); }, after);
  } else if (name == "input_projection") {
    emu::launch(gx, bx, [&] { input_projection(in); }, after);
  } else {
    fail("launch of unknown kernel " + name);
    return kFail;
  }
  if (lds_overrun) fail(name + ": a block used LDS beyond the dynamic size passed at launch");
  {
    std::lock_guard<std::mutex> g(launches_lock);
    ++launches[name];
    ++thread_launches[name];
    // A chunked plan's launches of the fused input kernel: a hidden pass's or the gate's items.
    if (name == "input_projection" && (in.chunk_end > 0 || in.lr_h > 0)) {
      ++launches["input_projection (part)"];
      ++thread_launches["input_projection (part)"];
    }
  }
  long slow_ms = 0;
  if (hook_names("TRIMUL_FAKE_ROCM_SLOW", name, &slow_ms) && slow_ms > 0) slow_down(slow_ms);
  if (name == "input_projection" && writes_gate && hook_names("TRIMUL_FAKE_ROCM_CORRUPT", name, nullptr)) {
    // A few wrong elements of the gate: column (row mod G) of every 97th row, 0.5 added (the
    // gate is in (0, 1); af3 multiplies y by it, so y is off by half its size there). A hidden
    // pass of a chunked plan writes no gate; its gate pass is corrupted instead.
    for (size_t r = row0; r < row0 + rows; r += 97) {
      tm_half* at = in.gate + (r - (size_t)in.buf_row0) * G + r % G;
      *at = tm_f2h(tm_h2f(*at) + 0.5f);
    }
  }
  if (name == "output_projection" && hook_names("TRIMUL_FAKE_ROCM_CORRUPT", name, nullptr)) {
    // A few wrong elements in the rows this launch wrote: channel (row mod C) of every 97th row.
    for (size_t r = row0; r < row0 + rows; r += 97) {
      const size_t at = r * C + r % C;
      if (io == 4) {
        ((float*)p.y)[at] += 0.5f;
      } else {
        // 0.5 where |y| < 0.25, else -y: off by at least 0.25 either way.
        const bool bf16 = p.io_dtype == TM_IO_BF16;
        const unsigned short quarter = bf16 ? 0x3E80 : 0x3400, half = bf16 ? 0x3F00 : 0x3800;
        unsigned short* h = (unsigned short*)p.y + at;
        *h = (*h & 0x7fff) < quarter ? half : (unsigned short)(*h ^ 0x8000);
      }
    }
  }
  check_guards(name.c_str());
  return status();
}

int hipEventCreate(void** e) {
  *e = new std::chrono::steady_clock::time_point();
  return 0;
}
int hipEventRecord(void* e, void*) {
  *(std::chrono::steady_clock::time_point*)e = fake_now();
  return 0;
}
int hipEventSynchronize(void*) { return 0; }
int hipEventElapsedTime(float* ms, void* a, void* b) {
  auto d = *(std::chrono::steady_clock::time_point*)b - *(std::chrono::steady_clock::time_point*)a;
  *ms = std::chrono::duration<float, std::milli>(d).count();
  return 0;
}
int hipEventDestroy(void* e) {
  delete (std::chrono::steady_clock::time_point*)e;
  return 0;
}
int hipRuntimeGetVersion(int* v) {
  *v = 60342134;
  return 0;
}
int hipDriverGetVersion(int* v) {
  *v = 60342134;
  return 0;
}
const char* hipGetErrorName(int code) {
  static thread_local std::string s;
  std::lock_guard<std::recursive_mutex> g(mu);
  s = code == kFail ? "fake ROCm violation: " + last_reported : "hipErrorFake" + std::to_string(code);
  return s.c_str();
}

// -------------------------------------------------------------------------------- rocBLAS
int rocblas_create_handle(void** h) {
  *h = new int(2);
  return 0;
}
int rocblas_destroy_handle(void* h) {
  delete (int*)h;
  return 0;
}
int rocblas_set_stream(void*, void*) { return 0; }
int rocblas_get_version_string(char* buf, size_t len) {
  std::snprintf(buf, len, "4.3.0-fake");
  return 0;
}
const char* rocblas_status_to_string(int s) {
  static thread_local std::string text;
  std::lock_guard<std::recursive_mutex> g(mu);
  text = s == 0 ? "rocblas_status_success" : "fake rocBLAS violation: " + last_reported;
  return text.c_str();
}

// rocblas_datatype: 150 f16, 151 f32, 168 bf16.
static float load(const void* p, int type, size_t i) {
  if (type == 150) return (float)((const _Float16*)p)[i];
  if (type == 168) return tm_bf2f(((const unsigned short*)p)[i]);
  return ((const float*)p)[i];
}
static void store(void* p, int type, size_t i, float v) {
  if (type == 150)
    ((_Float16*)p)[i] = (_Float16)v;
  else if (type == 168)
    ((unsigned short*)p)[i] = tm_f2bf(v);
  else
    ((float*)p)[i] = v;
}

static int gemm(int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int at, int lda, int64_t sa,
                const void* b, int bt, int ldb, int64_t sb, const void* beta, const void* c, int ct, int ldc, int64_t sc,
                void* d, int dt, int ldd, int64_t sd, int batch, int compute) {
  std::lock_guard<std::recursive_mutex> g(mu);
  inject("rocblas_gemm");
  if (status()) return 6;  // a pending violation from an earlier call
  auto bad = [](const std::string& w) {
    fail("rocBLAS: " + w);
    return 4;  // rocblas_status_invalid_size
  };
  if ((ta != 111 && ta != 112) || (tb != 111 && tb != 112)) return bad("operation");
  if (compute != 151) return bad("compute type is not f32");
  for (int t : {at, bt, ct, dt})
    if (t != 150 && t != 151 && t != 168) return bad("data type");
  if (at != bt) return bad("A and B of different types");
  if (m < 0 || n < 0 || k < 0 || batch < 1) return bad("sizes");
  const int a_rows = ta == 111 ? m : k, a_cols = ta == 111 ? k : m;
  const int b_rows = tb == 111 ? k : n, b_cols = tb == 111 ? n : k;
  if (lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) || ldd < std::max(1, m) || ldc < std::max(1, m))
    return bad("leading dimension below the rows stored");
  auto span = [&](int rows, int cols, int ld, int64_t stride) {
    return rows == 0 || cols == 0 ? 0 : (size_t)(batch - 1) * stride + (size_t)(cols - 1) * ld + rows;
  };
  const size_t ea = at == 151 ? 4 : 2, eb = bt == 151 ? 4 : 2, ec = ct == 151 ? 4 : 2, ed = dt == 151 ? 4 : 2;
  need(a, span(a_rows, a_cols, lda, sa) * ea, "rocBLAS A");
  need(b, span(b_rows, b_cols, ldb, sb) * eb, "rocBLAS B");
  need(d, span(m, n, ldd, sd) * ed, "rocBLAS D");
  const float al = *(const float*)alpha, be = *(const float*)beta;
  if (be != 0.f) need(c, span(m, n, ldc, sc) * ec, "rocBLAS C");
  if (status()) return 3;
  // The columns of D over all batches, in contiguous ranges dealt to up to one thread per core
  // (fewer for small GEMMs); a thread widens op(A) of each batch it reaches to f32 column-major
  // [m, k] once, then sums each column over p in order with the rows innermost (contiguous, so
  // the loop vectorises): the fake's GEMMs were most of a staged forward's time on the CPU. C and
  // D may be the same matrix (the bias update): each element is read and written by one thread.
  const size_t cols = (size_t)batch * (size_t)n;
  const double work = (double)cols * m * std::max(k, 1);
  const unsigned cap = std::max(1u, std::thread::hardware_concurrency());
  const size_t workers = std::max<size_t>(1, std::min<size_t>({cap, cols, (size_t)(work / (1 << 22)) + 1}));
  auto columns = [&](size_t c0, size_t c1) {
    std::vector<float> A((size_t)m * k), acc((size_t)m);
    long long widened = -1;
    for (size_t col = c0; col < c1; ++col) {
      const int bt_i = (int)(col / (size_t)n), j = (int)(col % (size_t)n);
      if (bt_i != widened) {
        for (int p = 0; p < k; ++p)
          for (int i = 0; i < m; ++i)
            A[(size_t)p * m + i] = load(a, at, bt_i * sa + (ta == 111 ? i + (size_t)p * lda : p + (size_t)i * lda));
        widened = bt_i;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int p = 0; p < k; ++p) {
        const float bv = load(b, bt, bt_i * sb + (tb == 111 ? p + (size_t)j * ldb : j + (size_t)p * ldb));
        const float* ap = A.data() + (size_t)p * m;
        for (int i = 0; i < m; ++i) acc[i] += ap[i] * bv;
      }
      for (int i = 0; i < m; ++i) {
        // beta = 0: C is not read (BLAS convention), so NaN there must not leak into D.
        float v = al * acc[i];
        if (be != 0.f) v += be * load(c, ct, bt_i * sc + i + (size_t)j * ldc);
        store(d, dt, bt_i * sd + i + (size_t)j * ldd, v);
      }
    }
  };
  const size_t per = (cols + workers - 1) / workers;
  std::vector<std::thread> pool;
  pool.reserve(workers);
  size_t next = per;  // the calling thread takes [0, per)
  try {
    for (; next < cols; next += per) pool.emplace_back(columns, next, std::min(cols, next + per));
  } catch (const std::system_error&) {
    // No more threads: the calling thread does the rest too.
  }
  columns(0, std::min(cols, per));
  if (next < cols) columns(next, cols);
  for (auto& t : pool) t.join();
  check_guards("a rocBLAS GEMM");
  return status() ? 6 : 0;
}

int rocblas_gemm_ex(void*, int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int at, int lda,
                    const void* b, int bt, int ldb, const void* beta, const void* c, int ct, int ldc, void* d, int dt,
                    int ldd, int compute, int algo, int32_t sol, uint32_t flags) {
  if (algo != 0 || sol != 0 || flags != 0) return 11;
  return gemm(ta, tb, m, n, k, alpha, a, at, lda, 0, b, bt, ldb, 0, beta, c, ct, ldc, 0, d, dt, ldd, 0, 1, compute);
}

int rocblas_gemm_strided_batched_ex(void*, int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int at,
                                    int lda, int64_t sa, const void* b, int bt, int ldb, int64_t sb, const void* beta,
                                    const void* c, int ct, int ldc, int64_t sc, void* d, int dt, int ldd, int64_t sd,
                                    int batch, int compute, int algo, int32_t sol, uint32_t flags) {
  if (algo != 0 || sol != 0 || flags != 0) return 11;
  return gemm(ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt, ldb, sb, beta, c, ct, ldc, sc, d, dt, ldd, sd, batch,
              compute);
}
// --------------------------------------------------------------------------------- hipRTC
// Compiles with the clang named by $TRIMUL_FAKE_HIPRTC_CLANG, adding only what a real hipRTC
// implies (HIP language, device only, one linked object) plus -nogpuinc/-nogpulib since there are
// no ROCm headers or device libraries here. The caller's options are passed through unchanged and
// must name the target (--offload-arch=...), as real hipRTC needs.
struct Program {
  std::string src, name, code, log;
};
int hiprtcCreateProgram(void** prog, const char* src, const char* name, int nh, const char**, const char**) {
  if (!src || nh != 0) return 4;  // HIPRTC_ERROR_INVALID_INPUT
  *prog = new Program{src, name ? name : "prog.hip", "", ""};
  return 0;
}
int hiprtcCompileProgram(void* prog, int n, const char** opts) {
  Program* p = (Program*)prog;
  const char* clang = std::getenv("TRIMUL_FAKE_HIPRTC_CLANG");
  if (!clang) return 7;  // HIPRTC_ERROR_INTERNAL_ERROR
  static std::atomic<int> counter{0};
  const std::string base = "/tmp/trimul-fake-hiprtc-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  const std::string src = base + ".hip", obj = base + ".hsaco", log = base + ".log";
  FILE* f = std::fopen(src.c_str(), "w");
  if (!f) return 7;
  std::fwrite(p->src.data(), 1, p->src.size(), f);
  std::fclose(f);
  std::string cmd = std::string(clang) + " -x hip -nogpuinc -nogpulib --cuda-device-only --no-gpu-bundle-output -c";
  bool has_arch = false;
  for (int i = 0; i < n; ++i) {
    const std::string o = opts[i];
    if (o.rfind("--offload-arch=", 0) == 0) has_arch = true;
    if (o.find_first_of("'\"$`;&|<>") != std::string::npos) return 4;
    cmd += " '" + o + "'";
  }
  cmd += " " + src + " -o " + obj + " 2>" + log;
  const int rc = has_arch ? std::system(cmd.c_str()) : -1;
  auto slurp = [](const std::string& path) {
    std::string out;
    if (FILE* g = std::fopen(path.c_str(), "rb")) {
      char buf[4096];
      size_t k;
      while ((k = std::fread(buf, 1, sizeof buf, g)) > 0) out.append(buf, k);
      std::fclose(g);
    }
    return out;
  };
  p->log = has_arch ? slurp(log) : "no --offload-arch option";
  if (rc == 0) p->code = slurp(obj);
  std::remove(src.c_str());
  std::remove(obj.c_str());
  std::remove(log.c_str());
  return rc == 0 && !p->code.empty() ? 0 : 6;  // HIPRTC_ERROR_COMPILATION
}
int hiprtcGetCodeSize(void* prog, size_t* n) {
  *n = ((Program*)prog)->code.size();
  return 0;
}
int hiprtcGetCode(void* prog, char* out) {
  const std::string& c = ((Program*)prog)->code;
  std::memcpy(out, c.data(), c.size());
  return 0;
}
int hiprtcGetProgramLogSize(void* prog, size_t* n) {
  *n = ((Program*)prog)->log.size() + 1;
  return 0;
}
int hiprtcGetProgramLog(void* prog, char* out) {
  const std::string& l = ((Program*)prog)->log;
  std::memcpy(out, l.c_str(), l.size() + 1);
  return 0;
}
int hiprtcDestroyProgram(void** prog) {
  delete (Program*)*prog;
  *prog = nullptr;
  return 0;
}
const char* hiprtcGetErrorString(int r) { return r == 0 ? "HIPRTC_SUCCESS" : "HIPRTC_ERROR (fake)"; }
}  // extern "C"

extern "C" long trimul_fake_launches(const char* kernel) {
  std::lock_guard<std::mutex> g(launches_lock);
  auto it = launches.find(kernel);
  return it == launches.end() ? 0 : it->second;
}
// The launch record of the calling thread alone.
extern "C" long trimul_fake_thread_launches(const char* kernel) {
  auto it = thread_launches.find(kernel);
  return it == thread_launches.end() ? 0 : it->second;
}
