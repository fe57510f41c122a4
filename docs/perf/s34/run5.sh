#!/usr/bin/env bash
# Session 34, last call: the final build's GPU tests, and issue 27's A/B (the build before this
# session's clean-up, 8942042, against the final one; two alternations of both suites).
set -uo pipefail
d=.device/s34; out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
{
echo "=== cuda"; TRIMUL_REQUIRE_DEVICE=1 timeout 200 $d/cuda --test-threads=2 2>&1 | grep -E "^test |test result|panicked|pause"
echo "=== cuda_graph"; TRIMUL_REQUIRE_DEVICE=1 timeout 100 $d/cuda_graph 2>&1 | grep -E "^test |test result|panicked"
echo "=== conformance_cuda"; TRIMUL_REQUIRE_DEVICE=1 timeout 100 $d/conformance_cuda --test-threads=2 2>&1 | grep -E "test result|panicked|FAILED"
} 2>&1 | tee "$out/tests.txt"
for r in 1 2; do
  for bin in trimul-base trimul; do
    $d/$bin bench --backend cuda --suite gpumode 2>&1 | grep -E "^geomean" | sed "s/^/r$r $bin gpumode f32 /" | tee -a "$out/ab.txt"
    $d/$bin bench --backend cuda --suite gpumode --formulation af3 --precision bf16-io 2>&1 | grep -E "^geomean" | sed "s/^/r$r $bin af3 bf16 /" | tee -a "$out/ab.txt"
  done
done
rm -rf /tmp/tp && python3 -m pip install -q --no-deps --target /tmp/tp $d/trimul-*.whl .device/pywheels/*.whl 2>&1 | tail -2
echo "=== python: test_torch + device glue" | tee "$out/py.txt"
PYTHONPATH=/tmp/tp TRIMUL_REQUIRE_DEVICE=1 timeout 240 python3 -m pytest -q -p no:cacheprovider python/tests/test_torch.py python/tests/test_device_glue.py 2>&1 | tail -4 | tee -a "$out/py.txt"
PYTHONPATH=/tmp/tp python3 -m trimul.bench --sizes 512,1024 --peers none 2>&1 | grep -v Warning | tee -a "$out/py.txt"
