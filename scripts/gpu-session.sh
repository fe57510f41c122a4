#!/usr/bin/env bash
# One call of the lent GPU machine (the `device` tool): the steps named as arguments, everything
# logged under $OUT, e.g. `bash scripts/gpu-session.sh tests conformance suites`.
# Build here first and copy the binaries into .device/ (see ../shared/DEVICE.md):
#   cargo build --release --features cuda --bins --examples
#   cargo test --release --features cuda --no-run      # prints the test executables
#   cp target/release/trimul target/release/examples/cuda_stage_times .device/
#   cp target/release/deps/{cuda,cuda_graph,conformance_cuda}-<hash> .device/{cuda,cuda_graph,conformance_cuda}
# Steps, run in the order given: tests (GPU tests and the graph test), conformance, stages (event
# timelines), suites (gpumode f32 and af3 bf16, JSON), other-suites (af3 f32, gpumode bf16 JSON; af3
# f16), cueq-shapes (af3 bf16 at N = 512/768/1024, three runs), long (N = 4096 unchunked and in
# 24 GB), long-bf16 (N = 4096 af3 bf16), sanitize (compute-sanitizer on the output kernels' test),
# l2-probe (scripts/probes/l2_setaside.py), device-io (tests/cuda_device_io.rs), python (the
# wheel in .device/ and pytest from .device/pywheels: python/tests on CUDA), python-bench (the op
# inside PyTorch against `trimul bench`, PyTorch and cuEquivariance from .device/cueq-site.tar.xz,
# alternated three times), fresh (GPU MODE's protocol: `trimul bench --fresh-weights` and
# custom_kernel, host time per call). The device returns at most 8 files from $OUT.
set -uo pipefail
d=.device
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$out/gpu.txt"
bench() { # label, then `trimul bench` arguments; output appended to $out/label.txt
  local label=$1; shift
  "$d/trimul" bench --backend cuda "$@" 2>>"$out/bench-stderr.txt" | tee -a "$out/$label.txt" | tail -12
}
for step in "$@"; do
  echo "=== $step"
  case $step in
    tests)
      "$d/trimul" info | tee "$out/info.txt"
      TRIMUL_REQUIRE_DEVICE=1 "$d/cuda" --test-threads=2 2>&1 | tee "$out/tests.txt" | grep -E "^test |test result|panicked|SKIPPED"
      TRIMUL_REQUIRE_DEVICE=1 "$d/cuda_graph" 2>&1 | tee -a "$out/tests.txt" | grep -E "^test |test result|panicked"
      ;;
    conformance)
      TRIMUL_REQUIRE_DEVICE=1 "$d/conformance_cuda" --test-threads=2 2>&1 | tee "$out/conformance.txt" | grep -E "test result|panicked|FAILED"
      ;;
    stages)
      "$d/cuda_stage_times" gpumode f32-io 2>&1 | tee -a "$out/stages.txt"
      "$d/cuda_stage_times" af3 bf16-io 2>&1 | tee -a "$out/stages.txt"
      ;;
    long-bf16)
      bench long-af3-bf16 --suite long --n 4096 --formulation af3 --precision bf16-io --json "$out/long-af3-bf16.json"
      ;;
    suites)
      bench suite-gpumode-f32 --suite gpumode --json "$out/gpumode.json"
      bench suite-af3-bf16 --suite gpumode --formulation af3 --precision bf16-io --json "$out/af3-bf16.json"
      ;;
    cueq-shapes)  # af3 bf16 at cuEquivariance's tuned shapes (B = 1, C = H = 128), three runs
      for r in 1 2 3; do
        bench cueq-shapes --suite gpumode --formulation af3 --precision bf16-io --n 512,768,1024
      done
      ;;
    other-suites)  # the remaining two formulation/precision pairs, and af3 in f16 (text only)
      bench suite-af3-f32 --suite gpumode --formulation af3 --json "$out/af3.json"
      bench suite-gpumode-bf16 --suite gpumode --precision bf16-io --json "$out/gpumode-bf16.json"
      bench suite-af3-f16 --suite gpumode --formulation af3 --precision f16-io
      ;;
    long)  # issue 6's N = 4096 bars: unchunked, and within a 24 GB budget
      bench long --suite long --n 4096 --json "$out/long.json"
      bench long --suite long --n 4096 --max-memory 24GB --json "$out/long-24gb.json"
      ;;
    sanitize)  # compute-sanitizer on the output kernels' tests: resident/plain (N = 64 and 40, every y
      # precision) and the gate made from x (N up to 96, B = 2: the WS input build with chunk_end 4)
      cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      for test in resident_output_kernel output_gate_from_x; do
        for tool in memcheck synccheck racecheck; do
          timeout 170 "$cs" --tool $tool "$d/cuda" $test > "$out/sanitize-$tool-$test.txt" 2>&1
          echo "$test $tool (rc $?): $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" "$out/sanitize-$tool-$test.txt" | tr '\n' ' ')"
          grep -E "Race reported|hazard" -A3 "$out/sanitize-$tool-$test.txt" | grep -E "output_projection|input_projection" | head -3
        done
      done
      ;;
    device-io)
      TRIMUL_REQUIRE_DEVICE=1 "$d/cuda_device_io" --test-threads=1 2>&1 | tee "$out/device-io.txt" | grep -E "^test |test result|panicked|rel L2|SKIPPED" | tail -40
      ;;
    python)
      rm -rf /tmp/tp && python3 -m pip install -q --no-deps --target /tmp/tp "$d"/trimul-*.whl "$d"/pywheels/*.whl
      PYTHONPATH=/tmp/tp python3 -c "import trimul; print(trimul.info())" | tee "$out/python-info.txt"
      PYTHONPATH=/tmp/tp TRIMUL_REQUIRE_DEVICE=1 python3 -m pytest -q -rs -p no:cacheprovider python/tests 2>&1 | tee "$out/python-tests.txt" | tail -40
      ;;
    python-bench)  # af3 bf16, B = 1, C = H = 128: `trimul bench` and the op inside PyTorch, alternated
      mkdir -p /tmp/cueq && tar xJf "$d/cueq-site.tar.xz" -C /tmp/cueq
      for r in 1 2 3; do
        bench cli-af3 --suite gpumode --formulation af3 --precision bf16-io --n 512,1024
        bench cli-af3 --suite long --formulation af3 --precision bf16-io --n 2048
        peers=none; [ $r = 1 ] && peers=torch,cueq
        PYTHONPATH=/tmp/tp:/tmp/cueq python3 -m trimul.bench --sizes 512,1024,2048 --peers $peers --json "$out/python-bench-$r.json" 2>&1 | tee -a "$out/python-bench.txt" | grep -v Warning
      done
      ;;
    fresh)  # GPU MODE's protocol: weights handed over on the device, prepared in every call
      bench fresh --suite gpumode --fresh-weights --json "$out/fresh.json"
      PYTHONPATH=/tmp/tp python3 -m trimul.bench --no-af3 --gpumode --host-time --json "$out/python-fresh.json" 2>&1 | tee -a "$out/python-fresh.txt" | grep -v Warning
      ;;
    l2-probe)
      PYTHONUNBUFFERED=1 python3 scripts/probes/l2_setaside.py 2>&1 | tee "$out/l2-probe.txt"
      ;;
  esac
done
