"""Per-kernel GPU time of one call, kda_ops and FLA side by side (torch.profiler), to see which stage loses.

    python benchmarks/kernel_times.py --mode fwd --shape 4,4096,32,128 [--providers kda_ops fla]

Each provider is run until its autotuning is done, then ITERS calls are profiled; every kernel's total device
time is divided by ITERS (so a kernel launched twice per call shows its summed time). bf16, with the gate, the
q/k l2norm and the beta sigmoid inside the op, as bench_kda.py.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kda import fn_fla, fn_kda_ops, make_inputs  # noqa: E402

ITERS = 10


def kernel_times(f, backward):
    def step():
        o = f()
        if backward:
            o.backward(torch.ones_like(o))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(ITERS):
            step()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total / 1000.0 / ITERS       # ms per call
    return per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwd")
    ap.add_argument("--shape", default="4,4096,32,128")
    ap.add_argument("--providers", nargs="+", default=["kda_ops", "fla"])
    a = ap.parse_args()
    B, T, H, D = map(int, a.shape.split(","))
    bwd = a.mode == "fwdbwd"
    for prov in a.providers:
        x = make_inputs(B, T, H, D, torch.bfloat16, bwd)
        f = (fn_kda_ops if prov == "kda_ops" else fn_fla)(x, D, bwd)
        per = kernel_times(f, bwd)
        total = sum(per.values())
        print(f"== {prov} {a.mode} {(B, T, H, D)}: kernels sum {total:.3f} ms per call")
        for name, ms in sorted(per.items(), key=lambda kv: -kv[1]):
            if ms >= 0.005:
                print(f"  {ms:8.3f} ms  {name[:110]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
