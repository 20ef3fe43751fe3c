# Sourced by run_device.sh and variants.sh on the lent GPU machine (not run on its own).
#   device_setup       carried wheels (.wheels) into /tmp/site, Triton / Python env, $OUT/gpu.txt; starts the clock
#   left / lim S       seconds to the deadline END (seconds after device_setup; set by the calling script),
#                      at least 1 (timeout 0 would mean no limit); lim: the smaller of S and that
#   device_tests LIMIT LOGDIR   the GPU tests of the current directory in parallel processes (below)
#   device_pack NAME   autotune cache -> $OUT/autotune_cache.tgz; every other output -> $OUT/NAME.tgz
# Autotune results persist across calls: autotune_cache.tgz (the *.autotune.json files only, a few KB) comes back
# in $OUT; unpack it into .triton_cache (git-ignored) here and carry .triton_cache next call, so FLA's first-use
# autotune (minutes) and ours are skipped when the kernels and configs are unchanged.

device_setup() {
  if [ -d .wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl || exit 1
  fi
  export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
  mkdir -p "$TRITON_CACHE_DIR"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,driver_version --format=csv | tee "$OUT/gpu.txt"
  T0=$(date +%s)
}

left() { local l=$(( END - ($(date +%s) - T0) )); [ "$l" -lt 1 ] && l=1; echo "$l"; }
lim() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }

device_pack() {
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/autotune_cache.tgz" -T -)
  # the device tool brings back at most 8 files: one archive of the logs and JSONs, gpu.txt beside it
  tar czf "/tmp/$1.tgz" -C "$OUT" --exclude autotune_cache.tgz --exclude gpu.txt . \
    && find "$OUT" -mindepth 1 -maxdepth 1 ! -name autotune_cache.tgz ! -name gpu.txt -exec rm -rf {} + \
    && mv "/tmp/$1.tgz" "$OUT/$1.tgz" && ls -la "$OUT"
}

# The GPU tests all at once, under one limit (seconds): each pytest file of $TESTS (first configs) and each
# module:kernel of $CONFIGS (every autotune config; the child mode of tests/test_gpu_configs.py, a line per
# config) in its own process. They spend their time compiling on the CPU, so in parallel they take about as
# long as the longest one (session g: 190 s for all three files, > 345 s one after another).
device_tests() {
  local t=$1 dir=$2 f k
  mkdir -p "$dir"
  for f in $TESTS; do
    { KDA_OPS_AUTOTUNE=0 timeout "$t" python3 -m pytest -q -p no:cacheprovider -m gpu "$f"; echo "exit $?"; } \
      > "$dir/test_$(basename "$f" .py).log" 2>&1 &
  done
  for k in $CONFIGS; do
    { KDA_OPS_AUTOTUNE=1 PYTHONPATH=$PYTHONPATH:$PWD/tests timeout "$t" python3 tests/test_gpu_configs.py "$k"
      echo "exit $?"; } > "$dir/configs_${k#*:}.log" 2>&1 &
  done
  wait
  # exit 124: the limit cut it
  for f in $TESTS; do
    local log="$dir/test_$(basename "$f" .py).log"
    echo "$f: $(grep -E "passed|failed|skipped|error" "$log" | tail -1) ($(tail -1 "$log"))"
    grep -E "^(FAILED|ERROR)" "$log" | cut -c1-300
  done
  for k in $CONFIGS; do
    local log="$dir/configs_${k#*:}.log"
    echo "$k: $(grep -c ': ok' "$log") ok, $(grep -c 'FAIL' "$log") failed ($(tail -1 "$log"))"
    grep -E "FAIL|Error" "$log" | cut -c1-300 | tail -4
  done
}
