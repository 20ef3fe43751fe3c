"""Shared by the GPU comparison tests (test_gpu_regimes.py, test_gpu_fla.py): one graded call of a KDA function
with its gradients by name, and the markdown tables they print."""
from __future__ import annotations

import torch

# the gradient of each input, by the input's name
GRAD_OF = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0", A_log="dA_log",
               dt_bias="ddt_bias")


def run(fn, x: dict, do=None, dht=None, dtype=None) -> dict:
    """fn(**x, output_final_state=True) with every floating-point tensor of x a fresh copy (cast to ``dtype``
    when given). With ``do``: leaves, and backward of <o, do> + <ht, dht> in float64; returns o, ht and the
    gradient of each leaf by its name in GRAD_OF (None where fn gave none)."""
    grad = do is not None
    kw, leaves = {}, {}
    for name, t in x.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().to(dtype or t.dtype, copy=True).requires_grad_(grad)
            leaves[name] = t
        kw[name] = t
    with torch.set_grad_enabled(grad):
        o, ht = fn(**kw, output_final_state=True)
    out = dict(o=o.detach(), ht=ht.detach())
    if grad:
        ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
        out.update({GRAD_OF[name]: t.grad for name, t in leaves.items()})
    return out


FLA_FACTOR = 1.5      # dA_log / ddt_bias (and the model's 1-D parameters): at most this times FLA's error
FLA_BOUNDED = ("dA_log", "ddt_bias")


def load_fla():
    """FLA's chunk_kda, or (None, why)."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as e:
        return None, f"{type(e).__name__}: {e}"
    return chunk_kda, ""


def fla_call(chunk_kda):
    """FLA's chunk_kda called as its users call it: int64 offsets, safe_gate with a lower bound."""
    def call(*args, cu_seqlens=None, lower_bound=None, **kw):
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.long()
        return chunk_kda(*args, cu_seqlens=cu_seqlens, lower_bound=lower_bound, safe_gate=lower_bound is not None,
                         **kw)
    return call


def require_fla():
    """(FLA's chunk_kda wrapped by fla_call, or None when FLA is not importable); fails the test instead under
    KDA_OPS_REQUIRE_FLA=1."""
    import os

    import pytest
    chunk_kda, why = load_fla()
    if chunk_kda is None:
        if os.environ.get("KDA_OPS_REQUIRE_FLA") == "1":
            pytest.fail(f"KDA_OPS_REQUIRE_FLA=1 but FLA is not importable: {why}")
        return None
    return fla_call(chunk_kda)


def fmt(e) -> str:
    return "-" if e is None else f"{e:.2e}"


def markdown_table(header: list, rows: list) -> str:
    """header: column names; rows: lists of cells, already strings."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)
