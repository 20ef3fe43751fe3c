"""Host (CPU) time of one KDA call, layer by layer: where a call that the GPU finishes early spends its time.

    python benchmarks/host_overhead.py [--shape 2,4096,16,64] [--iters 50]

Each row is the CPU wall time of ITERS calls issued back to back without a synchronisation, divided by ITERS
(the GPU runs behind; at small shapes it finishes first, so a timed benchmark there measures this). Layers,
from the kernels up: each launcher of kda_ops.kernels alone, the forward / backward launchers
(kernels.chunk_kda_fwd_triton / chunk_kda_bwd_triton), the ops through the dispatcher
(torch.ops.kda_ops.chunk_kda_fwd / chunk_kda_bwd), the public function with no grad, and forward + backward
through autograd. The differences between rows are what each layer adds. bf16, gate + l2norm + beta sigmoid
in the op, as bench_kda.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kda import make_inputs  # noqa: E402

import kda_ops  # noqa: E402
from kda_ops.kernels import chunk_kda_bwd_triton, chunk_kda_fwd_triton  # noqa: E402
from kda_ops.kernels.intra import chunk_kda_fwd_intra  # noqa: E402
from kda_ops.kernels.state import chunk_kda_fwd_state  # noqa: E402


def host_ms(f, iters):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    ms = (time.perf_counter() - t0) * 1000.0 / iters
    torch.cuda.synchronize()
    return ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2,4096,16,64")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    B, T, H, D = map(int, a.shape.split(","))
    x = make_inputs(B, T, H, D, torch.bfloat16, requires_grad=True)
    q, k, v, g, beta, A_log, dt_bias = (x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"))
    flags = (D ** -0.5, None, True, True, True, False)
    do = torch.randn_like(v)
    with torch.no_grad():
        intra = chunk_kda_fwd_intra(q, k, v, g, beta, A_log, dt_bias, None, *flags, lowp=True)
        o, ht, Aqk, Tm = chunk_kda_fwd_triton(q, k, v, g, beta, A_log, dt_bias, None, None, *flags, False)
    fwd_args = (q, k, v, g, beta, A_log, dt_bias, None, None, *flags, False)
    bwd_args = (do, None, q, k, v, g, beta, A_log, dt_bias, None, None, *flags)

    def api():
        return kda_ops.chunk_kda(q, k, v, g, beta, scale=D ** -0.5, use_qk_l2norm_in_kernel=True,
                                 use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=A_log,
                                 dt_bias=dt_bias)

    def fwdbwd():
        for t in x.values():
            t.grad = None
        api()[0].backward(do)

    rows = [
        ("kernels: intra + wu launchers (2 launches)",
         lambda: chunk_kda_fwd_intra(q, k, v, g, beta, A_log, dt_bias, None, *flags, lowp=True)),
        ("kernels: state launcher (1 launch)",
         lambda: chunk_kda_fwd_state(intra, None, None, False, v.dtype, store_o=True)),
        ("kernels: chunk_kda_fwd_triton", lambda: chunk_kda_fwd_triton(*fwd_args)),
        ("op: torch.ops.kda_ops.chunk_kda_fwd", lambda: torch.ops.kda_ops.chunk_kda_fwd(*fwd_args)),
        ("api: kda_ops.chunk_kda", api),
        ("kernels: chunk_kda_bwd_triton (saved Aqk, Tm)", lambda: chunk_kda_bwd_triton(*bwd_args, (Aqk, Tm))),
        ("op: torch.ops.kda_ops.chunk_kda_bwd", lambda: torch.ops.kda_ops.chunk_kda_bwd(*bwd_args, Aqk, Tm)),
    ]
    print(f"host ms per call, (B, T, H, K=V) = {(B, T, H, D)}, {a.iters} calls back to back")
    with torch.no_grad():
        for name, f in rows:
            print(f"  {host_ms(f, a.iters):7.3f}  {name}", flush=True)
    print(f"  {host_ms(fwdbwd, a.iters):7.3f}  autograd: api forward + backward", flush=True)


if __name__ == "__main__":
    main()
