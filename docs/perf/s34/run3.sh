#!/usr/bin/env bash
set -uo pipefail
d=.device/s34; out=${OUT:-/tmp/out}; mkdir -p "$out"
rm -rf /tmp/tp && python3 -m pip install -q --no-deps --target /tmp/tp $d/trimul-*.whl 2>&1 | tail -2
cp python/trimul/bench.py /tmp/tp/trimul/bench.py
PYTHONPATH=/tmp/tp python3 docs/perf/s34/gap_probe.py 1024 2048 2>&1 | grep -v Warning | tee "$out/gap.txt"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for n in 1024 2048; do
  timeout 150 $ncu --clock-control none --metrics gpu__time_duration.sum --csv $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n $n --repeats 2 --warmup 1 > "$out/ncu-cli-$n.csv" 2>&1
  python3 - "$out/ncu-cli-$n.csv" <<'PY' | tee -a "$out/gap.txt"
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; ki = hdr.index("Kernel Name"); vi = hdr.index("Metric Value")
d = collections.defaultdict(list)
for r in rows[1:]:
    try: d[r[ki]].append(float(r[vi].replace(",", "")))
    except ValueError: pass
for k, v in d.items():
    print(f"CLI {sys.argv[1][-8:-4]} {k[:100]:100s} count {len(v):3d} median {sorted(v)[len(v)//2]:12.1f} {rows[1][hdr.index('Metric Unit')]}")
PY
done
for r in 1 2; do
  $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n 1024,2048 --device-time 2>&1 | grep -E "^n[0-9]" | sed 's/^/CLI held graphs off /' | tee -a "$out/gap.txt"
  TRIMUL_CUDA_GRAPHS=1 $d/trimul bench --backend cuda --formulation af3 --precision bf16-io --suite long --n 1024,2048 --device-time 2>&1 | grep -E "^n[0-9]" | sed 's/^/CLI held graphs on  /' | tee -a "$out/gap.txt"
done
