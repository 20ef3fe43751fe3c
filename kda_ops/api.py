"""Public functions: argument validation, defaults, layouts, and the None <-> empty-tensor mapping of the ops.

Every argument is checked here, before any op runs, with a message that names it. What cannot be checked
without reading tensor values on the host (cu_seqlens' values on CUDA, non-finite inputs) is made safe in
the kernels instead; ``KDA_OPS_CHECK_CU_SEQLENS=1`` (or :func:`set_cu_seqlens_check`) adds a
synchronising check of cu_seqlens on CUDA too, for debugging.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Optional

import torch
from torch import Tensor

from . import ops
from .options import KDAInputs, KDAOptions
from .reference import check_cu_seqlens

CHUNK_SIZE = 64
MAX_HEAD_DIM = 256
_QKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.float64)
_CHECK_CU_SEQLENS = os.environ.get("KDA_OPS_CHECK_CU_SEQLENS", "0") == "1"


def set_cu_seqlens_check(enabled: bool) -> None:
    """Check cu_seqlens' values on every call on CUDA too (starts at 0, non-decreasing, ends at T).

    Off by default: it reads the values on the host, which synchronises with the GPU and graph-breaks under
    torch.compile. Without it, bad values never make a kernel read or write out of bounds (the kernels clamp
    them), but the result for the affected sequences is meaningless. On CPU the check always runs.
    """
    global _CHECK_CU_SEQLENS
    _CHECK_CU_SEQLENS = bool(enabled)


def _shape(x: Tensor) -> str:
    return str(tuple(x.shape))


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _check_tensor(name: str, x, rank: Optional[int] = None, layout: str = "") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if rank is not None and x.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims {layout}, got shape {_shape(x)}")


def _check_float(name: str, x: Tensor, allowed=_QKV_DTYPES) -> None:
    if x.dtype not in allowed:
        names = ", ".join(_dtype_name(d) for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {_dtype_name(x.dtype)}")


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _gate_param(name: str, x: Optional[Tensor], numel: int, what: str, q: Tensor) -> Optional[Tensor]:
    """A_log / dt_bias of any float dtype and any shape with ``numel`` elements -> 1-D, computed in fp32
    (fp64 with fp64 inputs). The reshape and cast are differentiable: gradients come back in x's shape and
    dtype."""
    if x is None:
        return None
    _check_tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {_dtype_name(x.dtype)}")
    if x.numel() != numel:
        raise ValueError(f"{name} must hold {what} = {numel} elements (any shape), got shape {_shape(x)}")
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return x if x.dim() == 1 and x.dtype == dtype else x.reshape(numel).to(dtype)


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, use_gate, use_beta_sigmoid,
             allow_neg_eigval, lower_bound, A_log, dt_bias, state_v_first, chunk_size=CHUNK_SIZE):
    """Validates every argument; returns (KDAInputs with the state K-first, KDAOptions, N)."""
    _check_tensor("q", q, 4, "[B, T, H, K]")
    _check_tensor("k", k, 4, "[B, T, H, K]")
    _check_tensor("v", v, 4, "[B, T, HV, V]")
    _check_tensor("g", g, 4, "[B, T, HV, K]")
    _check_tensor("beta", beta, 3, "[B, T, HV]")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {_shape(q)} [B, T, H, K], got {_shape(k)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have batch and time {tuple(q.shape[:2])} like q, got shape {_shape(v)}")
    if H == 0:
        raise ValueError(f"q/k need at least one head: H = q.shape[2] = 0 (q has shape {_shape(q)})")
    if HV == 0:
        raise ValueError(f"v needs at least one head: HV = v.shape[2] = 0 (v has shape {_shape(v)})")
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
    for name, flag in (("use_qk_l2norm_in_kernel", use_qk_l2norm), ("use_gate_in_kernel", use_gate),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid), ("allow_neg_eigval", allow_neg_eigval),
                       ("state_v_first", state_v_first)):
        _check_flag(name, flag)
    scale = K ** -0.5 if scale is None else _number("scale", scale)
    N = B
    if cu_seqlens is not None:
        _check_tensor("cu_seqlens", cu_seqlens, 1, "[N + 1]")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {_dtype_name(cu_seqlens.dtype)}")
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1, got shape {_shape(cu_seqlens)}")
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (packed sequences), got B = {B}")
        N = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
        expect = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        _check_tensor("initial_state", initial_state, 4, layout)
        if tuple(initial_state.shape) != expect:
            hint = "" if state_v_first or tuple(initial_state.shape) != (N, HV, V, K) else \
                " (a V-first state? pass state_v_first=True)"
            raise ValueError(f"initial_state must have shape {layout} = {expect}, got "
                             f"{_shape(initial_state)}{hint}")
        _check_float("initial_state", initial_state, _STATE_DTYPES)
        if state_v_first:
            initial_state = initial_state.transpose(-1, -2)      # a view: the kernels honour its strides
    if lower_bound is not None:
        lower_bound = _number("lower_bound", lower_bound)
        if not -5.0 <= lower_bound < 0.0:
            raise ValueError(f"lower_bound must lie in [-5, 0), got {lower_bound}")
    if use_gate:
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log [HV] (or lower_bound, which allows A_log=None)")
        A_log = _gate_param("A_log", A_log, HV, "HV", q)
        dt_bias = _gate_param("dt_bias", dt_bias, HV * K, "HV * K", q)
    else:
        if A_log is not None or dt_bias is not None:
            raise ValueError("A_log / dt_bias are only used with use_gate_in_kernel=True")
        if lower_bound is not None:
            raise ValueError("lower_bound is only used with use_gate_in_kernel=True (it bounds the in-op gate)")
    if allow_neg_eigval and not use_beta_sigmoid:
        raise ValueError("allow_neg_eigval is only used with use_beta_sigmoid_in_kernel=True "
                         "(it makes the in-op beta 2 * sigmoid)")
    named = (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
             ("cu_seqlens", cu_seqlens), ("A_log", A_log), ("dt_bias", dt_bias))
    device = q.device
    for name, x in named:
        if x is not None and x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}: all tensors must share a device")
    if q.device.type == "cuda" and q.dtype == torch.float64:
        raise TypeError("float64 inputs are supported on CPU only (use float32, float16 or bfloat16 on CUDA)")
    if cu_seqlens is not None and (q.device.type != "cuda" or _CHECK_CU_SEQLENS) \
            and not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
        check_cu_seqlens(cu_seqlens, T)
    opts = KDAOptions(scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)
    return KDAInputs(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens), opts, N


def _empty_result(x: KDAInputs, N: int):
    """T == 0 or N == 0: no token to process; the state passes through unchanged."""
    B, T, H, K = x.q.shape
    HV, V = x.v.shape[2:]
    o = x.v.new_zeros(B, T, HV, V)
    dtype = torch.float64 if x.q.dtype == torch.float64 else torch.float32
    h = x.q.new_zeros(N, HV, K, V, dtype=dtype) if x.initial_state is None else x.initial_state.clone()
    return o, h


def _state_out(h: Tensor, state_v_first: bool) -> Tensor:
    return h.transpose(-1, -2) if state_v_first else h


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
    state_v_first: bool = False,
):
    r"""Kimi Delta Attention, chunked (training and prefill). Argument names follow FLA's ``chunk_kda``;
    :mod:`kda_ops.fla_compat` has FLA's exact signature.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys.
        v: ``[B, T, HV, V]`` values; ``HV`` must be a multiple of ``H`` (grouped values).
        g: ``[B, T, HV, K]`` per-step log decay (``<= 0``), or the raw gate with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` write strength, or logits with ``use_beta_sigmoid_in_kernel``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) float32 state entering
            each sequence; any strides.
        output_final_state: also return the final state (float32, same layout as ``initial_state``).
        use_qk_l2norm_in_kernel: ``q, k <- x / sqrt(sum(x^2) + 1e-6)`` along ``K``.
        use_gate_in_kernel: ``g <- -exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
            ``g <- lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``.
        use_beta_sigmoid_in_kernel: ``beta <- sigmoid(beta)`` (``2 * sigmoid`` with ``allow_neg_eigval``).
        lower_bound: safe-gate bound in ``[-5, 0)`` (with ``use_gate_in_kernel``).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (requires ``B == 1``).
        chunk_size: must be 64.
        A_log: ``HV`` gate log-scales, any float dtype and shape (e.g. ``[1, 1, HV, 1]``), used in fp32.
        dt_bias: ``HV * K`` gate biases, any float dtype and shape, used in fp32.
        state_v_first: states are ``[N, HV, V, K]`` (the layout of FLA's layer, vLLM and SGLang). The
            returned state is then a transposed view of a K-first tensor; no copy is made either way.

    Returns:
        ``(o [B, T, HV, V], final_state or None)``.

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
    _check_flag("output_final_state", output_final_state)
    x, opts, N = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                          use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log,
                          dt_bias, state_v_first, chunk_size)
    if q.shape[0] == 0 or q.shape[1] == 0:
        o, ht = _empty_result(x, N)
    else:
        o, ht = ops.chunk_kda(x, opts, output_final_state)
    return o, (_state_out(ht, state_v_first) if output_final_state else None)


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
    state_v_first: bool = False,
    output_final_state: bool = True,
):
    """KDA token by token from a given state: the decode step (short T, typically 1). Inference only.

    Same arguments and shapes as :func:`chunk_kda`; the state is functional: returns
    ``(o [B, T, HV, V], new_state)`` (``None`` with ``output_final_state=False``) and never modifies
    ``initial_state`` (zeros when None).

    Example::

        >>> import torch, kda_ops
        >>> q, k, v = (torch.randn(8, 1, 4, 64) for _ in range(3))
        >>> g, beta = -torch.rand(8, 1, 4, 64), torch.rand(8, 1, 4)
        >>> state = torch.zeros(8, 4, 64, 64)
        >>> o, state = kda_ops.recurrent_kda(q, k, v, g, beta, initial_state=state)
    """
    _check_flag("output_final_state", output_final_state)
    x, opts, N = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                          use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log,
                          dt_bias, state_v_first)
    if q.shape[0] == 0 or q.shape[1] == 0:
        o, ht = _empty_result(x, N)
    else:
        if x.initial_state is None:
            dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            x = x._replace(initial_state=q.new_zeros(N, v.shape[2], q.shape[3], v.shape[3], dtype=dtype))
        o, ht = ops.recurrent_kda(x, opts)
    return o, (_state_out(ht, state_v_first) if output_final_state else None)
