#!/usr/bin/env bash
# Session 36, fourth call (one NVIDIA H200): the register-operand input build
# (input_projection_sm90_rs). The CUDA tests (its own test printing its difference from the
# warp-specialised build), conformance; then stage times and `trimul bench` with it on and off
# (TRIMUL_CUDA_INPUT_RS=0), the output gate stored and made from x, af3 bf16 at N = 512, 1024,
# 2048, and the GPU MODE suite in bf16 I/O.
set -uo pipefail
d=/tmp/s36; rm -rf $d; mkdir -p $d /tmp/o; tar xJf .device/s36/bins.tar.xz -C $d
out=${OUT:-/tmp/out}; o=/tmp/o; mkdir -p "$out"
log="$out/run4.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log"
echo "=== rs test" | tee -a "$log"
TRIMUL_REQUIRE_DEVICE=1 timeout 100 $d/cuda register_operand --nocapture 2>&1 | grep -E "rel. L2|test result|panicked|FAILED|error" | cut -c1-200 | tee -a "$log"
echo "=== cuda (at ${SECONDS} s)" | tee -a "$log"
TRIMUL_REQUIRE_DEVICE=1 timeout 150 $d/cuda --test-threads=2 2>&1 | grep -E "test result|panicked|FAILED" | cut -c1-300 | tee -a "$log"
echo "=== cuda_graph, conformance (at ${SECONDS} s)" | tee -a "$log"
TRIMUL_REQUIRE_DEVICE=1 timeout 60 $d/cuda_graph 2>&1 | grep -E "test result|panicked" | tee -a "$log"
TRIMUL_REQUIRE_DEVICE=1 timeout 80 $d/conformance_cuda --test-threads=2 2>&1 | grep -E "test result|panicked|FAILED" | tee -a "$log"
for r in 1 2; do
  for rs in 1 0; do
    for g in stored from-x; do
      echo "=== stages rs $rs gate $g round $r (at ${SECONDS} s)" | tee -a "$log"
      TRIMUL_CUDA_INPUT_RS=$rs TRIMUL_CUDA_OUTPUT_GATE=$g timeout 40 $d/cuda_stage_times af3 bf16-io 512x1,1024x1,2048x1 2 2>&1 | tail -6 | tee -a "$log"
    done
  done
done
for r in 1 2; do
  for rs in 1 0; do
    echo "=== bench af3 bf16 rs $rs round $r (at ${SECONDS} s)" | tee -a "$log"
    TRIMUL_CUDA_INPUT_RS=$rs timeout 60 $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n 512,768,1024,1536,2048 --json "$o/af3-rs$rs-$r.json" 2>&1 | tail -7 | cut -c1-150 | tee -a "$log"
    echo "=== bench gpumode bf16 rs $rs round $r (at ${SECONDS} s)" | tee -a "$log"
    TRIMUL_CUDA_INPUT_RS=$rs timeout 60 $d/trimul bench --backend cuda --precision bf16-io --json "$o/gpumode-bf16-rs$rs-$r.json" 2>&1 | tail -9 | cut -c1-150 | tee -a "$log"
  done
done
tar czf "$out/run4.tgz" -C $o .
