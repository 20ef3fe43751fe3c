"""FLA-compatible entry points: ``chunk_kda``, ``fused_recurrent_kda`` and ``fused_kda_gate``.

Each function has the parameter names, order, defaults and return conventions of
``fla.ops.kda`` (flash-linear-attention 0.6.0), so code written against FLA switches with one line::

    # from fla.ops.kda import chunk_kda, fused_recurrent_kda
    # from fla.ops.kda.gate import fused_kda_gate
    from kda_ops.fla_compat import chunk_kda, fused_recurrent_kda, fused_kda_gate

``chunk_kda`` and ``fused_recurrent_kda`` call :func:`kda_ops.chunk_kda` / :func:`kda_ops.recurrent_kda`,
hence the same custom ops: FLA-style code compiles with ``fullgraph=True`` and exports. FLA is never
imported.

Options that only steer FLA's kernels and leave the result unchanged are accepted and have no effect here:
``safe_gate`` (the bounded-gate fast path; kda_ops computes the exact result with or without it),
``disable_recompute``, ``cu_seqlens_cpu`` (kda_ops needs no host copy of the offsets), ``use_graph`` /
``max_num_seqs`` (kda_ops never synchronises with the host, so it is graph-capturable as is; padded
zero-length tail sequences are valid input) and ``chunk_size`` 32 or 64 in ``**kwargs``.
Options that would change the result and that kda_ops does not implement raise ``NotImplementedError``
naming the option: ``cp_context`` (context parallelism), ``return_intermediate_states=True``, a
``lower_bound`` outside ``[-5, 0)``, and a per-channel ``beta`` of shape ``[B, T, HV, V]``.
As in FLA, other keyword arguments are ignored, and the deprecated ``transpose_state_layout`` keyword is an
alias of ``state_v_first``.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import api

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_kda_gate"]


def _state_v_first_alias(state_v_first: bool, kwargs: dict) -> bool:
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    return state_v_first


def _check_lower_bound(lower_bound: Optional[float]) -> None:
    if lower_bound is not None and not -5.0 <= float(lower_bound) < 0.0:
        raise NotImplementedError(
            f"kda_ops.fla_compat: lower_bound={lower_bound} is not supported; kda_ops implements the bounded "
            "gate for lower_bound in [-5, 0)")


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: Optional[float] = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: Optional[int] = None,
    **kwargs,
):
    r"""FLA's ``fla.ops.kda.chunk_kda``, computed by :func:`kda_ops.chunk_kda`.

    Args:
        q, k: ``[B, T, H, K]``.  v: ``[B, T, HV, V]`` (``HV`` a multiple of ``H``).
        g: ``[B, T, HV, K]`` log decay, or the raw gate with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]``, or logits with ``use_beta_sigmoid_in_kernel``.
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` float32 (``[N, HV, V, K]`` with ``state_v_first``).
        output_final_state: return the final state in the same layout.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval: as in FLA;
            ``allow_neg_eigval`` requires ``use_beta_sigmoid_in_kernel``.
        safe_gate: accepted; with ``use_gate_in_kernel`` it requires ``lower_bound`` in ``[-5, 0)``.
        lower_bound: with ``use_gate_in_kernel``, the gate is
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then be None).
            Ignored without ``use_gate_in_kernel``, as in FLA.
        disable_recompute, cu_seqlens_cpu, use_graph, max_num_seqs: accepted (no effect on the result).
        return_intermediate_states: must be False (NotImplementedError otherwise).
        state_v_first: states are ``[N, HV, V, K]``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (``B == 1``).
        cp_context: must be None (NotImplementedError otherwise).
        **kwargs: ``A_log`` (``HV`` elements) and ``dt_bias`` (``HV * K`` elements), any float dtype and any
            shape, used with ``use_gate_in_kernel``; ``chunk_size`` (32 or 64); ``transpose_state_layout``
            (deprecated alias of ``state_v_first``). Anything else is ignored.

    Returns:
        ``(o [B, T, HV, V] in q's dtype, final_state or None)``.
    """
    state_v_first = _state_v_first_alias(state_v_first, kwargs)
    if cp_context is not None:
        raise NotImplementedError("kda_ops.fla_compat.chunk_kda: cp_context (context parallelism) is not supported")
    if return_intermediate_states:
        raise NotImplementedError(
            "kda_ops.fla_compat.chunk_kda: return_intermediate_states=True is not supported")
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if use_graph and cu_seqlens is not None and max_num_seqs is not None \
            and cu_seqlens.shape[0] - 1 != max_num_seqs:
        raise ValueError(
            f"cu_seqlens must be padded with zero-length tail sequences to exactly max_num_seqs + 1 entries, "
            f"got {cu_seqlens.shape[0] - 1} sequences with max_num_seqs={max_num_seqs}")
    A_log = dt_bias = None
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
        if A_log is None and lower_bound is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
        if safe_gate:
            if lower_bound is None:
                raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
            if not -5 <= lower_bound < 0:
                raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
        _check_lower_bound(lower_bound)
    else:
        lower_bound = None
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    return _native_chunk(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, cu_seqlens,
        state_v_first, A_log, dt_bias)


def fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    **kwargs,
):
    r"""FLA's ``fla.ops.kda.fused_recurrent_kda`` (token by token; decode), computed by
    :func:`kda_ops.recurrent_kda`.

    Same tensors as :func:`chunk_kda`, with ``A_log`` and ``dt_bias`` as the 6th and 7th parameters (used
    with ``use_gate_in_kernel`` only, as in FLA; without ``A_log`` the gate uses ``1`` in its place, as
    FLA's kernel does). ``initial_state`` of any float dtype is read in float32; the final state is float32
    (``[N, HV, V, K]`` with ``state_v_first``). The initial state is never modified.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state if output_final_state else None)``.
    """
    state_v_first = _state_v_first_alias(state_v_first, kwargs)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if beta.dim() == v.dim():
        raise NotImplementedError(
            "kda_ops.fla_compat.fused_recurrent_kda: a per-channel beta of shape [B, T, HV, V] is not supported")
    if use_gate_in_kernel:
        _check_lower_bound(lower_bound)
        if A_log is None and lower_bound is None:
            # FLA's kernel reads 1.0 in place of a missing A_log: g = -exp(1) * softplus(g + dt_bias)
            A_log = torch.ones(v.shape[2], dtype=torch.float32, device=v.device)
    else:
        A_log = dt_bias = lower_bound = None
    if initial_state is not None and initial_state.dtype not in (torch.float32, torch.float64):
        initial_state = initial_state.float()
    o, final_state = _native_recurrent(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, cu_seqlens,
        state_v_first, A_log, dt_bias)
    return o.to(v.dtype), final_state


def fused_kda_gate(
    g: Tensor,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    lower_bound: Optional[float] = None,
    output_dtype: torch.dtype = torch.float32,
) -> Tensor:
    r"""FLA's ``fla.ops.kda.gate.fused_kda_gate``: the KDA log decay from the raw gate, in torch.

    ``g`` is ``[..., H, K]``; ``A_log`` holds ``H`` elements, ``dt_bias`` ``H * K`` (any shape, any float
    dtype). Computed in float32, returned in ``output_dtype`` (``g``'s dtype when None)::

        lower_bound None:  -exp(A_log) * softplus(g + dt_bias)
        lower_bound set:   lower_bound * sigmoid(exp(A_log) * (g + dt_bias))

    Without ``A_log`` the factor is 1 in the sigmoid form and ``exp(1)`` in the softplus form, as in FLA's
    kernel. Differentiable in ``g``, ``A_log`` and ``dt_bias``; plain torch, so it compiles.
    """
    H, K = g.shape[-2], g.shape[-1]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(H, K)
    if lower_bound is None:
        a = A_log.float().reshape(H, 1).exp() if A_log is not None else math.e
        y = -a * F.softplus(x)
    else:
        y = lower_bound * torch.sigmoid(A_log.float().reshape(H, 1).exp() * x if A_log is not None else x)
    return y.to(g.dtype if output_dtype is None else output_dtype)


# ----------------------------------------------------------------------------------------------
# The calls into kda_ops' public functions.
# ----------------------------------------------------------------------------------------------
def _native_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, use_gate,
                  use_beta_sigmoid, allow_neg_eigval, lower_bound, cu_seqlens, state_v_first, A_log, dt_bias):
    return api.chunk_kda(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, use_gate,
        use_beta_sigmoid, allow_neg_eigval, lower_bound, cu_seqlens,
        state_v_first=state_v_first, A_log=A_log, dt_bias=dt_bias)


def _native_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, use_gate,
                      use_beta_sigmoid, allow_neg_eigval, lower_bound, cu_seqlens, state_v_first, A_log,
                      dt_bias):
    return api.recurrent_kda(
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm, use_gate, use_beta_sigmoid,
        allow_neg_eigval, lower_bound, cu_seqlens, output_final_state=output_final_state,
        state_v_first=state_v_first, A_log=A_log, dt_bias=dt_bias)

