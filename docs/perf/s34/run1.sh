#!/usr/bin/env bash
# Session 34, first call: the thirty-third session's untested commits, then issue 24's latency.
set -uo pipefail
d=.device/s34; out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$out/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$out/gpu.txt"
{
echo "=== cuda_graph"; TRIMUL_REQUIRE_DEVICE=1 $d/cuda_graph 2>&1 | grep -E "^test |test result|panicked"
echo "=== conformance_cuda"; TRIMUL_REQUIRE_DEVICE=1 $d/conformance_cuda --test-threads=2 2>&1 | grep -E "test result|panicked|FAILED"
rm -rf /tmp/tp && python3 -m pip install -q --no-deps --target /tmp/tp $d/trimul-*.whl .device/pywheels/*.whl 2>&1 | tail -2
echo "=== test_torch + device glue"
PYTHONPATH=/tmp/tp TRIMUL_REQUIRE_DEVICE=1 timeout 240 python3 -m pytest -q -p no:cacheprovider python/tests/test_torch.py python/tests/test_device_glue.py 2>&1 | tail -6
} 2>&1 | tee "$out/tests.txt"
echo "=== latency probe" | tee "$out/latency.txt"
for n in 512 1024; do PYTHONPATH=/tmp/tp OUT=$out python3 docs/perf/s34/latency_probe.py $n 30 2>&1 | grep -v Warning | tee -a "$out/latency.txt"; done
echo "=== CLI vs function, alternated" | tee "$out/alt.txt"
for r in 1 2 3; do
  $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n 512,1024,2048 2>&1 | tee -a "$out/cli.txt" | tail -9 | tee -a "$out/alt.txt"
  PYTHONPATH=/tmp/tp python3 -m trimul.bench --sizes 512,1024,2048 --peers none 2>&1 | grep -v Warning | tee -a "$out/alt.txt"
done
