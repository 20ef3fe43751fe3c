"""Public functions: argument validation, defaults, and the None <-> empty-tensor mapping of the ops."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ops  # noqa: F401  (registers torch.ops.kda_ops.*)

CHUNK_SIZE = 64
MAX_HEAD_DIM = 256
_QKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.float64)


def _shape(x: Tensor) -> str:
    return str(tuple(x.shape))


def _check_rank(name: str, x, rank: int, layout: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims {layout}, got shape {_shape(x)}")


def _check_float(name: str, x: Tensor, allowed=_QKV_DTYPES) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, use_gate, lower_bound, A_log, dt_bias,
              chunk_size=CHUNK_SIZE):
    _check_rank("q", q, 4, "[B, T, H, K]")
    _check_rank("k", k, 4, "[B, T, H, K]")
    _check_rank("v", v, 4, "[B, T, HV, V]")
    _check_rank("g", g, 4, "[B, T, HV, K]")
    _check_rank("beta", beta, 3, "[B, T, HV]")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {_shape(q)} [B, T, H, K], got {_shape(k)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have batch and time {tuple(q.shape[:2])} like q, got shape {_shape(v)}")
    if HV % H != 0:
        raise ValueError(f"value heads HV = {HV} (v.shape[2]) must be a multiple of q/k heads H = {H}")
    if tuple(g.shape) != (B, T, HV, K):
        raise ValueError(f"g must have shape [B, T, HV, K] = {(B, T, HV, K)}, got {_shape(g)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must have shape [B, T, HV] = {(B, T, HV)}, got {_shape(beta)}")
    for name, d in (("K (q.shape[3])", K), ("V (v.shape[3])", V)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {name} = {d} is unsupported: 1 <= {name.split()[0]} <= {MAX_HEAD_DIM}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_float(name, x)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_size must be {CHUNK_SIZE}, got {chunk_size}")
    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got shape {_shape(cu_seqlens)}")
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (packed sequences), got B = {B}")
        N = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        _check_rank("initial_state", initial_state, 4, "[N, HV, K, V]")
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must have shape [N, HV, K, V] = {(N, HV, K, V)}, got {_shape(initial_state)}")
        _check_float("initial_state", initial_state, _STATE_DTYPES)
    if lower_bound is not None and not -5.0 <= float(lower_bound) < 0.0:
        raise ValueError(f"lower_bound must lie in [-5, 0), got {lower_bound}")
    if use_gate:
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log [HV] (or lower_bound, which allows A_log=None)")
        if A_log is not None:
            _check_rank("A_log", A_log, 1, "[HV]")
            if A_log.shape[0] != HV:
                raise ValueError(f"A_log must have shape [HV] = {(HV,)}, got {_shape(A_log)}")
            _check_float("A_log", A_log, _STATE_DTYPES)
        if dt_bias is not None:
            _check_rank("dt_bias", dt_bias, 1, "[HV * K]")
            if dt_bias.shape[0] != HV * K:
                raise ValueError(f"dt_bias must have shape [HV * K] = {(HV * K,)}, got {_shape(dt_bias)}")
            _check_float("dt_bias", dt_bias, _STATE_DTYPES)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log / dt_bias are only used with use_gate_in_kernel=True")
    named = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
             ("cu_seqlens", cu_seqlens), ("A_log", A_log), ("dt_bias", dt_bias)]
    for name, x in named[1:]:
        if x is not None and x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}: all tensors must share a device")
    if q.device.type == "cuda" and q.dtype == torch.float64:
        raise TypeError("float64 inputs are supported on CPU only (use float32, float16 or bfloat16 on CUDA)")


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
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = CHUNK_SIZE,
    *,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
):
    r"""Kimi Delta Attention, chunked (training and prefill). Argument names follow FLA's ``chunk_kda``.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys.
        v: ``[B, T, HV, V]`` values; ``HV`` must be a multiple of ``H`` (grouped values).
        g: ``[B, T, HV, K]`` per-step log decay (``<= 0``), or the raw gate with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` write strength, or logits with ``use_beta_sigmoid_in_kernel``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` float32 state entering each sequence.
        output_final_state: also return the ``[N, HV, K, V]`` float32 final state.
        use_qk_l2norm_in_kernel: ``q, k <- x / sqrt(sum(x^2) + 1e-6)`` along ``K``.
        use_gate_in_kernel: ``g <- -exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
            ``g <- lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``.
        use_beta_sigmoid_in_kernel: ``beta <- sigmoid(beta)`` (``2 * sigmoid`` with ``allow_neg_eigval``).
        lower_bound: safe-gate bound in ``[-5, 0)``.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (requires ``B == 1``).
        chunk_size: must be 64.
        A_log: ``[HV]`` float32 gate scale (with ``use_gate_in_kernel``).
        dt_bias: ``[HV * K]`` float32 gate bias (with ``use_gate_in_kernel``).

    Returns:
        ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``.

    Example::

        >>> import torch, kda_ops
        >>> B, T, H, K = 2, 100, 4, 64
        >>> q, k, v = (torch.randn(B, T, H, K) for _ in range(3))
        >>> g = torch.randn(B, T, H, K)
        >>> beta = torch.randn(B, T, H)
        >>> o, ht = kda_ops.chunk_kda(q, k, v, g, beta, output_final_state=True,
        ...     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        ...     A_log=torch.zeros(H), dt_bias=torch.zeros(H * K))
        >>> o.shape, ht.shape
        (torch.Size([2, 100, 4, 64]), torch.Size([2, 4, 64, 64]))
    """
    _validate(q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, lower_bound, A_log,
              dt_bias, chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, final_state, _, _ = torch.ops.kda_ops.chunk_kda_fwd(     # (Aqk, Tm: kept for the backward only)
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale,
        None if lower_bound is None else float(lower_bound),
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        output_final_state)
    return o, (final_state if output_final_state else None)


def recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    *,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
):
    """KDA token by token from a given state: the decode step (short T, typically 1). Inference only.

    Same arguments and shapes as :func:`chunk_kda`; the state is functional: returns
    ``(o [B, T, HV, V], new_state [N, HV, K, V])`` and never modifies ``initial_state``
    (zeros when None).

    Example::

        >>> import torch, kda_ops
        >>> q, k, v = (torch.randn(8, 1, 4, 64) for _ in range(3))
        >>> g, beta = -torch.rand(8, 1, 4, 64), torch.rand(8, 1, 4)
        >>> state = torch.zeros(8, 4, 64, 64)
        >>> o, state = kda_ops.recurrent_kda(q, k, v, g, beta, initial_state=state)
    """
    _validate(q, k, v, g, beta, initial_state, cu_seqlens, use_gate_in_kernel, lower_bound, A_log,
              dt_bias)
    if initial_state is None:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        initial_state = q.new_zeros(N, v.shape[2], q.shape[3], v.shape[3], dtype=dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.kda_ops.recurrent_kda(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale,
        None if lower_bound is None else float(lower_bound),
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
