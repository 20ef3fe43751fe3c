"""Per-kernel GPU time of one chunked KDA call, kda_ops and FLA side by side (torch.profiler).

    python benchmarks/kernel_times.py --mode fwd --shape 4,4096,32,128 [--regime strong] [--providers kda_ops fla]

With --ncu, one call per provider after the warm-up runs between cudaProfilerStart and cudaProfilerStop, and
nothing is timed: for Nsight Compute with the autotuned configs, e.g. the source-level stall samples of the
forward kernels,

    ncu --profile-from-start off --set full --import-source yes -k regex:chunk_kda_fwd -o fwd \
        python benchmarks/kernel_times.py --mode fwd --shape 1,8192,32,128 --providers kda_ops --ncu
    ncu -i fwd.ncu-rep --page source --csv --print-source sass -k regex:intra > intra.csv

With --pin KERNEL=CONFIG [...] each named kda_ops kernel runs at that one config, named as tune_sweep.py names
configs, whether or not its autotuner lists it; e.g. the forward intra kernel at 8 warps capped at 128 registers:

    python benchmarks/kernel_times.py --mode fwd --regime strong --providers kda_ops --pin fwd_intra=BK16,w8,s1,r128

Each provider is warmed up (autotuning done), then ITERS calls are profiled and every kernel's device time is
divided by ITERS: a kernel launched twice per call (e.g. a forward stage rerun by the backward) shows its sum.
Also printed: the host time of a call (bench_kda.host_ms); when it exceeds the kernels' sum the call is bound
by the host (Python, dispatch, launches). Inputs as bench_kda.py (kda_ops.testing.make_inputs, bf16).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kda import PROVIDERS, host_ms, inputs, kernel_ms, make_step, parse_shape  # noqa: E402
from kda_ops.testing import REGIMES  # noqa: E402

ITERS = 10


def pin(spec: str):
    """Pins a kernel to one config: 'KERNEL=CONFIG' (KERNEL a key of tune_sweep.TUNED, CONFIG as
    tune_sweep.config_name writes it, e.g. fwd_intra=BK16,w8,s1,r128) makes that config the autotuned kernel's only
    one. Returns (the autotuned kernel, the triton.Config)."""
    from tune_sweep import TUNED, parse_config_name
    name, _, cfg = spec.partition("=")
    if name not in TUNED:
        raise SystemExit(f"--pin {spec}: the kernel must be one of {sorted(TUNED)}")
    try:
        config = parse_config_name(cfg)
    except ValueError as e:
        raise SystemExit(f"--pin {spec}: {e}")
    module, attr = TUNED[name]
    kernel = getattr(module, attr)
    kernel.configs = [config]
    return kernel, config


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwd")
    ap.add_argument("--shape", type=parse_shape, default=(4, 4096, 32, 128), help="B,T,H,D (K = V = D)")
    ap.add_argument("--regime", choices=REGIMES, default="weak")
    ap.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS))
    ap.add_argument("--ncu", action="store_true", help="one profiled call per provider (for ncu), no timing")
    ap.add_argument("--pin", nargs="+", default=[], metavar="KERNEL=CONFIG",
                    help="run a kda_ops kernel at one config, e.g. fwd_intra=BK16,w8,s1,r128")
    a = ap.parse_args()
    for spec in a.pin:
        pin(spec)
    B, T, H, D = a.shape
    backward = a.mode == "fwdbwd"
    for name in a.providers:
        x = inputs(B, T, H, D, a.regime, backward)
        step = make_step(PROVIDERS[name](x), x, backward)
        if a.ncu:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            step()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            continue
        host = host_ms(step, ITERS)
        per, launches = kernel_ms(step, ITERS)
        print(f"== {name} {a.mode} {a.regime} {a.shape}: kernels {sum(per.values()):.3f} ms per call, "
              f"host {host:.3f} ms per call, {launches:.0f} launches")
        for kernel, ms in sorted(per.items(), key=lambda kv: -kv[1]):
            if ms >= 0.005:
                print(f"  {ms:8.3f} ms  {kernel[:110]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
