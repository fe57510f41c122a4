#!/usr/bin/env bash
# Session 36, first call (one NVIDIA H200): (1) the long suite in af3 bf16 at N = 6144 and 8192,
# which timed out four times in session 35, with the reworked 16-bit host path (254b653 and
# after), its exit status, wall time and the host's free memory sampled every 5 s; (2) the stage
# times with the output gate stored (the default) and made from x (TRIMUL_CUDA_OUTPUT_GATE),
# af3 bf16 at N = 512, 1024, 2048, and `trimul bench` of both, alternated twice.
set -uo pipefail
d=/tmp/s36; mkdir -p $d /tmp/o; tar xJf .device/s36/bins.tar.xz -C $d
out=${OUT:-/tmp/out}; o=/tmp/o; mkdir -p "$out"
log="$out/run1.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv | tee "$log"
nproc | sed 's/^/cores: /' | tee -a "$log"; free -g | tee -a "$log"
(while true; do echo "$(date +%T) $(free -g | awk '/Mem/{print "used " $3 " free " $4 " avail " $7}') $(nvidia-smi --query-gpu=memory.used,clocks.sm,power.draw --format=csv,noheader)"; sleep 5; done) > "$out/mem.txt" 2>&1 &
mon=$!
for n in 6144 8192; do
  echo "=== long af3 bf16 N = $n (at ${SECONDS} s)" | tee -a "$log"
  s=$SECONDS
  timeout 170 $d/trimul bench --backend cuda --suite long --n $n --formulation af3 --precision bf16-io --repeats 5 --warmup 2 --json "$o/long-af3-bf16-$n.json" > "$o/long-$n.txt" 2>&1
  echo "rc $? after $((SECONDS - s)) s" | tee -a "$log"
  tail -6 "$o/long-$n.txt" | cut -c1-160 | tee -a "$log"
done
kill $mon
for r in 1 2; do
  for g in stored from-x; do
    echo "=== stages, gate $g, round $r" | tee -a "$log"
    TRIMUL_CUDA_OUTPUT_GATE=$g timeout 60 $d/cuda_stage_times af3 bf16-io 512x1,1024x1,2048x1 3 2>&1 | tail -14 | tee -a "$log"
    echo "=== bench, gate $g, round $r" | tee -a "$log"
    TRIMUL_CUDA_OUTPUT_GATE=$g timeout 60 $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n 512,1024,2048 --repeats 15 --warmup 3 --json "$o/bench-$g-$r.json" 2>&1 | tail -6 | cut -c1-160 | tee -a "$log"
  done
done
tar czf "$out/run1.tgz" -C $o .
