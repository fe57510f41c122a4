#!/usr/bin/env bash
# The test command of the README: installs the kernel compilers, then builds and tests the crate
# with every backend compiled in (GPU tests skip with a message when no GPU is present), and
# checks that it also builds with no features and with each feature alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh >/dev/null
# clang-19/llvm-19 come from setup.sh, so the HIP code-object, disassembly and fake-ROCm tests must
# run, not skip.
TRIMUL_REQUIRE_HIP_CLANG=1 cargo test --all-features
cargo check --all-targets
cargo check --all-targets --features cuda
cargo check --all-targets --features rocm
