"""Inputs for benchmarks and tests: one generator with named gate regimes.

The intra-chunk work of any KDA kernel depends on how fast the gate decays inside a chunk, so speed and
accuracy are always measured over these regimes (all with the gate, l2norm and beta sigmoid in the op):

    weak        A_log, dt_bias ~ 0.5 N(0, 1): slow decay
    layer_init  the initialisation of transformers' KimiLinear / FLA's KimiDeltaAttention layer:
                A_log = log U(1, 16), dt_bias = softplus^-1(dt) with log dt ~ U(log 1e-3, log 1e-1)
    strong      A_log = log U(1, 16), dt_bias ~ 0.1 N(0, 1): about 6 nats of decay per token
    safe_gate   strong, with lower_bound = -5 (the bounded gate; FLA's safe_gate=True)

q, k, v, the raw gate g and the beta logits are N(0, 1) in every regime.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

REGIMES = ("weak", "layer_init", "strong", "safe_gate")


def gate_params(regime: str, HV: int, K: int, generator: torch.Generator):
    """(A_log [HV], dt_bias [HV * K], lower_bound) of a regime, float32 on the CPU."""
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    if regime == "weak":
        return (0.5 * torch.randn(HV, generator=generator), 0.5 * torch.randn(HV * K, generator=generator), None)
    A_log = torch.log(torch.empty(HV).uniform_(1.0, 16.0, generator=generator))
    if regime == "layer_init":
        dt = torch.exp(torch.empty(HV * K).uniform_(math.log(1e-3), math.log(1e-1), generator=generator))
        dt = dt.clamp(min=1e-4)
        dt_bias = dt + torch.log(-torch.expm1(-dt))            # softplus(dt_bias) == dt
        return A_log, dt_bias, None
    dt_bias = 0.1 * torch.randn(HV * K, generator=generator)
    return A_log, dt_bias, (-5.0 if regime == "safe_gate" else None)


def make_inputs(B: int, T: int, H: int, K: int, V: Optional[int] = None, HV: Optional[int] = None, *,
                regime: str = "weak", dtype: torch.dtype = torch.bfloat16, device="cpu", seed: int = 0,
                cu_seqlens: Optional[list] = None, initial_state: bool = False, requires_grad: bool = False):
    """Keyword arguments for :func:`kda_ops.chunk_kda` (gate, l2norm and beta sigmoid in the op).

    Draws on the CPU from a seeded generator, then moves to ``device``: the same seed gives the same
    inputs on every device. With ``cu_seqlens`` (a list of offsets), B must be 1 and T == cu_seqlens[-1].
    A_log, dt_bias and the state are float32; q, k, v, g, beta are ``dtype``.
    """
    V = K if V is None else V
    HV = H if HV is None else HV
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    A_log, dt_bias, lower_bound = gate_params(regime, HV, K, gen)
    x = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, HV, V), g=randn(B, T, HV, K),
             beta=randn(B, T, HV))
    x = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    x.update(A_log=A_log.to(device), dt_bias=dt_bias.to(device))
    N = B
    if cu_seqlens is not None:
        if B != 1 or cu_seqlens[-1] != T:
            raise ValueError(f"cu_seqlens needs B == 1 and cu_seqlens[-1] == T, got B={B}, {cu_seqlens}")
        x["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
        N = len(cu_seqlens) - 1
    if initial_state:
        x["initial_state"] = (0.1 * randn(N, HV, K, V)).to(device)
    if requires_grad:
        for n, t in x.items():
            if t.is_floating_point():
                t.requires_grad_(True)
    x.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
             lower_bound=lower_bound)
    return x
