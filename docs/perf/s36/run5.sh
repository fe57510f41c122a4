#!/usr/bin/env bash
# Session 36, fifth call (one NVIDIA H200): ncu of the register-operand input build at N = 1024
# (af3 bf16, C = H = 128) with the gate stored (5 chunks) and made from x (4 chunks): raw
# counters and per-SASS stall samples, from the CLI.
set -uo pipefail
d=/tmp/s36; rm -rf $d; mkdir -p $d; tar xJf .device/s36/bins.tar.xz -C $d
out=${OUT:-/tmp/out}; o=/tmp/o5; mkdir -p "$out" $o
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for g in stored from-x; do
  for page in raw source; do
    extra=""; [ $page = source ] && extra="--print-source sass"
    TRIMUL_CUDA_OUTPUT_GATE=$g timeout 100 "$ncu" --clock-control none --kernel-name regex:input_projection_sm90_rs \
      --launch-skip 2 --launch-count 1 --set full --import-source no --csv --page $page $extra \
      $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n 1024 --repeats 2 --warmup 1 \
      > $o/ncu-rs-$g-$page.csv 2> $o/ncu-rs-$g-$page.err
    echo "$g $page: rc $?, $(wc -l < $o/ncu-rs-$g-$page.csv) lines at ${SECONDS} s" | tee -a $o/log.txt
  done
done
tar cJf "$out/run5.tar.xz" -C $o .
