#!/bin/bash
# The recording call of a session on the lent GPU machine: the same-run comparison with FLA at the two headline
# shapes, then GPU tests, then what time is left for the six-shape forward table and per-kernel times.
#
#   bash benchmarks/record_run.sh       (repo root; carry .wheels and .triton_cache)
#
# Every step has its own limit and everything stops END seconds (default 520) after the start, so a step that
# runs long costs only the steps after it. Knobs: ROUNDS (of the forward comparison, default 2), TESTS (pytest
# paths of the first-config GPU tests), CONFIGS (module:kernel names of tests/test_gpu_configs.py), TESTS_LIMIT
# (seconds for all tests together, default 300), SIX (modes of the six-shape tables, default "fwd"; "fwd fwdbwd"
# for both; empty for none), END.
set -o pipefail
OUT=$(realpath "${OUT:-out}"); mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
END=${END:-520}
device_setup
export PYTHONPATH=/tmp/site:$PWD
step() { echo "== $1 (+$(( $(date +%s) - T0 ))s)"; }
show() { grep -v "^\s*File\|^\s*\^\|[Ww]arn" "$1" | tail -"${2:-8}"; }
S="1,8192,32,128 4,4096,32,128"

step "fwd, ${ROUNDS:=2} round(s)"
timeout "$(lim 130)" python3 benchmarks/bench_kda.py --mode fwd --rounds "$ROUNDS" --shapes $S --out "$OUT" > "$OUT/bench_fwd.log" 2>&1
show "$OUT/bench_fwd.log"
step fwdbwd
timeout "$(lim 160)" python3 benchmarks/bench_kda.py --mode fwdbwd --shapes $S --out "$OUT" > "$OUT/bench_fwdbwd.log" 2>&1
show "$OUT/bench_fwdbwd.log"
# Tests after the timed runs, all at once (device_env.sh: device_tests)
step "gpu tests: ${TESTS:=tests/test_gpu_model.py}; configs: ${CONFIGS:=intra:chunk_kda_fwd_kernel_intra intra:chunk_kda_fwd_kernel_wu}"
export TESTS CONFIGS
device_tests "$(lim "${TESTS_LIMIT:-300}")" "$OUT"
step "kernel times, fwd (4, 4096, 32, 128)"
timeout "$(lim 60)" python3 benchmarks/kernel_times.py --mode fwd --shape 4,4096,32,128 > "$OUT/kernel_times_fwd.log" 2>&1
show "$OUT/kernel_times_fwd.log" 30
for mode in ${SIX-fwd}; do   # SIX= (empty): none
  step "$mode, six shapes"
  timeout "$(left)" python3 benchmarks/bench_kda.py --mode "$mode" --out "$OUT" > "$OUT/bench_${mode}6.log" 2>&1
  show "$OUT/bench_${mode}6.log" 14
done
step done
device_pack results
