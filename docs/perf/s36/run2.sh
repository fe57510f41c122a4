#!/usr/bin/env bash
# Session 36, second call (one NVIDIA H200): hardware counters (ncu --set full) of trimul's and
# cuEquivariance's stage kernels at N = 1024 (af3 bf16, C = H = 128), one launch after the
# warm-ups, clocks left alone: trimul's input kernel with the gate stored and without it (gate
# from x), its two output kernels, cuEquivariance's project and finish kernels.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
rm -rf /tmp/tp /tmp/cueq && mkdir -p /tmp/cueq && tar xJf .device/cueq-site.tar.xz -C /tmp/cueq
python3 -m pip install -q --no-deps --target /tmp/tp .device/s35/trimul-*.whl 2>&1 | tail -2
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
echo "ncu: $ncu"
prof() {  # name, kernel regex, gate mode
  TRIMUL_CUDA_OUTPUT_GATE=$3 PYTHONPATH=/tmp/tp:/tmp/cueq timeout 90 "$ncu" --clock-control none --target-processes all \
    --kernel-name "regex:$2" --launch-skip 3 --launch-count 1 --set full --csv --page details \
    python3 docs/perf/s35/kernels_probe.py 1024 > "$out/ncu-$1.csv" 2> "$out/ncu-$1.err"
  echo "$1: rc $?, $(wc -l < "$out/ncu-$1.csv") lines, at ${SECONDS} s"
}
prof input-stored input_projection_sm90_ws stored
prof output-resident output_projection_resident stored
prof cueq-project project_persistent128 stored
prof cueq-finish finish_narrow stored
prof input-nogate input_projection_sm90_ws from-x
prof output-xgate output_projection_sm90_xgate from-x
