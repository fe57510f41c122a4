#!/usr/bin/env bash
# Prepared in session 35 for the next GPU session (issue 30): hardware counters of trimul's input
# kernel and cuEquivariance's at N = 1024 (af3 bf16, C = H = 128), one launch each after the
# warm-up, with the clocks left alone. Needs the wheel in /tmp/tp and cuEquivariance in /tmp/cueq
# (see run3.sh); ncu reads counters on the Firecracker machines (KINDS.md). Four kernels at up to
# 110 s each: run it in a call of its own (10 minutes at most a command).
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for k in input_projection_sm90_ws project_persistent128 output_projection_resident finish_narrow; do
  PYTHONPATH=/tmp/tp:/tmp/cueq timeout 110 "$ncu" --clock-control none --target-processes all \
    --kernel-name "regex:$k" --launch-skip 3 --launch-count 1 --set full --csv --page details \
    python3 docs/perf/s35/kernels_probe.py 1024 > "$out/ncu-$k.csv" 2> "$out/ncu-$k.err"
  echo "$k: rc $?, $(wc -l < "$out/ncu-$k.csv") lines"
done
