#!/usr/bin/env bash
# Session 35, first call (one NVIDIA H200): main's GPU tests on this chip, every suite the committed
# report holds (gpumode in four formulation/precision pairs, long in two), and `trimul tune` on the
# GPU MODE shapes for both formulations. Binaries from .device/s35/bins.tar.xz (built here).
set -uo pipefail
d=/tmp/s35; mkdir -p $d /tmp/o; tar xJf .device/s35/bins.tar.xz -C $d
out=${OUT:-/tmp/out}; o=/tmp/o; mkdir -p "$out"
log="$out/run1.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv | tee "$log"
$d/trimul info 2>&1 | tee -a "$log"
{
echo "=== cuda"; TRIMUL_REQUIRE_DEVICE=1 timeout 200 $d/cuda --test-threads=2 2>&1 | grep -E "^test |test result|panicked|pause"
echo "=== cuda_graph"; TRIMUL_REQUIRE_DEVICE=1 timeout 100 $d/cuda_graph 2>&1 | grep -E "^test |test result|panicked"
echo "=== conformance_cuda"; TRIMUL_REQUIRE_DEVICE=1 timeout 100 $d/conformance_cuda --test-threads=2 2>&1 | grep -E "test result|panicked|FAILED"
} 2>&1 | tee -a "$log"
b() { local name=$1; shift; echo "=== bench $name: $*" | tee -a "$log"; timeout 120 $d/trimul bench --backend cuda "$@" --json "$o/$name.json" 2>&1 | tee "$o/$name.txt" | grep -E "^geomean|^[0-9]+,|N =|^ *[0-9]+ " | tail -12 | tee -a "$log"; }
b gpumode-f32 --suite gpumode
b af3-bf16 --suite gpumode --formulation af3 --precision bf16-io
b af3-f32 --suite gpumode --formulation af3
b gpumode-bf16 --suite gpumode --precision bf16-io
b long-af3-bf16 --suite long --formulation af3 --precision bf16-io
b long-gpumode-f32 --suite long
for f in gpumode af3; do
  echo "=== tune $f" | tee -a "$log"
  timeout 100 $d/trimul tune --suite gpumode --formulation $f --candidates 8 --out "$o/tune-gpumode-$f.json" 2>&1 | tee -a "$log" | grep -v '^ '
done
tar czf "$out/run1.tgz" -C $o .
