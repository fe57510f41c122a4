#!/usr/bin/env bash
# The test command of the README: installs the kernel compilers, then builds and tests the crate
# with every backend compiled in (GPU tests skip with a message when no GPU is present), checks
# that it also builds with no features and with each feature alone, then installs the Python
# package from this checkout exactly as the README says (`pip install ./python`) and runs its
# tests on the CPU, the fake-ROCm HIP path included (its CUDA cases skip with a message here and
# run on the GPU machine).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh >/dev/null
# clang-19/llvm-19 come from setup.sh, so the HIP code-object, disassembly and fake-ROCm tests must
# run, not skip.
TRIMUL_REQUIRE_HIP_CLANG=1 cargo test --all-features
cargo check --all-targets
cargo check --all-targets --features cuda
cargo check --all-targets --features rocm
source scripts/python-env.sh
"$PY" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps ./python
# From the tests' own directory's parent: the checkout's python/trimul (which has no compiled
# module) must not shadow the installed package.
TRIMUL_REQUIRE_HIP_CLANG=1 "$PYENV/bin/pytest" -q -p no:cacheprovider python/tests
