"""Host (CPU) time of one eager KDA call, layer by layer: where a call that the GPU finishes early spends its time.

    python benchmarks/host_overhead.py [--shape 2,4096,16,64] [--iters 50]

Each row is the CPU wall time of ITERS calls issued back to back without a synchronisation, divided by ITERS
(bench_kda.host_ms): the stable op through the dispatcher (torch.ops.kda_ops.chunk_kda_v1), the public function
under no_grad (validation + the op), and forward + backward through autograd. Inputs as bench_kda.py.
The numbers move between processes (up to ~2x): run it more than once.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kda import fn_kda_ops, host_ms, inputs, make_step, parse_shape  # noqa: E402

import kda_ops  # noqa: E402,F401  (registers torch.ops.kda_ops)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=parse_shape, default=(2, 4096, 16, 64), help="B,T,H,D (K = V = D)")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    B, T, H, D = a.shape
    x = inputs(B, T, H, D, "weak", backward=True)
    op_args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], None, None, D ** -0.5, None,
               True, True, True, False, False)
    rows = [("op: torch.ops.kda_ops.chunk_kda_v1", lambda: torch.ops.kda_ops.chunk_kda_v1(*op_args)),
            ("api: kda_ops.chunk_kda", fn_kda_ops(x))]
    print(f"host ms per call, (B, T, H, K=V) = {a.shape}, {a.iters} calls back to back")
    with torch.no_grad():
        for name, f in rows:
            print(f"  {host_ms(f, a.iters):7.3f}  {name}", flush=True)
    print(f"  {host_ms(make_step(fn_kda_ops(x), x, True), a.iters):7.3f}  autograd: api forward + backward")


if __name__ == "__main__":
    main()
