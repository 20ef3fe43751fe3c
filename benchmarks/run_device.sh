#!/bin/bash
# One device call: GPU forward tests, then the benchmark. Logs and JSON under $OUT (default ./out).
#   bash benchmarks/run_device.sh [fwd|fwdbwd|tests|all] [extra bench args...]
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
WHAT=${1:-all}; shift || true
if [ -d .wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
  KDA_OPS_AUTOTUNE=0 timeout 300 python3 -m pytest -q -rA -n 8 -p no:cacheprovider tests/test_gpu_fwd.py \
    > "$OUT/gpu_tests.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|: o |passed|failed" "$OUT/gpu_tests.log" | tail -40
fi
if [ "$WHAT" = all ] || [ "$WHAT" = fwd ]; then
  python3 benchmarks/bench_kda.py --mode fwd --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_fwd.log" | tail -30
fi
if [ "$WHAT" = fwdbwd ]; then
  python3 benchmarks/bench_kda.py --mode fwdbwd --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_fwdbwd.log" | tail -30
fi
