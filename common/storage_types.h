// The storage types of the kernels, shared with the CPU emulation (tests/hip_emu/emu.h): 64-bit
// indices, f16 as its raw 16-bit word, and the vectors of the 16- and 8-byte loads and stores.
#pragma once

typedef long long tm_i64;
typedef unsigned short tm_half;

// 16 bytes (8 halves) for vector loads and stores; both compilers honour the alignment.
typedef struct __attribute__((aligned(16))) {
  unsigned v[4];
} tm_u128;

typedef struct __attribute__((aligned(16))) {
  float v[4];
} tm_f4;

typedef struct __attribute__((aligned(8))) {
  unsigned v[2];
} tm_u64h;
