#!/usr/bin/env bash
# Compiles every HIP kernel (hip/*.hip) for gfx942 (MI300) and gfx90a (MI200) exactly as build.rs
# does, checks that each result is a linked AMDGPU code object (what hipModuleLoadData loads), and
# that the MFMA kernels (those including hip/mfma.h) really contain v_mfma instructions.
#
# Installs nothing. Needs clang-19 and lld-19 (Debian: apt-get install clang-19 lld-19 llvm-19);
# override the tools with TRIMUL_HIP_CLANG, LLVM_OBJDUMP, LLVM_READELF. Exits non-zero on the
# first failure, printing the compiler's output. Usage: .ci/hip-kernels.sh [out-dir]
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$(mktemp -d)}"
mkdir -p "$out"
clang="${TRIMUL_HIP_CLANG:-clang++-19}"
objdump="${LLVM_OBJDUMP:-llvm-objdump-19}"
readelf="${LLVM_READELF:-llvm-readelf-19}"
archs=(gfx942 gfx90a)

for t in "$clang" "$objdump" "$readelf"; do
  command -v "$t" >/dev/null || { echo "hip-kernels: $t not found (apt-get install clang-19 lld-19 llvm-19)" >&2; exit 2; }
done
"$clang" --print-targets | grep -q amdgcn || { echo "hip-kernels: $clang has no AMDGPU target" >&2; exit 2; }

# The flags of build.rs (hip_clang_args): device-only, no ROCm headers or device libraries, linked
# (non-RDC HIP links with lld even under -c), plain ELF rather than an offload bundle.
flags=(-x hip -nogpuinc -nogpulib -O3 -std=c++17 --cuda-device-only --no-gpu-bundle-output)

fail=0
count=0
for src in "$root"/hip/*.hip; do
  stage="$(basename "$src" .hip)"
  for arch in "${archs[@]}"; do
    obj="$out/$stage.$arch.hsaco"
    if ! "$clang" "${flags[@]}" "--offload-arch=$arch" -I "$root" -c "$src" -o "$obj" 2>"$out/$stage.$arch.log"; then
      echo "FAIL $stage $arch: compile error"; cat "$out/$stage.$arch.log"; fail=1; continue
    fi
    header="$("$readelf" -h "$obj")"
    if ! grep -q 'Type:.*DYN' <<<"$header" || ! grep -q "Flags:.*$arch" <<<"$header"; then
      echo "FAIL $stage $arch: not a linked $arch code object"; echo "$header"; fail=1; continue
    fi
    notes="$("$readelf" --notes "$obj")"
    if ! grep -q "\.vgpr_spill_count: *0" <<<"$notes" || ! grep -q "\.private_segment_fixed_size: *0" <<<"$notes"; then
      echo "FAIL $stage $arch: register spills or scratch use"; grep -E "spill|private_segment" <<<"$notes"; fail=1
    fi
    if grep -q '#include "hip/mfma.h"' "$src"; then
      n="$("$objdump" -d "$obj" | grep -cE '^\s+v_mfma' || true)"
      if [ "$n" -eq 0 ]; then
        echo "FAIL $stage $arch: MFMA kernel without v_mfma instructions"; fail=1; continue
      fi
      # Occupancy by registers: a SIMD holds 512 VGPRs per lane (arch and AGPRs together on these
      # CDNA parts), allocated in granules of 8, at most 8 waves.
      vgpr="$(grep -oE '\.vgpr_count: *[0-9]+' <<<"$notes" | grep -oE '[0-9]+$' | head -1)"
      agpr="$(grep -oE '\.agpr_count: *[0-9]+' <<<"$notes" | grep -oE '[0-9]+$' | head -1)"
      sspill="$(grep -oE '\.sgpr_spill_count: *[0-9]+' <<<"$notes" | grep -oE '[0-9]+$' | head -1)"
      waves=$((512 / ((vgpr + 7) / 8 * 8)))
      [ "$waves" -gt 8 ] && waves=8
      echo "ok   $stage $arch ($n v_mfma; $vgpr VGPRs incl. $agpr AGPRs: $waves waves per SIMD; ${sspill:-0} SGPRs spilled to VGPR lanes)"
    else
      echo "ok   $stage $arch"
    fi
    count=$((count + 1))
  done
done
[ "$count" -gt 0 ] || { echo "hip-kernels: no hip/*.hip found" >&2; exit 2; }
if [ "$fail" -ne 0 ]; then
  echo "hip-kernels: FAILED"; exit 1
fi
echo "hip-kernels: $count code objects OK in $out"
