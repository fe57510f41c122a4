#!/usr/bin/env bash
# Session 36, eighth call (one NVIDIA H200): the register-operand input build taking the af3
# launches without the gate, and OutputGate::Auto making the gate from x where it runs. The CUDA
# tests, conformance, the Python op's tests, then `trimul bench` with the build on (the new
# default) and off (TRIMUL_CUDA_INPUT_RS=0: the warp-specialised build and the gate stored),
# alternated twice: af3 bf16 at N = 512 … 2048, and the af3 bf16 suite (GPU MODE's shapes).
set -uo pipefail
d=/tmp/s36c; rm -rf $d; mkdir -p $d /tmp/o8; tar xJf .device/s36/rs3.tar.xz -C $d
out=${OUT:-/tmp/out}; o=/tmp/o8; mkdir -p "$out"; log="$out/run8.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$log"
{
echo "=== cuda"; TRIMUL_REQUIRE_DEVICE=1 timeout 120 $d/cuda --test-threads=2 2>&1 | grep -E "test result|panicked|FAILED"
echo "=== cuda_graph"; TRIMUL_REQUIRE_DEVICE=1 timeout 60 $d/cuda_graph 2>&1 | grep -E "test result|panicked"
echo "=== conformance_cuda"; TRIMUL_REQUIRE_DEVICE=1 timeout 60 $d/conformance_cuda --test-threads=2 2>&1 | grep -E "test result|panicked|FAILED"
} 2>&1 | cut -c1-250 | tee -a "$log"
rm -rf /tmp/tp && python3 -m pip install -q --no-deps --target /tmp/tp .device/s36/trimul-*.whl .device/pywheels/*.whl 2>&1 | tail -2
echo "=== test_torch (at ${SECONDS} s)" | tee -a "$log"
PYTHONPATH=/tmp/tp TRIMUL_REQUIRE_DEVICE=1 timeout 200 python3 -m pytest -q -x -p no:cacheprovider python/tests/test_torch.py 2>&1 | tail -6 | tee -a "$log"
for r in 1 2; do
  for rs in 1 0; do
    echo "=== af3 bf16 rs $rs round $r (at ${SECONDS} s)" | tee -a "$log"
    TRIMUL_CUDA_INPUT_RS=$rs timeout 50 $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n 512,768,1024,1536,2048 --json "$o/af3-n-rs$rs-$r.json" 2>&1 | tail -7 | cut -c1-150 | tee -a "$log"
    echo "=== af3 bf16 suite rs $rs round $r" | tee -a "$log"
    TRIMUL_CUDA_INPUT_RS=$rs timeout 50 $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --json "$o/af3-suite-rs$rs-$r.json" 2>&1 | tail -9 | cut -c1-150 | tee -a "$log"
  done
done
tar czf "$out/run8.tgz" -C $o .
