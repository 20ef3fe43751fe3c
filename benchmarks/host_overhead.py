"""Host (CPU) time of one KDA call, layer by layer: where a call that the GPU finishes early spends its time.

    python benchmarks/host_overhead.py [--shape 2,4096,16,64] [--iters 50]

Each row is the CPU wall time of ITERS calls issued back to back without a synchronisation, divided by ITERS
(bench_kda.host_ms; the GPU runs behind, and at small shapes it finishes first, so a timed benchmark there
measures this): the ops through the dispatcher (torch.ops.kda_ops.chunk_kda_fwd / chunk_kda_bwd), the public
function with no grad, and forward + backward through autograd. bf16, gate + l2norm + beta sigmoid in the op,
as bench_kda.py. (The kernel launchers of kda_ops.kernels are not timed here: called outside the op,
torch.library.wrap_triton dispatches every launch through a higher-order op, 1-5 ms per call on the H200 in
session i, a path no user takes; inside the op torch turns that off.)
The numbers move by up to ~2x between processes: run it more than once.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kda import fn_kda_ops, host_ms, make_inputs, make_step  # noqa: E402

import kda_ops  # noqa: E402,F401  (registers torch.ops.kda_ops)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2,4096,16,64")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    B, T, H, D = map(int, a.shape.split(","))
    x = make_inputs(B, T, H, D, torch.bfloat16, requires_grad=True)
    q, k, v, g, beta, A_log, dt_bias = (x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"))
    flags = (D ** -0.5, None, True, True, True, False)
    fwd_args = (q, k, v, g, beta, A_log, dt_bias, None, None, *flags, False)
    bwd_args = (torch.randn_like(v), None, q, k, v, g, beta, A_log, dt_bias, None, None, *flags)
    with torch.no_grad():
        _, _, Aqk, Tm = torch.ops.kda_ops.chunk_kda_fwd(*fwd_args)
    api = fn_kda_ops(x, D, False)
    fwdbwd = make_step(fn_kda_ops(x, D, True), x, True)

    rows = [
        ("op: torch.ops.kda_ops.chunk_kda_fwd", lambda: torch.ops.kda_ops.chunk_kda_fwd(*fwd_args)),
        ("api: kda_ops.chunk_kda", api),
        ("op: torch.ops.kda_ops.chunk_kda_bwd (with the forward's Aqk, Tm)",
         lambda: torch.ops.kda_ops.chunk_kda_bwd(*bwd_args, Aqk, Tm)),
    ]
    print(f"host ms per call, (B, T, H, K=V) = {(B, T, H, D)}, {a.iters} calls back to back")
    with torch.no_grad():
        for name, f in rows:
            print(f"  {host_ms(f, a.iters):7.3f}  {name}", flush=True)
    print(f"  {host_ms(fwdbwd, a.iters):7.3f}  autograd: api forward + backward", flush=True)


if __name__ == "__main__":
    main()
