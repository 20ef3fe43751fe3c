# Sourced by run_device.sh and variants.sh on the lent GPU machine (not run on its own).
#   device_setup       carried wheels (.wheels) into /tmp/site, Triton / Python env, $OUT/gpu.txt
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
}

device_pack() {
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/autotune_cache.tgz" -T -)
  # the device tool brings back at most 8 files: one archive of the logs and JSONs, gpu.txt beside it
  tar czf "/tmp/$1.tgz" -C "$OUT" --exclude autotune_cache.tgz --exclude gpu.txt . \
    && find "$OUT" -mindepth 1 -maxdepth 1 ! -name autotune_cache.tgz ! -name gpu.txt -exec rm -rf {} + \
    && mv "/tmp/$1.tgz" "$OUT/$1.tgz" && ls -la "$OUT"
}
