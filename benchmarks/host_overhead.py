"""Host (CPU) time of one eager KDA call, layer by layer, FLA beside: where a call that the GPU finishes early
spends its time.

    python benchmarks/host_overhead.py [--shape 2,4096,16,64] [--decode 64,32,128] [--iters 300]

Each row is the CPU wall time of ITERS calls issued back to back without a synchronisation, divided by ITERS
(bench_kda.host_ms): the stable op through the dispatcher (torch.ops.kda_ops.*_v1), the public function under
no_grad (validation + the op's CUDA body; a plain eager call skips the dispatcher, docs/design.md), FLA's
function where FLA is installed, and forward + backward through autograd. The decode step (T = 1, with a
state) at --decode (B, H, K = V) first, then the chunked call at --shape. Inputs as bench_kda.py. The numbers
move between processes (up to ~2x): run it more than once.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kda import fn_fla, fn_kda_ops, host_ms, inputs, make_step, parse_shape  # noqa: E402

import kda_ops  # noqa: E402,F401  (registers torch.ops.kda_ops)
from kda_ops.testing import make_inputs  # noqa: E402


def op_args(x, D, output_final_state=None):
    """The stable op's flat arguments from make_inputs' keyword arguments (gate, l2norm, sigmoid in the op)."""
    head = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x.get("initial_state"), None,
            D ** -0.5, None, True, True, True, False)
    return head if output_final_state is None else head + (output_final_state,)


def fla_decode(x):
    from fla.ops.kda import fused_recurrent_kda
    return lambda: fused_recurrent_kda(**x, output_final_state=True)


def rows_of(label, rows, iters):
    with torch.no_grad():
        for name, make in rows:
            try:
                f = make()
            except ImportError as e:     # FLA absent: reported, not fatal
                print(f"  {'-':>7}  {label} {name}: {e}")
                continue
            print(f"  {host_ms(f, iters):7.3f}  {label} {name}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=parse_shape, default=(2, 4096, 16, 64), help="B,T,H,D (K = V = D)")
    ap.add_argument("--decode", type=lambda s: tuple(int(v) for v in s.split(",")), default=(64, 32, 128),
                    help="B,H,D of the decode step (K = V = D)")
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args()
    print(f"host ms per call, {a.iters} calls back to back")
    Bd, Hd, Dd = a.decode
    xd = make_inputs(Bd, 1, Hd, Dd, dtype=torch.bfloat16, device="cuda", initial_state=True)
    rows_of(f"decode {a.decode}", [
        ("op: torch.ops.kda_ops.recurrent_kda_v1",
         lambda: lambda: torch.ops.kda_ops.recurrent_kda_v1(*op_args(xd, Dd))),
        ("api: kda_ops.recurrent_kda", lambda: lambda: kda_ops.recurrent_kda(**xd)),
        ("fla: fused_recurrent_kda", lambda: fla_decode(xd))], a.iters)
    B, T, H, D = a.shape
    x = inputs(B, T, H, D, "weak", backward=True)
    rows_of(f"chunk {a.shape}", [
        ("op: torch.ops.kda_ops.chunk_kda_v1", lambda: lambda: torch.ops.kda_ops.chunk_kda_v1(*op_args(x, D, False))),
        ("api: kda_ops.chunk_kda", lambda: fn_kda_ops(x)),
        ("fla: chunk_kda", lambda: fn_fla(x))], a.iters)
    print(f"  {host_ms(make_step(fn_kda_ops(x), x, True), a.iters):7.3f}  chunk {a.shape} autograd: api forward "
          "+ backward", flush=True)


if __name__ == "__main__":
    main()
