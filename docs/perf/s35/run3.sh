#!/usr/bin/env bash
# Session 35, third call (one NVIDIA H200): the final build (H200 entries in the embedded tuning
# table): `trimul info`, the CUDA tests, the whole Python suite on CUDA; the long suite in af3 bf16
# to N = 6144 (JSON) and N = 8192 alone; which kernels make up trimul's and cuEquivariance's device
# time (docs/perf/s35/kernels_probe.py).
set -uo pipefail
d=/tmp/s35; mkdir -p $d /tmp/o; tar xJf .device/s35/bins.tar.xz -C $d
out=${OUT:-/tmp/out}; o=/tmp/o; mkdir -p "$out"
log="$out/run3.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$log"
$d/trimul info 2>&1 | grep -E "cuda |tuning" | tee -a "$log"
{
echo "=== cuda"; TRIMUL_REQUIRE_DEVICE=1 timeout 120 $d/cuda --test-threads=2 2>&1 | grep -E "test result|panicked|FAILED"
echo "=== cuda_graph"; TRIMUL_REQUIRE_DEVICE=1 timeout 60 $d/cuda_graph 2>&1 | grep -E "test result|panicked"
echo "=== conformance_cuda"; TRIMUL_REQUIRE_DEVICE=1 timeout 60 $d/conformance_cuda --test-threads=2 2>&1 | grep -E "test result|panicked|FAILED"
} 2>&1 | tee -a "$log"
rm -rf /tmp/tp /tmp/cueq && mkdir -p /tmp/cueq && tar xJf .device/cueq-site.tar.xz -C /tmp/cueq
python3 -m pip install -q --no-deps --target /tmp/tp .device/s35/trimul-*.whl .device/pywheels/*.whl 2>&1 | tail -2
echo "=== kernels" | tee -a "$log"
PYTHONPATH=/tmp/tp:/tmp/cueq timeout 90 python3 docs/perf/s35/kernels_probe.py 512,1024,2048 2>&1 | grep -v -i warn | tee -a "$log"
echo "=== long af3 bf16 to 6144" | tee -a "$log"
timeout 100 $d/trimul bench --backend cuda --suite long --n 2048,3072,4096,6144 --formulation af3 --precision bf16-io --json "$o/long-af3-bf16.json" 2>&1 | tail -7 | cut -c1-150 | tee -a "$log"
echo "=== python tests" | tee -a "$log"
PYTHONPATH=/tmp/tp TRIMUL_REQUIRE_DEVICE=1 timeout 240 python3 -m pytest -q -rs -p no:cacheprovider python/tests 2>&1 | tail -30 | tee -a "$log"
echo "=== long af3 bf16 8192 (at ${SECONDS} s)" | tee -a "$log"
[ $SECONDS -lt 470 ] && timeout 80 $d/trimul bench --backend cuda --suite long --n 8192 --formulation af3 --precision bf16-io --repeats 3 --warmup 1 2>&1 | tail -4 | cut -c1-150 | tee -a "$log"
tar czf "$out/run3.tgz" -C $o .
