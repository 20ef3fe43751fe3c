"""bf16 gradient accuracy on the GPU where it is weakest: dA_log / ddt_bias (sums over every token of a head).

Prints every gradient's relative RMS error against autograd through the fp64 recurrence, for the eager public
op (or FLA's chunk_kda), on the bf16 cases that measured 1e-2 .. 2.1e-2 for dA_log on the H200 (2026-11-29,
benchmarks/results/gpu_session_2026-11-29d_H200.md). Inputs as in tests/test_gpu_bwd.py, seed 7.

    python benchmarks/accuracy_gate_grads.py [kda_ops|fla]      (FLA: no varlen case; its first call autotunes)
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from test_gpu_bwd import case, make, op_grads, reference_grads, rel_rms  # noqa: E402


def main():
    prov = sys.argv[1] if len(sys.argv) > 1 else "kda_ops"
    if prov == "fla":
        from fla.ops.kda import chunk_kda as impl
    else:
        from kda_ops import chunk_kda as impl
    cases = [case(2, 200, 2, 2, 64, in_op=True, initial_state=False, dht=False),
             case(1, 300, 2, 4, 128, in_op=True, initial_state=False, dht=False),
             case(1, 300, 4, 4, 128, in_op=True, initial_state=False, dht=False)]
    if prov != "fla":
        cases.append(case(1, 331, 2, 4, 128, in_op=True, lower_bound=-5.0, seqlens=[100, 37, 1, 193]))

    def fn(q, k, v, g, beta, **kw):
        o, ht = impl(q, k, v, g, beta, **kw)
        return o, (ht if ht is not None else o.new_zeros(()))

    for c, with_dht in (p.values for p in cases):
        inputs, kw, do, dht = make(c, seed=7)
        kw = dict(kw, output_final_state=with_dht)
        ref = reference_grads(inputs, dict(kw, output_final_state=True), do,
                              dht if with_dht else torch.zeros_like(dht))
        got = op_grads(fn, inputs, kw, do, dht if with_dht else torch.zeros((), device="cuda"))
        print(prov, c.id, {n: f"{rel_rms(x, ref[n]):.2e}" for n, x in got.items() if n in ref and n != "ht"},
              flush=True)


if __name__ == "__main__":
    main()
