#!/bin/bash
# Several versions of the kernels side by side in ONE device call (kda_ops only, autotuned, same GPU state).
#
#   here:        bash benchmarks/variants.sh prepare NAME=REV ...   e.g. main=main v5=next/fwd-intra-v5
#                (git archive of kda_ops/, tests/, benchmarks/bench_kda.py and accuracy_gate_grads.py of each REV
#                 into .variants/NAME,
#                 git-ignored: carry ".variants" and ".wheels")
#   on the GPU:  OUT=$OUT bash benchmarks/variants.sh run NAME:MODE ...   e.g. main:fwd v5:fwd main:fwdbwd
#                knobs: SHAPES (bench_kda --shapes, default the two headline shapes), BENCH_TIMEOUT (s per run,
#                default 90; runs stop at END too), TESTV (a variant whose GPU tests run after the benchmarks, first configs, until
#                END seconds after the start, default 540), TESTS (pytest paths for TESTV), CONFIGS (module:kernel
#                names of tests/test_gpu_configs.py for TESTV); TESTV's tests run in parallel (device_tests).
# Each run writes its log and JSON under $OUT/NAME; the last lines of every log are printed, with each kernel's GPU
# time in the call (--stages: torch.profiler on the real fwd + bwd). Until session i --stages timed hand-called
# launchers, and those per-stage times moved by up to ~0.3 ms from call to call for the same code.
set -o pipefail
cmd=$1; shift
if [ "$cmd" = prepare ]; then
  for spec in "$@"; do
    name=${spec%%=*}; rev=${spec#*=}
    rm -rf ".variants/$name" && mkdir -p ".variants/$name"
    git archive "$rev" kda_ops tests benchmarks/bench_kda.py benchmarks/accuracy_gate_grads.py \
      | tar x -C ".variants/$name" || exit 1
    echo "$name: $(git rev-parse --short "$rev") $rev" | tee ".variants/$name/REV"
  done
  exit 0
fi
[ "$cmd" = run ] || { echo "usage: variants.sh prepare NAME=REV ... | run NAME:MODE ..." >&2; exit 2; }
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
source "$(dirname "$0")/device_env.sh"
END=${END:-540}
device_setup
cat .variants/*/REV | tee -a "$OUT/gpu.txt"
el() { echo "+$(( $(date +%s) - T0 ))s"; }
for spec in "$@"; do
  v=${spec%%:*}; mode=${spec#*:}
  echo "== $v $mode $(el)"
  t=$(lim "${BENCH_TIMEOUT:-90}")
  [ "$t" -le 5 ] && { echo "skipped: END reached"; continue; }
  (cd ".variants/$v" && PYTHONPATH=/tmp/site:$PWD timeout "$t" python3 benchmarks/bench_kda.py \
     --mode "$mode" --stages --providers kda_ops --shapes ${SHAPES:-1,8192,32,128 4,4096,32,128} \
     --out "$OUT/$v" > "$OUT/${v}_$mode.log" 2>&1)
  grep -v "^\s*File\|^\s*\^" "$OUT/${v}_$mode.log" | tail -6
done
if [ -n "$TESTV" ]; then
  echo "== tests $TESTV $(el)"
  export TESTS=${TESTS:-tests/test_gpu_fwd.py tests/test_gpu_bwd.py} CONFIGS
  (cd ".variants/$TESTV" && PYTHONPATH=/tmp/site:$PWD device_tests "$(left)" "$OUT/tests_$TESTV")
fi
echo "== done $(el)"
device_pack variants
