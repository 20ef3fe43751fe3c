#!/bin/bash
# One call on the lent GPU machine: carried wheels, GPU tests, benchmarks, MQAR, export, AOTI probe.
#
#   bash benchmarks/run_device.sh [step ...]     (repo root; carry .wheels; default: every step)
#   steps: tests configs fwd fwdbwd mqar export aoti profile (profile: Nsight Compute, not in the default)
#
# Each step has its own time limit and writes its log under $OUT (default ./out); at the end everything but
# gpu.txt and the autotune cache is packed into $OUT/results.tgz (device_env.sh), because the device tool brings
# back at most 8 files. Set KDA_OPS_AUTOTUNE=0 in the environment for first-config runs. Budget for every step:
# ~15 min (FLA autotunes for minutes on first use in fwd / fwdbwd; MQAR trains for ~3-4 min). Narrower runs:
# TESTS (pytest paths/args of the tests step, default every gpu test), CONFIGS (kernel names for -k of the
# configs step), BENCH (extra bench_kda.py arguments, e.g. "--providers kda_ops --shapes 1,8192,32,128").
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
STEPS=${*:-tests configs fwd fwdbwd mqar export aoti}
OUT=$(realpath "$OUT")
source "$(dirname "$0")/device_env.sh"
device_setup
export PYTHONPATH=/tmp/site:$PWD
git log -1 --format='%H %s' 2>/dev/null | tee -a "$OUT/gpu.txt"
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }

if has tests; then
  step tests
  KDA_OPS_AUTOTUNE=${KDA_OPS_AUTOTUNE:-0} timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider \
    -m gpu ${TESTS:-tests --ignore tests/test_gpu_configs.py} > "$OUT/gpu_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -20
fi
if has configs; then
  step configs
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_configs.py ${CONFIGS:+-k "$CONFIGS"} > "$OUT/configs.log" 2>&1
  grep -E "FAIL|passed|failed" "$OUT/configs.log" | tail -20
fi
if has fwd; then
  step fwd
  timeout 400 python3 benchmarks/bench_kda.py --mode fwd --stages --out "$OUT" $BENCH > "$OUT/bench_fwd.log" 2>&1
  grep -v "^\s*File\|^\s*\^" "$OUT/bench_fwd.log" | tail -25
fi
if has fwdbwd; then
  step fwdbwd
  timeout 500 python3 benchmarks/bench_kda.py --mode fwdbwd --stages --out "$OUT" $BENCH > "$OUT/bench_fwdbwd.log" 2>&1
  grep -v "^\s*File\|^\s*\^" "$OUT/bench_fwdbwd.log" | tail -25
fi
if has mqar; then
  step mqar
  # MQAR2: extra arguments of a second run, alongside (small kernels: the GPU has room for both)
  if [ -n "$MQAR2" ]; then
    timeout ${MQAR_TIMEOUT:-420} python3 examples/train_compiled.py --out "$OUT/mqar2" $MQAR2 > "$OUT/mqar2.log" 2>&1 &
  fi
  timeout ${MQAR_TIMEOUT:-420} python3 examples/train_compiled.py --out "$OUT/mqar" > "$OUT/mqar.log" 2>&1
  wait
  tail -3 "$OUT/mqar.log"; [ -n "$MQAR2" ] && tail -3 "$OUT/mqar2.log"
fi
if has profile; then
  step profile
  # one fwd + bwd, first configs (autotune would multiply the launches); the second iteration's kernels
  KDA_OPS_AUTOTUNE=0 timeout 300 ncu --clock-control none --set full --import-source yes -k regex:chunk_kda \
    --launch-skip ${NCU_SKIP:-9} --launch-count ${NCU_COUNT:-9} python3 benchmarks/profile_kda.py > "$OUT/ncu.txt" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Memory Throughput" "$OUT/ncu.txt" | head -60
fi
if has export; then
  step export
  timeout 200 python3 -m export --tiny --device cuda --formats pt2 --out /tmp/kda_export > "$OUT/export.log" 2>&1
  tail -8 "$OUT/export.log"
fi
if has aoti; then
  step aoti
  timeout 300 python3 benchmarks/aoti_probe.py > "$OUT/aoti_probe.log" 2>&1
  tail -c 3000 "$OUT/aoti_probe.log"
fi
step done
device_pack results
