#!/usr/bin/env bash
# The main job of the README: build trimul with every backend, show what it found, check the
# best available backend against the f64 reference, and benchmark it. On a machine without a
# GPU that is the CPU (quick suite); with an AMD or NVIDIA GPU, the full GPU MODE suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh >/dev/null
cargo build --release --all-features
bin=target/release/trimul
"$bin" info
mkdir -p results
backend=$("$bin" info --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["selected"])' 2>/dev/null || echo cpu)
if [ "$backend" = "cpu" ]; then suite=quick; else suite=gpumode; fi
"$bin" check --backend "$backend" --suite "$suite"
"$bin" bench --backend "$backend" --suite "$suite" --json "results/bench-$backend-$(date -u +%Y%m%d-%H%M%S).json"
