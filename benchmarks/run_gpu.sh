#!/bin/bash
# GPU tests and benchmarks on a CUDA machine, from the repository root:
#
#   bash benchmarks/run_gpu.sh [tests] [bench] [decode] [kernels]     (default: tests bench)
#
#   tests    pytest -m gpu (the kernels, the op and the tiny LM against fp64 references); log in $OUT
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
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
say() { echo "== $1 ($(date -u +%H:%M:%S))"; }
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
git log -1 --format='%h %s' 2>/dev/null | tee -a "$OUT/gpu.txt"
if has tests; then
  say "gpu tests"
  $PY -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/gpu_tests.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -20
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
