#!/usr/bin/env bash
# Session 35, second call (one NVIDIA H200): (1) the first call's tuning candidates (.device/s35/
# cand.json) against the built-in rules, alternated twice on the shapes they name, and a second
# tune of the GPU MODE shapes; (2) the long suite in af3 bf16 (the first call's run timed out at
# N = 6144); (3) the op inside PyTorch against cuEquivariance 0.13, af3 bf16, unmasked and masked,
# at issue 30's sizes.
set -uo pipefail
d=/tmp/s35; mkdir -p $d /tmp/o; tar xJf .device/s35/bins.tar.xz -C $d
out=${OUT:-/tmp/out}; o=/tmp/o; mkdir -p "$out"
log="$out/run2.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$log"
for r in 1 2; do
  for t in rules cand; do
    for f in "--formulation gpumode" "--formulation af3" "--formulation af3 --precision bf16-io"; do
      if [ $t = cand ]; then export TRIMUL_CUDA_TUNING=.device/s35/cand.json; else unset TRIMUL_CUDA_TUNING; fi
      timeout 60 $d/trimul bench --backend cuda --suite gpumode --n 768,1024 $f 2>&1 | grep -E "^n|^geomean" | sed "s/^/r$r $t $f: /" | cut -c1-120 | tee -a "$log"
    done
  done
done
unset TRIMUL_CUDA_TUNING
for f in gpumode af3; do
  echo "=== tune again $f" | tee -a "$log"
  timeout 90 $d/trimul tune --suite gpumode --formulation $f --candidates 8 --n 768,1024 --out "$o/tune2-$f.json" 2>&1 | grep -v '^ ' | tee -a "$log"
done
echo "=== long af3 bf16" | tee -a "$log"
timeout 200 $d/trimul bench --backend cuda --suite long --formulation af3 --precision bf16-io --json "$o/long-af3-bf16.json" 2>&1 | tee "$o/long-af3-bf16.txt" | tail -8 | cut -c1-150 | tee -a "$log"
rm -rf /tmp/tp /tmp/cueq && mkdir -p /tmp/cueq && tar xJf .device/cueq-site.tar.xz -C /tmp/cueq
python3 -m pip install -q --no-deps --target /tmp/tp .device/s35/trimul-*.whl 2>&1 | tail -2
for m in "" "--mask"; do
  echo "=== python bench $m" | tee -a "$log"
  PYTHONPATH=/tmp/tp:/tmp/cueq timeout 150 python3 -m trimul.bench --sizes 512,768,1024,1536,2048,2560,3072,4096 --peers cueq $m --json "$o/py-cueq$m.json" 2>&1 | grep -v Warning | tee -a "$log"
done
tar czf "$out/run2.tgz" -C $o .
