"""Shared by the GPU comparison tests (test_gpu_regimes.py, test_gpu_fla.py): one graded call of a KDA function
with its gradients by name, and the markdown tables they print."""
from __future__ import annotations

import contextlib
import sys

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


def fla_autotuners() -> list:
    """The Triton autotuners of FLA's modules imported so far (a module attribute, or the autotuner under a
    heuristics wrapper)."""
    from triton.runtime.autotuner import Autotuner
    found = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for obj in list(vars(mod).values()):
            for o in (obj, getattr(obj, "fn", None)):
                if isinstance(o, Autotuner):
                    found[id(o)] = o
    return list(found.values())


_FIRST_CONFIG_CACHE: dict = {}   # id(autotuner) -> its tuned keys under fla_first_configs


@contextlib.contextmanager
def fla_first_configs():
    """Inside the block (an FLA forward and its backward) each FLA autotuner runs the first of its configs that
    its own pruning keeps; after it, each is as before (its configs, its cache of tuned keys). The accuracy
    tests compare errors, which do not need FLA's tuning, and that tuning compiles every config of every FLA
    kernel at each new shape (minutes per shape on the H200). KDA_OPS_FLA_AUTOTUNE=1 keeps FLA's tuning."""
    import os
    if os.environ.get("KDA_OPS_FLA_AUTOTUNE") == "1":
        yield
        return
    saved = []
    for t in fla_autotuners():
        saved.append((t, t.__dict__.get("prune_configs"), dict(t.cache)))
        t.prune_configs = lambda kwargs, _prune=t.prune_configs: _prune(kwargs)[:1]
        t.cache.clear()
        t.cache.update(_FIRST_CONFIG_CACHE.get(id(t), {}))
    try:
        yield
    finally:
        for t, own, cache in saved:
            _FIRST_CONFIG_CACHE[id(t)] = dict(t.cache)
            if own is None:
                del t.prune_configs
            else:
                t.prune_configs = own
            t.cache.clear()
            t.cache.update(cache)


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
