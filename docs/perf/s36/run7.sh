#!/usr/bin/env bash
# Session 36, seventh call (one NVIDIA H200): the register-operand input build's second version
# (branch rs-input-s36): LN_C's sums in four chains, the n128 form's stores through running
# pointers, and an n64 form (TRIMUL_CUDA_INPUT_RS=64). Its test, then the input stage's time for
# the three builds, gate stored and from x, af3 bf16 at N = 512, 1024, 2048.
set -uo pipefail
d=/tmp/s36r; rm -rf $d; mkdir -p $d; tar xJf .device/s36/rs2.tar.xz -C $d
out=${OUT:-/tmp/out}; mkdir -p "$out"; log="$out/run7.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$log"
for rs in 1 64; do
  echo "=== rs test, form $rs" | tee -a "$log"
  TRIMUL_CUDA_INPUT_RS=$rs TRIMUL_REQUIRE_DEVICE=1 timeout 60 $d/cuda register_operand --nocapture 2>&1 | grep -E "rel. L2|test result|panicked" | cut -c1-160 | tail -5 | tee -a "$log"
done
for r in 1 2; do
  for rs in 1 64 0; do
    for g in stored from-x; do
      echo "=== stages rs $rs gate $g round $r" | tee -a "$log"
      TRIMUL_CUDA_INPUT_RS=$rs TRIMUL_CUDA_OUTPUT_GATE=$g timeout 40 $d/cuda_stage_times af3 bf16-io 512x1,1024x1,2048x1 2 2>&1 | tail -6 | sed 's/ (LN, projections, gating)//; s/ (LayerNorm, gate.*, projection)//' | tee -a "$log"
    done
  done
done
