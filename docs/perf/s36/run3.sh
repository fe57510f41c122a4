#!/usr/bin/env bash
# Session 36, third call (one NVIDIA H200): the same six stage kernels as run2.sh (N = 1024, af3
# bf16, C = H = 128), every raw counter (`--page raw`: stall reasons, shared-memory wavefronts and
# bank conflicts), and trimul's input kernel per SASS instruction (`--page source`), into one tar.
set -uo pipefail
out=${OUT:-/tmp/out}; o=/tmp/o3; mkdir -p "$out" $o
rm -rf /tmp/tp /tmp/cueq && mkdir -p /tmp/cueq && tar xJf .device/cueq-site.tar.xz -C /tmp/cueq
python3 -m pip install -q --no-deps --target /tmp/tp .device/s35/trimul-*.whl 2>&1 | tail -2
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
prof() {  # name, kernel regex, gate mode, page
  TRIMUL_CUDA_OUTPUT_GATE=$3 PYTHONPATH=/tmp/tp:/tmp/cueq timeout 80 "$ncu" --clock-control none --target-processes all \
    --kernel-name "regex:$2" --launch-skip 3 --launch-count 1 --set full --import-source no --csv --page $4 ${5:-} \
    python3 docs/perf/s35/kernels_probe.py 1024 > "$o/ncu-$1-$4.csv" 2> "$o/ncu-$1-$4.err"
  echo "$1 $4: rc $?, $(wc -l < "$o/ncu-$1-$4.csv") lines, at ${SECONDS} s" | tee -a $o/log.txt
}
prof input-stored input_projection_sm90_ws stored raw
prof input-stored input_projection_sm90_ws stored source "--print-source sass"
prof input-nogate input_projection_sm90_ws from-x raw
prof output-resident output_projection_resident stored raw
prof output-xgate output_projection_sm90_xgate from-x raw
prof cueq-project project_persistent128 stored raw
prof cueq-finish finish_narrow stored raw
tar cJf "$out/run3.tar.xz" -C $o .
