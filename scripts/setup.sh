#!/usr/bin/env bash
# Installs what building trimul's GPU kernels needs, on a machine with no GPU toolkit:
#   - nvcc 13.0 from PyPI (compiles cuda/*.cu for sm_80/sm_90a at build time), into .tools/nvcc
#   - clang-19 and lld-19 from Debian (compile hip/*.hip for gfx942/gfx90a; no ROCm needed)
# Idempotent; prints the environment to use (NVCC=...). Source it to export NVCC:
#   source scripts/setup.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
mkdir -p "$tools"

if ! command -v clang++-19 >/dev/null 2>&1 || ! command -v ld.lld-19 >/dev/null 2>&1 || ! command -v llvm-objdump-19 >/dev/null 2>&1; then
  echo "setup: installing clang-19, lld-19, llvm-19 (Debian)" >&2
  if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq clang-19 lld-19 llvm-19 >/dev/null
fi

nvcc="$tools/nvcc/nvidia/cu13/bin/nvcc"
if [ ! -x "$nvcc" ]; then
  echo "setup: installing nvcc 13.0 from PyPI into $tools/nvcc" >&2
  python3 -m pip install -q --disable-pip-version-check --target "$tools/nvcc" \
    "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" >/dev/null
fi
"$nvcc" --version | tail -1 >&2
export NVCC="$nvcc"
export TRIMUL_HIP_CLANG="$(command -v clang++-19)"
echo "NVCC=$NVCC"
