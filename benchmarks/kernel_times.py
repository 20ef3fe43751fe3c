"""Per-kernel GPU time of one call, kda_ops and FLA side by side (torch.profiler), to see which stage loses.

    python benchmarks/kernel_times.py --mode fwd --shape 4,4096,32,128 [--providers kda_ops fla]

Each provider is run until its autotuning is done, then ITERS calls are profiled; every kernel's total device
time is divided by ITERS (so a kernel launched twice per call shows its summed time). bf16, with the gate, the
q/k l2norm and the beta sigmoid inside the op, as bench_kda.py.

It also prints the host time of a call: the CPU wall time of ITERS calls issued back to back without a
synchronisation, divided by ITERS. When that exceeds the kernels' sum the call is bound by the host (Python,
dispatch, launches), and a timed benchmark of it measures the host. ``--cprofile`` adds the Python functions
that take the host time (cProfile over ITERS calls, by own time).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kda import fn_fla, fn_kda_ops, host_ms, kernel_ms, make_inputs  # noqa: E402

ITERS = 10


def kernel_times(f, backward, cprofile=False):
    """(ms per call of every kernel, host ms per call, device launches per call)."""
    def step():
        o = f()
        if backward:
            o.backward(torch.ones_like(o))
    host = host_ms(step, ITERS)
    if cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(ITERS):
            step()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    per, launches = kernel_ms(step, ITERS)
    return per, host, launches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwd")
    ap.add_argument("--shape", default="4,4096,32,128")
    ap.add_argument("--providers", nargs="+", default=["kda_ops", "fla"])
    ap.add_argument("--cprofile", action="store_true", help="print the Python functions that take the host time")
    a = ap.parse_args()
    B, T, H, D = map(int, a.shape.split(","))
    bwd = a.mode == "fwdbwd"
    for prov in a.providers:
        x = make_inputs(B, T, H, D, torch.bfloat16, bwd)
        f = (fn_kda_ops if prov == "kda_ops" else fn_fla)(x, D, bwd)
        per, host, launches = kernel_times(f, bwd, a.cprofile)
        total = sum(per.values())
        print(f"== {prov} {a.mode} {(B, T, H, D)}: kernels sum {total:.3f} ms per call, host {host:.3f} ms per call"
              f" ({launches:.0f} launches)")
        for name, ms in sorted(per.items(), key=lambda kv: -kv[1]):
            if ms >= 0.005:
                print(f"  {ms:8.3f} ms  {name[:110]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
