#!/usr/bin/env bash
# Session 36, sixth call (one NVIDIA H200): main's build (the register-operand experiment
# removed), the long suite in af3 bf16 whole (N = 2048 … 8192) for the committed report, with
# the host's memory and the GPU's clock sampled every 5 s.
set -uo pipefail
d=/tmp/s36m; rm -rf $d; mkdir -p $d /tmp/o6; tar xJf .device/s36/main-bins.tar.xz -C $d
out=${OUT:-/tmp/out}; o=/tmp/o6; mkdir -p "$out"
log="$out/run6.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log"
(while true; do echo "$(date +%T) $(free -g | awk '/Mem/{print "used " $3 " avail " $7}') $(nvidia-smi --query-gpu=memory.used,clocks.sm,power.draw --format=csv,noheader)"; sleep 5; done) > "$o/mem.txt" 2>&1 &
mon=$!
s=$SECONDS
timeout 400 $d/trimul bench --backend cuda --suite long --formulation af3 --precision bf16-io --json "$out/h200-s36-long-af3-bf16.json" > "$o/long.txt" 2>&1
echo "rc $? after $((SECONDS - s)) s" | tee -a "$log"
kill $mon
cut -c1-170 "$o/long.txt" | tail -12 | tee -a "$log"
tar czf "$out/run6.tgz" -C $o .
