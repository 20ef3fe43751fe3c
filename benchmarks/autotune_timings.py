"""Print what the autotuner timed: every config of every cached autotune result, fastest first.

    python benchmarks/autotune_timings.py [.triton_cache]

The device calls bring back the *.autotune.json files of TRITON_CACHE_DIR (autotune_cache.tgz, unpacked into
the git-ignored .triton_cache); the session records' "autotune timings" were read this way. Each line: the
key's non-dtype entries (K, V, flags, precision, TUNE_SIZE), then config: median ms.
"""
import glob
import json
import os
import sys


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else ".triton_cache"
    for path in sorted(glob.glob(os.path.join(root, "**", "*.autotune.json"), recursive=True), key=os.path.getmtime):
        d = json.load(open(path))
        key = [x for x in d["key"] if not str(x).startswith("torch.")]
        rows = sorted(d["configs_timings"], key=lambda c: c[1][0])
        cfg = lambda c: "%s w%d s%d" % (",".join(f"{a}{b}" for a, b in c["kwargs"].items()),  # noqa: E731
                                        c["num_warps"], c["num_stages"])
        print(key, " | ".join(f"{cfg(c)}: {t[0]:.3f}" for c, t in rows))


if __name__ == "__main__":
    main()
