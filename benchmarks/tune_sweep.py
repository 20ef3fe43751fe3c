"""Every autotune config of every chunk kernel, timed at many shapes: the data behind the autotune keys.

    python benchmarks/tune_sweep.py [--regimes weak strong] [--shapes 1,8192,32 4,4096,32] [--json out.json]

For each shape (and regime) one fwd + bwd call runs with a fresh autotune key, so each autotuned kernel times
all its configs there (Triton's own benchmark: median of its timed runs). Printed per kernel: the time of each
config at each shape relative to that shape's best; what one config for every shape would lose against tuning
at every shape; and what the launchers' keys lose (kernels.common.tune_size, tune_lanes: each class tuned at
its first shape here). bf16, gate + l2norm + beta sigmoid in the op, K = V = 128 (--dim).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kda_ops  # noqa: E402
from kda_ops.kernels import bwd_inter, bwd_intra, bwd_state, common, fwd_intra, fwd_state, fwd_wu  # noqa: E402
from kda_ops.testing import make_inputs  # noqa: E402

TUNED = {
    "fwd_intra": (fwd_intra, "chunk_kda_fwd_kernel_intra"),
    "fwd_intra_rerun": (fwd_intra, "chunk_kda_fwd_kernel_intra_rerun"),
    "fwd_wu": (fwd_wu, "chunk_kda_fwd_kernel_wu"),
    "fwd_state": (fwd_state, "chunk_kda_fwd_kernel_state"),
    "bwd_state": (bwd_state, "chunk_kda_bwd_kernel_state"),
    "bwd_inter": (bwd_inter, "chunk_kda_bwd_kernel_inter"),
    "bwd_intra": (bwd_intra, "chunk_kda_bwd_kernel_intra"),
}
# (B, T, H): token counts from 2^9 to 2^15 per head, 1 to 64 sequences
SHAPES = [(1, 512, 32), (1, 1024, 32), (1, 2048, 32), (1, 4096, 32), (1, 8192, 32), (1, 16384, 32),
          (2, 2048, 32), (2, 4096, 32), (2, 8192, 32), (4, 1024, 32), (4, 2048, 32), (4, 4096, 32),
          (8, 1024, 32), (8, 2048, 32), (8, 4096, 32), (16, 512, 32), (16, 1024, 32), (32, 512, 32),
          (64, 256, 32), (2, 4096, 16), (8, 2048, 16), (1, 8192, 8)]


def config_name(c) -> str:
    cap = f",r{c.maxnreg}" if getattr(c, "maxnreg", None) else ""
    return ",".join(f"{k}{v}" for k, v in c.kwargs.items()) + f",w{c.num_warps},s{c.num_stages}" + cap


def parse_config_name(name: str):
    """The triton.Config that config_name writes as `name` (e.g. BK16,w8,s1,r128); ValueError if malformed."""
    import triton
    kwargs, opts = {}, {}
    for tok in name.split(","):
        m = re.fullmatch(r"([A-Za-z_]+?)(\d+)", tok)
        if m is None:
            raise ValueError(f"{tok!r} is not NAME<integer>")
        key, val = m.group(1), int(m.group(2))
        if key in ("w", "s", "r"):
            opts[{"w": "num_warps", "s": "num_stages", "r": "maxnreg"}[key]] = val
        else:
            kwargs[key] = val
    return triton.Config(kwargs, **opts)


def sweep(shapes, regimes, D):
    rows = []   # (kernel, B, T, H, regime, {config: ms})
    for mod, attr in TUNED.values():
        getattr(mod, attr).cache_results = False   # time every key here (TRITON_CACHE_AUTOTUNING would reuse)
    for i, ((B, T, H), regime) in enumerate(itertools.product(shapes, regimes)):
        tag = 1000 + 3 * i   # a fresh autotune key (never 1, never a multiple of 16)
        for mod, _ in TUNED.values():
            for name in ("tune_size", "tune_lanes"):
                if hasattr(mod, name):
                    setattr(mod, name, lambda *sizes, tag=tag: tag)
        x = make_inputs(B, T, H, D, regime=regime, device="cuda", dtype=torch.bfloat16, initial_state=True,
                        requires_grad=True)
        seen = {name: getattr(getattr(mod, attr), "configs_timings", None) for name, (mod, attr) in TUNED.items()}

        def collect(phase):
            # a kernel tuned in this phase holds a new timings dict (the backward reruns forward kernels
            # with other flags: those are reported as "<kernel> (bwd)")
            for name, (mod, attr) in TUNED.items():
                timings = getattr(getattr(mod, attr), "configs_timings", None)
                if timings is None or timings is seen[name]:
                    continue
                seen[name] = timings
                t = {config_name(c): (v[0] if isinstance(v, (list, tuple)) else v) for c, v in timings.items()}
                label = name if phase == "fwd" or name.startswith("bwd") else f"{name} (bwd)"
                rows.append((label, B, T, H, regime, t))

        o, ht = kda_ops.chunk_kda(**x, output_final_state=True)
        torch.cuda.synchronize()
        collect("fwd")
        (o.float().sum() + ht.sum()).backward()
        torch.cuda.synchronize()
        collect("bwd")
        print(f"  tuned {B},{T},{H} {regime}", flush=True)
    return rows


def report(rows):
    for name in dict.fromkeys(r[0] for r in rows):
        rs = [r for r in rows if r[0] == name]
        configs = list(rs[0][5])
        print(f"\n== {name}: ms of each config / that shape's best (best ms in the last column)")
        print("  " + " ".join(f"{c:>14s}" for c in configs))
        for _, B, T, H, regime, t in rs:
            best = min(t.values())
            cells = " ".join(f"{t[c] / best:14.3f}" for c in configs)
            print(f"  {cells}   {B},{T},{H} {regime}  best {best:.4f} ms")
        # one config for every shape: the loss summed over the shapes, relative to tuning at each
        total_best = sum(min(t.values()) for *_, t in rs)
        for c in configs:
            worst = max(t[c] / min(t.values()) for *_, t in rs)
            print(f"  fixed {c:>14s}: sum {sum(t[c] for *_, t in rs) / total_best:.3f} x, worst shape {worst:.3f} x")
        # the keys as the launchers compute them: each class tuned at its first shape in the list
        picked = {}
        for _, B, T, H, regime, t in rs:
            picked.setdefault((key_of(name, B, T, H), regime), min(t, key=t.get))
        loss = [t[picked[(key_of(name, B, T, H), regime)]] / min(t.values()) for _, B, T, H, regime, t in rs]
        print(f"  as keyed ({len(picked)} classes, each tuned at its first shape): worst shape {max(loss):.3f} x")


def key_of(kernel, B, T, H):
    """The size class kernel's launcher puts in its autotune key (fixed-length batches)."""
    return common.tune_lanes(B, H) if "state" in kernel else common.tune_size(B * T, H)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regimes", nargs="+", default=["weak", "strong"])
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--shapes", nargs="+", help="B,T,H each (default: the list in this file)")
    ap.add_argument("--json", help="write the raw timings here")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    rows = sweep(shapes, a.regimes, a.dim)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)
    report(rows)


if __name__ == "__main__":
    main()
