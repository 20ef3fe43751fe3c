"""Chunked KDA speed and memory, kda_ops beside FLA in the same process, over the gate regimes.

    python benchmarks/bench_kda.py                                   # both modes, every regime, headline shapes
    python benchmarks/bench_kda.py --modes fwd --regimes strong safe_gate
    python benchmarks/bench_kda.py --shapes 1,8192,32,128 2,4096,8,256 --providers kda_ops
    python benchmarks/bench_kda.py --providers kda_ops fla fla_compat --modes fwd   # + the drop-in for FLA

Inputs come from kda_ops.testing.make_inputs (bf16; gate, q/k l2norm and beta sigmoid inside the op). In the
safe_gate regime kda_ops runs with lower_bound=-5 and FLA with safe_gate=True, lower_bound=-5 (its bounded-gate
mode). Each measurement appends one row to benchmarks/results/kda.csv (columns in CSV_COLUMNS) as soon as it is
taken, so a run cut short keeps what it measured. ``ms`` is the median of triton.testing.do_bench over one call
(fwd: forward under no_grad; fwdbwd: forward + backward through autograd), after one throwaway measurement
per provider; ``peak_extra_mib`` is the peak of torch.cuda.max_memory_allocated during one call minus the
memory allocated before it.
Only the public API is called (kda_ops.chunk_kda; provider fla_compat: kda_ops.fla_compat.chunk_kda, FLA's
signature, called as FLA is), so the script does not depend on how the kernels are split.
"""
from __future__ import annotations

import argparse
import collections
import csv
import datetime
import os
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kda_ops.testing import REGIMES, make_inputs  # noqa: E402

CSV_PATH = os.path.join(ROOT, "benchmarks", "results", "kda.csv")
CSV_COLUMNS = ["date", "commit", "gpu", "torch", "triton", "fla", "provider", "mode", "regime",
               "B", "T", "H", "K", "V", "ms", "peak_extra_mib"]
HEADLINE_SHAPES = [(1, 8192, 32, 128), (4, 4096, 32, 128)]
MORE_SHAPES = [(8, 4096, 16, 128), (1, 32768, 32, 128), (2, 4096, 16, 64), (2, 4096, 8, 256)]


def inputs(B, T, H, D, regime, backward, device="cuda"):
    """make_inputs' keyword arguments for chunk_kda (K = V = D)."""
    return make_inputs(B, T, H, D, regime=regime, dtype=torch.bfloat16, device=device, seed=0,
                       requires_grad=backward)


def fn_kda_ops(x):
    import kda_ops
    return lambda: kda_ops.chunk_kda(**x)[0]


def fla_call(chunk_kda, x):
    """One call of an FLA-signature chunk_kda on x, in FLA's bounded-gate mode (safe_gate) where x has a
    lower_bound."""
    kw = dict(x, safe_gate=x.get("lower_bound") is not None)
    return lambda: chunk_kda(**kw)[0]


def fn_fla(x):
    from fla.ops.kda import chunk_kda
    return fla_call(chunk_kda, x)


def fn_fla_compat(x):
    from kda_ops import fla_compat
    return fla_call(fla_compat.chunk_kda, x)


PROVIDERS = {"kda_ops": fn_kda_ops, "fla": fn_fla, "fla_compat": fn_fla_compat}
DEFAULT_PROVIDERS = ["kda_ops", "fla"]


def make_step(f, x, backward):
    """One timed call of f: the forward under no_grad, or forward + backward (gradients reset first)."""
    if not backward:
        def step():
            with torch.no_grad():
                f()
        return step
    leaves = [t for t in x.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    do = torch.randn_like(x["v"])

    def step():
        for t in leaves:
            t.grad = None
        f().backward(do)
    return step


def measure(step):
    """(median ms, peak extra MiB) of one call of step."""
    import triton
    step()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=50, rep=200, return_mode="median")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def host_ms(f, iters=10):
    """CPU wall ms per call over `iters` calls issued back to back without a synchronisation (after three warm
    calls): the host's share of a call. When it exceeds the GPU time the call is bound by the host."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    ms = (time.perf_counter() - t0) * 1000.0 / iters
    torch.cuda.synchronize()
    return ms


def kernel_ms(step, iters=5):
    """({kernel name: GPU ms per call}, launches per call) of step, from torch.profiler over `iters` calls."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    per, launches = collections.defaultdict(float), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total / 1000.0 / iters
            launches += 1
    return dict(per), launches / iters


def run_info():
    """The columns shared by every row of this run."""
    import triton
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kda_ops"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    # a copy of the tree without its git history (e.g. synced to a GPU machine) names its commit here
    commit = os.environ.get("KDA_OPS_COMMIT", commit)
    try:
        import fla
        fla_version = getattr(fla, "__version__", "unknown")
    except ImportError:
        fla_version = ""
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), commit=commit,
                gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                fla=fla_version)


def append_row(path, row):
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, lineterminator="\n")
        if new:
            w.writeheader()
        w.writerow(row)


def parse_shape(s):
    B, T, H, D = (int(v) for v in s.split(","))
    return B, T, H, D


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", choices=["fwd", "fwdbwd"], default=["fwd", "fwdbwd"])
    ap.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=HEADLINE_SHAPES,
                    help="B,T,H,D with K = V = D (default: the two headline shapes; --all-shapes adds four)")
    ap.add_argument("--all-shapes", action="store_true", help="the headline shapes and " + str(MORE_SHAPES))
    ap.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=DEFAULT_PROVIDERS)
    ap.add_argument("--csv", default=CSV_PATH, help="file the rows are appended to")
    ap.add_argument("--no-write", action="store_true", help="print only")
    a = ap.parse_args(argv)
    shapes = a.shapes + (MORE_SHAPES if a.all_shapes else [])
    providers = list(a.providers)
    if "fla" in providers:
        try:
            import fla.ops.kda  # noqa: F401
        except ImportError as e:
            print(f"FLA not importable ({e}): kda_ops only", file=sys.stderr)
            providers.remove("fla")
    info = run_info()
    print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, fla {info['fla'] or '-'}, "
          f"kda_ops {info['commit']}")
    print(f"{'B':>2} {'T':>6} {'H':>3} {'D':>4} {'regime':>10} {'mode':>6} | " +
          " | ".join(f"{p:>8} ms {'MiB':>6}" for p in providers) + " | x FLA")
    # one throwaway measurement per provider first: the first timing taken in a process can read high
    x = inputs(*shapes[0], a.regimes[0], a.modes[0] == "fwdbwd")
    for name in providers:
        try:
            measure(make_step(PROVIDERS[name](x), x, a.modes[0] == "fwdbwd"))
        except Exception:  # noqa: BLE001  (reported again, and skipped, at its row)
            pass
    del x
    for (B, T, H, D) in shapes:
        for regime in a.regimes:
            for mode in a.modes:
                backward = mode == "fwdbwd"
                x = inputs(B, T, H, D, regime, backward)
                got = {}
                for name in providers:
                    try:
                        got[name] = measure(make_step(PROVIDERS[name](x), x, backward))
                    except Exception:  # noqa: BLE001  (one failing provider or shape does not stop the run)
                        traceback.print_exc()
                        continue
                    if not a.no_write:
                        ms, mib = got[name]
                        append_row(a.csv, dict(info, provider=name, mode=mode, regime=regime, B=B, T=T, H=H,
                                               K=D, V=D, ms=f"{ms:.4f}", peak_extra_mib=f"{mib:.1f}"))
                cells = [f"{got[p][0]:11.3f} {got[p][1]:6.0f}" if p in got else f"{'n/a':>11} {'':>6}"
                         for p in providers]
                ratio = (f"{got['fla'][0] / got['kda_ops'][0]:.2f}x"
                         if "fla" in got and "kda_ops" in got else "")
                print(f"{B:>2} {T:>6} {H:>3} {D:>4} {regime:>10} {mode:>6} | " + " | ".join(cells) + f" | {ratio}",
                      flush=True)
                del x
                torch.cuda.empty_cache()
    if not a.no_write:
        print(f"appended to {a.csv}; `python benchmarks/table.py` rewrites the README table")


if __name__ == "__main__":
    main()
