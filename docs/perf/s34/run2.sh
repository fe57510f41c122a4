#!/usr/bin/env bash
# Session 34, second call: --device-time (CLI) and the device time inside PyTorch, alternated.
set -uo pipefail
d=.device/s34; out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$out/gpu.txt"
echo "=== held-timing test"
TRIMUL_REQUIRE_DEVICE=1 $d/cuda timing_with_the_stream_held --nocapture 2>&1 | grep -E "^test |test result|panicked|synchronising" | tee "$out/tests.txt"
rm -rf /tmp/tp && python3 -m pip install -q --no-deps --target /tmp/tp $d/trimul-*.whl 2>&1 | tail -2
cp python/trimul/bench.py /tmp/tp/trimul/bench.py
echo "=== alternated: CLI one call, CLI --device-time, python (one call, back to back, device time)" | tee "$out/alt.txt"
for r in 1 2 3; do
  $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n 512,1024,2048 2>&1 | tee -a "$out/cli.txt" | grep -E "^n[0-9]" | tee -a "$out/alt.txt"
  $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n 512,1024,2048 --device-time $([ $r = 1 ] && echo --json "$out/cli-held-1.json") 2>&1 | tee -a "$out/cli.txt" | grep -E "^n[0-9]|^timing|rror" | tee -a "$out/alt.txt"
  PYTHONPATH=/tmp/tp python3 -m trimul.bench --sizes 512,1024,2048 --peers none $([ $r = 1 ] && echo --json "$out/py-1.json") 2>&1 | grep -v Warning | tee -a "$out/alt.txt"
done
