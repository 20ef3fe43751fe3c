"""Every torch.library registration of kda_ops, in one place.

Public ops (``torch.ops.kda_ops.*``), all ``triton_op``s so that torch.compile sees through them to the
Triton kernels on CUDA and torch.export keeps each as one node:

    chunk_kda_fwd(q, k, v, g, beta, A_log?, dt_bias?, initial_state?, cu_seqlens?, scale, lower_bound?,
                  use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state)
        -> (o [B, T, HV, V], final_state [N, HV, K, V] or empty, Aqk, Tm)
    chunk_kda_bwd(do, dht?, <the forward's inputs but output_final_state>, saved_Aqk?, saved_Tm?)
        -> (dq, dk, dv, dg, dbeta, dA_log or empty, ddt_bias or empty, dh0 or empty)
    recurrent_kda(<the forward's inputs, initial_state required>) -> (o, final_state)   # decode step

A ``triton_op`` cannot return None: an absent output is an empty tensor, mapped back to None in api.py.
Aqk and Tm are what the forward keeps for the backward beyond its inputs (on CUDA: the intra-chunk stage's
[B, T, HV, 64] Aqk and (I + L)^-1, bf16 for bf16 v, else fp32; elsewhere empty): the backward takes them
instead of recomputing them, which is most of the intra stage's work. api.py drops them.
CUDA runs our Triton kernels (kda_ops/kernels); every other device runs the torch implementation of
reference.py behind an opaque ``custom_op`` (``*_torch``): its Python loop over chunks would otherwise
specialise the sequence length under torch.compile and recompile for every new length.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op, triton_op

from . import kernels, reference

_EMPTY_SHAPE = (0,)
# Chunk size of the torch implementation. Any size gives the same result; on CPU its cost is dominated by
# the per-pair decay tensor [C, C, K] of every chunk, and 16 ran 4-10x faster than 64 for T in 16..1024
# (fwd + bwd, `python benchmarks/bench_cpu.py` on the 2-core CI machine, 2026-11-29).
TORCH_CHUNK_SIZE = 16


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _num_seqs(q: Tensor, cu_seqlens: Optional[Tensor]):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _or_empty(x: Optional[Tensor], like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    return like.new_empty(_EMPTY_SHAPE, dtype=dtype or like.dtype) if x is None else x


# ----------------------------------------------------------------------------------------------
# Torch implementation behind opaque ops (CPU, and any device without kernels).
# ----------------------------------------------------------------------------------------------
@custom_op("kda_ops::chunk_kda_fwd_torch", mutates_args=())
def chunk_kda_fwd_torch(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    o, ht = reference.chunk_kda_fwd_torch(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state,
        chunk_size=TORCH_CHUNK_SIZE)
    return o, _or_empty(ht, q, _state_dtype(q))


@custom_op("kda_ops::chunk_kda_bwd_torch", mutates_args=())
def chunk_kda_bwd_torch(
    do: Tensor, dht: Optional[Tensor],
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = reference.chunk_kda_bwd_torch(
        do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, chunk_size=TORCH_CHUNK_SIZE)
    return (dq, dk, dv, dg, dbeta,
            _or_empty(dA_log, q, torch.float32) if A_log is None else dA_log.to(A_log.dtype),
            _or_empty(ddt_bias, q, torch.float32) if dt_bias is None else ddt_bias.to(dt_bias.dtype),
            _or_empty(dh0, q, torch.float32) if initial_state is None else dh0.to(initial_state.dtype))


@custom_op("kda_ops::recurrent_kda_torch", mutates_args=())
def recurrent_kda_torch(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Tensor, cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
) -> tuple[Tensor, Tensor]:
    cd = _state_dtype(q)
    o, ht = reference.naive_recurrent_kda(
        q.to(cd), k.to(cd), v.to(cd), g.to(cd), beta.to(cd), scale, initial_state, True,
        use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, lower_bound, cu_seqlens,
        A_log, dt_bias)
    return o.to(v.dtype), ht.to(initial_state.dtype)


# ----------------------------------------------------------------------------------------------
# Fake (meta) functions: output shapes and dtypes from input shapes only.
# ----------------------------------------------------------------------------------------------
def _fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
              use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state):
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    o = v.new_empty(B, T, HV, V)
    if output_final_state:
        return o, q.new_empty(_num_seqs(q, cu_seqlens), HV, K, V, dtype=_state_dtype(q))
    return o, q.new_empty(_EMPTY_SHAPE, dtype=_state_dtype(q))


def _saved_fake(q, v):
    """(Aqk, Tm) as chunk_kda_fwd returns them: [B, T, HV, 64] on CUDA (kernels.intra's storage dtype), else
    empty."""
    if q.device.type != "cuda":
        return tuple(q.new_empty(_EMPTY_SHAPE, dtype=torch.float32) for _ in range(2))
    B, T, HV = v.shape[:3]
    dtype = v.dtype if v.dtype == torch.bfloat16 else torch.float32
    return tuple(q.new_empty(B, T, HV, kernels.BT, dtype=dtype) for _ in range(2))


def _fwd_op_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                 use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state):
    o, ht = _fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                      use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state)
    return (o, ht, *_saved_fake(q, v))


def _bwd_fake(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
              use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, saved_Aqk=None, saved_Tm=None):
    # Gradients are contiguous whatever the strides of the inputs (both implementations write them fresh).
    grad = lambda x: q.new_empty(x.shape, dtype=x.dtype)  # noqa: E731
    absent = lambda: q.new_empty(_EMPTY_SHAPE, dtype=torch.float32)  # noqa: E731
    return (grad(q), grad(k), grad(v), grad(g), grad(beta),
            absent() if A_log is None else grad(A_log),
            absent() if dt_bias is None else grad(dt_bias),
            absent() if initial_state is None else grad(initial_state))


def _recurrent_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                    use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval):
    return v.new_empty(v.shape), initial_state.new_empty(initial_state.shape)


chunk_kda_fwd_torch.register_fake(_fwd_fake)
chunk_kda_bwd_torch.register_fake(_bwd_fake)
recurrent_kda_torch.register_fake(_recurrent_fake)


# ----------------------------------------------------------------------------------------------
# The public ops.
# ----------------------------------------------------------------------------------------------
@triton_op("kda_ops::chunk_kda_fwd", mutates_args={})
def chunk_kda_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    output_final_state: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if q.device.type == "cuda":
        o, ht, Aqk, Tm = kernels.chunk_kda_fwd_triton(
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
            use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state)
        return o, _or_empty(ht, q, torch.float32), Aqk, Tm
    o, ht = torch.ops.kda_ops.chunk_kda_fwd_torch(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state)
    return (o, ht, *_saved_fake(q, v))     # (the torch implementation recomputes everything: two empties)


@triton_op("kda_ops::chunk_kda_bwd", mutates_args={})
def chunk_kda_bwd(
    do: Tensor, dht: Optional[Tensor],
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    saved_Aqk: Optional[Tensor] = None, saved_Tm: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if q.device.type == "cuda":
        # the forward's (Aqk, Tm) when it kept them (four-dimensional), else recomputed
        keep = saved_Aqk is not None and saved_Tm is not None and saved_Aqk.dim() == 4 and saved_Tm.dim() == 4
        dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = kernels.chunk_kda_bwd_triton(
            do.contiguous(), None if dht is None else dht.contiguous(),
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
            use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval,
            (saved_Aqk.contiguous(), saved_Tm.contiguous()) if keep else None)
        return (dq, dk, dv, dg, dbeta, _or_empty(dA_log, q, torch.float32),
                _or_empty(ddt_bias, q, torch.float32), _or_empty(dh0, q, torch.float32))
    return torch.ops.kda_ops.chunk_kda_bwd_torch(
        do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)


@triton_op("kda_ops::recurrent_kda", mutates_args={})
def recurrent_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Tensor, cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
) -> tuple[Tensor, Tensor]:
    if q.device.type == "cuda":
        return kernels.recurrent_kda_triton(
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            A_log, dt_bias, initial_state.contiguous(), cu_seqlens, scale, lower_bound,
            use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)
    return torch.ops.kda_ops.recurrent_kda_torch(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)


chunk_kda_fwd.register_fake(_fwd_op_fake)
chunk_kda_bwd.register_fake(_bwd_fake)
recurrent_kda.register_fake(_recurrent_fake)


# ----------------------------------------------------------------------------------------------
# Autograd: the forward keeps its inputs and (Aqk, Tm); the backward op recomputes the rest.
# ----------------------------------------------------------------------------------------------
def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
     use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state) = inputs
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, output[2], output[3])
    ctx.flags = (scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)
    ctx.output_final_state = output_final_state


def _fwd_backward(ctx, do, dht, _dAqk, _dTm):
    # Aqk and Tm are kept for the backward only; api.py never returns them, so nothing flows back through them
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, Aqk, Tm = ctx.saved_tensors
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = torch.ops.kda_ops.chunk_kda_bwd(
        do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *ctx.flags, Aqk, Tm)
    return (dq, dk, dv, dg, dbeta,
            None if A_log is None else dA_log,
            None if dt_bias is None else ddt_bias,
            None if initial_state is None else dh0,
            None, None, None, None, None, None, None, None)


chunk_kda_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
