#!/bin/bash
# GPU tests and benchmarks on a CUDA machine, from the repository root:
#
#   bash benchmarks/run_gpu.sh [tests] [bench] [decode] [kernels]     (default: tests bench)
#
#   tests    pytest -m gpu (the kernels, the op and the tiny LM against fp64 references): one pytest process
#            per test, $JOBS of them side by side (default 12), sharing the GPU, the Triton cache and (with
#            TRITON_CACHE_AUTOTUNING=1, the default here) the autotune results; one log per test in $OUT/tests,
#            then the count of failed and of skipped tests;
#            $TESTS picks what pytest collects (default: tests), e.g. TESTS="tests/test_gpu_fla.py"
#   bench    bench_kda.py: kda_ops beside FLA, every gate regime, fwd and fwd + bwd; rows appended to
#            benchmarks/results/kda.csv (extra arguments in $BENCH, e.g. BENCH="--all-shapes")
#   decode   bench_decode.py (decode step against FLA), JSON in $OUT
#   kernels  kernel_times.py, per-kernel times of fwd + bwd at (4, 4096, 32, 128)
#
# Logs go to $OUT (default ./out). FLA is optional: `pip install fla-core==0.6.0` first to compare. Set
# TRITON_CACHE_AUTOTUNING=1 to keep autotune results between runs (FLA and kda_ops autotune on first use).
set -o pipefail
OUT=$(realpath -m "${OUT:-out}"); mkdir -p "$OUT"
STEPS=${*:-tests bench}
PY=${PYTHON:-python}
JOBS=${JOBS:-12}
TESTS=${TESTS:-tests}
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
say() { echo "== $1 ($(date -u +%H:%M:%S))"; }
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
git log -1 --format='%h %s' 2>/dev/null | tee -a "$OUT/gpu.txt"
if has tests; then
  say "gpu tests ($JOBS processes at a time)"
  rm -rf "$OUT/tests"; mkdir -p "$OUT/tests"
  export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
  $PY -m pytest -q -p no:cacheprovider --collect-only -m gpu $TESTS > "$OUT/tests/collect.txt" 2>&1 \
    || { echo "collection failed: $OUT/tests/collect.txt"; status=1; }
  grep '::' "$OUT/tests/collect.txt" > "$OUT/tests/ids.txt" || { echo "no GPU tests collected"; status=1; }
  # one pytest process per test; the log name is the test id with every run of other characters as one _
  xargs -P "$JOBS" -I{} bash -c 'log="$2/$(echo "$1" | sed "s/^tests\///; s/[^A-Za-z0-9.=-]\+/_/g").log"
    $0 -m pytest -q -p no:cacheprovider -m gpu -rfE "$1" > "$log" 2>&1; echo "rc=$?" >> "$log"' \
    "$PY" {} "$OUT/tests" < "$OUT/tests/ids.txt"
  failed=$(grep -L "^rc=0$" "$OUT"/tests/*.log 2>/dev/null)
  skipped=$(grep -lE "^(=+ )?([0-9]+ [a-z]+, )*[0-9]+ skipped" "$OUT"/tests/*.log 2>/dev/null)
  echo "$(wc -l < "$OUT/tests/ids.txt") tests, $(echo "$failed" | grep -c .) failed, $(echo "$skipped" | grep -c .) skipped"
  for log in $skipped; do echo "SKIPPED: $(basename "$log" .log)"; done | head -20
  for log in $failed; do echo "FAILED: $(basename "$log" .log)"; grep -E "^(FAILED|ERROR|E )" "$log" | head -5; done
  [ -z "$failed" ] || status=1
fi
if has bench; then
  say "bench_kda"
  $PY benchmarks/bench_kda.py $BENCH 2>&1 | tee "$OUT/bench_kda.log" || status=1
fi
if has decode; then
  say "bench_decode"
  $PY benchmarks/bench_decode.py --json "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench_decode.log" || status=1
fi
if has kernels; then
  say "kernel_times"
  $PY benchmarks/kernel_times.py --mode fwdbwd --shape 4,4096,32,128 2>&1 | tee "$OUT/kernel_times.log" || status=1
fi
say "done (logs in $OUT)"
exit $status
