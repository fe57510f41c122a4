#!/usr/bin/env bash
set -uo pipefail
d=.device/s34; out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
rm -rf /tmp/tp && python3 -m pip install -q --no-deps --target /tmp/tp $d/trimul-*.whl 2>&1 | tail -2
cp python/trimul/bench.py /tmp/tp/trimul/bench.py
for r in 1 2 3; do
  $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n 512,1024,2048 --device-time --json "$out/cli-held-$r.json" 2>&1 | grep -E "^n[0-9]" | sed "s/^/r$r CLI --device-time /" | tee -a "$out/alt.txt"
  PYTHONPATH=/tmp/tp python3 -m trimul.bench --sizes 512,1024,2048 --peers none --json "$out/py-$r.json" 2>&1 | grep -v Warning | sed "s/^/r$r python /" | tee -a "$out/alt.txt"
done
