"""Every torch.library registration of kda_ops, in one place.

Stable ops: what exported graphs contain. Their schemas are a contract (docs/design.md, "Schema policy"):
a change adds ``*_v2`` beside them and keeps the old ones loadable.

    chunk_kda_v1(q, k, v, g, beta, A_log?, dt_bias?, initial_state?, cu_seqlens?, float scale,
                 float? lower_bound, bool use_qk_l2norm, bool use_gate, bool use_beta_sigmoid,
                 bool allow_neg_eigval, bool output_final_state)
        -> (o [B, T, HV, V], final_state [N, HV, K, V] or empty)
    recurrent_kda_v1(<the same inputs, initial_state required, no output_final_state>)
        -> (o [B, T, HV, V], final_state [N, HV, K, V])                        # decode step

Private ops: the training path. They change whenever the backward changes and are never exported.

    _chunk_kda_fwd(<chunk_kda_v1's inputs>, chunk_indices?, chunk_offsets?) -> (o, final_state, Aqk, Tm)
    _chunk_kda_bwd(do, dht?, <_chunk_kda_fwd's inputs but output_final_state>, Aqk?, Tm?)
        -> (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)        (absent gradients: empty tensors)
    _chunk_kda_fwd_torch, _chunk_kda_bwd_torch, _recurrent_kda_torch: the torch implementation of
        reference.py behind opaque ``custom_op``s (their Python loops over chunks would otherwise
        specialise the sequence length under torch.compile and recompile for every new length).

All ``triton_op``s: on CUDA their bodies launch our kernels through ``wrap_triton``, so torch.compile sees
the kernels; on every other device they call the opaque torch implementation. A ``triton_op`` cannot return
None: an absent output is an empty tensor, mapped back to None in api.py.

On CUDA the private forward also returns the intra-chunk stage's Aqk and (I + L)^-1 ([B, T, HV, 64], bf16
for bf16 v), which the backward takes instead of recomputing them, and its varlen chunk index is built once
(``kernels.chunk_index``) and handed to the backward through autograd.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op, triton_op

from . import kernels, reference
from .kernels import chunk_kda_bwd_triton, chunk_kda_fwd_triton, recurrent_kda_triton
from .options import KDAInputs, KDAOptions

try:   # what triton_op's CUDA body runs under: wrap_triton launches the kernel itself, not a traceable HOP
    from torch._library.triton import set_wrap_triton_enabled as _set_wrap_triton_enabled
except ImportError:     # pragma: no cover - then every call goes through the dispatcher
    _set_wrap_triton_enabled = None

SCHEMA_VERSION = 1
_EMPTY = (0,)
# Chunk size of the torch implementation. Any size gives the same result; on CPU its cost is dominated by
# the per-pair decay tensor [C, C, K] of every chunk, and 16 runs several times faster than 64 there.
TORCH_CHUNK_SIZE = 16


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _num_seqs(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _or_empty(x: Optional[Tensor], like: Tensor, dtype: torch.dtype) -> Tensor:
    return like.new_empty(_EMPTY, dtype=dtype) if x is None else x


def _options(scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval) -> KDAOptions:
    return KDAOptions(scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)


def _cuda_bundles(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
                  scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, chunked=True):
    """(KDAInputs, KDAOptions, ChunkIndex or None) for the kernels from an op's flat arguments.

    What the kernels read as dense memory is made dense (a no-op when it already is); states keep their
    strides, the kernels read them through their strides. The chunk index is the one passed in (built once
    by the training path) or a fresh one."""
    c = lambda t: None if t is None else t.contiguous()  # noqa: E731
    x = KDAInputs(c(q), c(k), c(v), c(g), c(beta), c(A_log), c(dt_bias), initial_state, c(cu_seqlens))
    opts = _options(scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)
    if not chunked:
        return x, opts, None
    B, T = q.shape[:2]
    if x.cu_seqlens is not None and (chunk_indices is None or chunk_offsets is None):
        return x, opts, kernels.chunk_index(B, T, x.cu_seqlens)
    return x, opts, kernels.ChunkIndex.from_tensors(B, T, x.cu_seqlens, chunk_indices, chunk_offsets)


# ----------------------------------------------------------------------------------------------
# Torch implementation behind opaque ops (CPU, and any device without kernels).
# ----------------------------------------------------------------------------------------------
@custom_op("kda_ops::_chunk_kda_fwd_torch", mutates_args=())
def _chunk_kda_fwd_torch(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    x = KDAInputs(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    opts = _options(scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)
    o, ht = reference.chunk_kda_fwd_torch(x, opts, output_final_state, chunk_size=TORCH_CHUNK_SIZE)
    return o, _or_empty(ht, q, _state_dtype(q))


@custom_op("kda_ops::_chunk_kda_bwd_torch", mutates_args=())
def _chunk_kda_bwd_torch(
    do: Tensor, dht: Optional[Tensor],
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    x = KDAInputs(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    opts = _options(scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)
    dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = reference.chunk_kda_bwd_torch(
        do, dht, x, opts, chunk_size=TORCH_CHUNK_SIZE)
    return (dq, dk, dv, dg, dbeta,
            _or_empty(None, q, torch.float32) if A_log is None else dA_log.to(A_log.dtype),
            _or_empty(None, q, torch.float32) if dt_bias is None else ddt_bias.to(dt_bias.dtype),
            _or_empty(None, q, torch.float32) if initial_state is None else dh0.to(initial_state.dtype))


@custom_op("kda_ops::_recurrent_kda_torch", mutates_args=())
def _recurrent_kda_torch(
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
    shape = (_num_seqs(q, cu_seqlens), HV, K, V) if output_final_state else _EMPTY
    return v.new_empty(B, T, HV, V), q.new_empty(shape, dtype=_state_dtype(q))


def _saved_fake(q: Tensor, v: Tensor):
    """(Aqk, Tm) as _chunk_kda_fwd returns them: [B, T, HV, 64] on CUDA (bf16 for bf16 v), else empty."""
    if q.device.type != "cuda":
        return tuple(q.new_empty(_EMPTY, dtype=torch.float32) for _ in range(2))
    B, T, HV = v.shape[:3]
    dtype = v.dtype if v.dtype == torch.bfloat16 else torch.float32
    return tuple(q.new_empty(B, T, HV, kernels.BT, dtype=dtype) for _ in range(2))


def _train_fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices,
                    chunk_offsets, scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid,
                    allow_neg_eigval, output_final_state):
    o, ht = _fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                      use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state)
    return (o, ht, *_saved_fake(q, v))


def _bwd_fake(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *rest):
    # Gradients are fresh contiguous tensors whatever the strides of the inputs.
    grad = lambda x: q.new_empty(x.shape, dtype=x.dtype)  # noqa: E731
    absent = lambda: q.new_empty(_EMPTY, dtype=torch.float32)  # noqa: E731
    return (grad(q), grad(k), grad(v), grad(g), grad(beta),
            absent() if A_log is None else grad(A_log),
            absent() if dt_bias is None else grad(dt_bias),
            absent() if initial_state is None else grad(initial_state))


def _recurrent_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, *rest):
    return v.new_empty(v.shape), initial_state.new_empty(initial_state.shape)


_chunk_kda_fwd_torch.register_fake(_fwd_fake)
_chunk_kda_bwd_torch.register_fake(_bwd_fake)
_recurrent_kda_torch.register_fake(_recurrent_fake)


# ----------------------------------------------------------------------------------------------
# The stable ops.
# ----------------------------------------------------------------------------------------------
def _chunk_kda_v1_body(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    if q.device.type == "cuda":
        x, opts, idx = _cuda_bundles(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, None, None,
                                     scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)
        o, ht, _, _ = chunk_kda_fwd_triton(x, opts, idx, output_final_state)
        return o, _or_empty(ht, q, torch.float32)
    return torch.ops.kda_ops._chunk_kda_fwd_torch(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state)


def _recurrent_kda_v1_body(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Tensor, cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
) -> tuple[Tensor, Tensor]:
    if q.device.type == "cuda":
        x, opts, _ = _cuda_bundles(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, None, None,
                                   scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval,
                                   chunked=False)
        return recurrent_kda_triton(x, opts)
    return torch.ops.kda_ops._recurrent_kda_torch(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)


# The bodies stay plain functions too: a plain eager call runs them without the dispatcher (_plain_eager_cuda).
chunk_kda_v1 = triton_op("kda_ops::chunk_kda_v1", mutates_args={})(_chunk_kda_v1_body)
recurrent_kda_v1 = triton_op("kda_ops::recurrent_kda_v1", mutates_args={})(_recurrent_kda_v1_body)
chunk_kda_v1.register_fake(_fwd_fake)
recurrent_kda_v1.register_fake(_recurrent_fake)


# ----------------------------------------------------------------------------------------------
# The private training ops.
# ----------------------------------------------------------------------------------------------
@triton_op("kda_ops::_chunk_kda_fwd", mutates_args={})
def _chunk_kda_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_indices: Optional[Tensor], chunk_offsets: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    output_final_state: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if q.device.type == "cuda":
        x, opts, idx = _cuda_bundles(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices,
                                     chunk_offsets, scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid,
                                     allow_neg_eigval)
        o, ht, Aqk, Tm = chunk_kda_fwd_triton(x, opts, idx, output_final_state)
        return o, _or_empty(ht, q, torch.float32), Aqk, Tm
    o, ht = torch.ops.kda_ops._chunk_kda_fwd_torch(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state)
    return (o, ht, *_saved_fake(q, v))     # the torch implementation recomputes everything: two empties


@triton_op("kda_ops::_chunk_kda_bwd", mutates_args={})
def _chunk_kda_bwd(
    do: Tensor, dht: Optional[Tensor],
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    chunk_indices: Optional[Tensor], chunk_offsets: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    Aqk: Optional[Tensor], Tm: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if q.device.type == "cuda":
        x, opts, idx = _cuda_bundles(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices,
                                     chunk_offsets, scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid,
                                     allow_neg_eigval)
        saved = None if Aqk is None or Tm is None else (Aqk.contiguous(), Tm.contiguous())
        dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = chunk_kda_bwd_triton(
            do.contiguous(), dht, x, opts, idx, saved)
        empty = lambda t: _or_empty(t, q, torch.float32)  # noqa: E731
        return dq, dk, dv, dg, dbeta, empty(dA_log), empty(ddt_bias), empty(dh0)
    return torch.ops.kda_ops._chunk_kda_bwd_torch(
        do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
        use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval)


_chunk_kda_fwd.register_fake(_train_fwd_fake)
_chunk_kda_bwd.register_fake(_bwd_fake)


# ----------------------------------------------------------------------------------------------
# Autograd. The training op keeps its inputs, its chunk index and (on CUDA) Aqk and Tm; the stable op
# keeps its inputs and lets the backward recompute the rest (it is differentiable, but the public
# functions only pick it when no gradient is needed or a graph is being exported).
# ----------------------------------------------------------------------------------------------
def _input_grads(x, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0):
    return (dq, dk, dv, dg, dbeta,
            None if x[5] is None else dA_log,
            None if x[6] is None else ddt_bias,
            None if x[7] is None else dh0)


def _train_setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
     *flags, output_final_state) = inputs
    keep = q.device.type == "cuda"        # the torch implementation returns no Aqk / Tm
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, chunk_indices,
                          chunk_offsets, output[2] if keep else None, output[3] if keep else None)
    ctx.flags = tuple(flags)
    ctx.output_final_state = output_final_state


def _train_backward(ctx, do, dht, _dAqk, _dTm):
    *x, Aqk, Tm = ctx.saved_tensors
    grads = torch.ops.kda_ops._chunk_kda_bwd(
        do, dht if ctx.output_final_state else None, *x, *ctx.flags, Aqk, Tm)
    return (*_input_grads(x, *grads), None, None, None, None, None, None, None, None, None, None)


def _stable_setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *flags, output_final_state) = inputs
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    ctx.flags = tuple(flags)
    ctx.output_final_state = output_final_state


def _stable_backward(ctx, do, dht):
    x = ctx.saved_tensors
    q, cu_seqlens = x[0], x[8]
    idx = kernels.chunk_index(q.shape[0], q.shape[1], cu_seqlens) if q.device.type == "cuda" else None
    grads = torch.ops.kda_ops._chunk_kda_bwd(
        do, dht if ctx.output_final_state else None, *x[:8],
        cu_seqlens if idx is None else idx.cu_seqlens,
        None if idx is None else idx.chunk_indices, None if idx is None else idx.chunk_offsets,
        *ctx.flags, None, None)
    return (*_input_grads(x, *grads), None, None, None, None, None, None, None, None)


_chunk_kda_fwd.register_autograd(_train_backward, setup_context=_train_setup_context)
chunk_kda_v1.register_autograd(_stable_backward, setup_context=_stable_setup_context)


# ----------------------------------------------------------------------------------------------
# Entry points for api.py: pick the op.
# ----------------------------------------------------------------------------------------------
def _needs_grad(x: KDAInputs) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in x)


def _plain_eager_cuda(x: KDAInputs) -> bool:
    """Whether a call may run the CUDA implementation without going through the dispatcher: CUDA tensors and
    _plain_eager(x). The op's dispatch (custom-op, autograd and dynamo-disable layers) costs more than 0.02-0.05
    ms of host time a call (the decode kernel: ~0.08 ms) (docs/performance.md, "Small shapes are bound by the
    host"); the result is the same either way."""
    return x.q.is_cuda and _plain_eager(x)


def _plain_eager(x: KDAInputs) -> bool:
    """Eager mode with nothing that the dispatcher would have to see: no gradient needed, no compile, export or
    TorchScript trace, no dispatch mode (make_fx's, FakeTensorMode), no function mode, no functorch transform,
    and every tensor a plain one (torch.Tensor, or nn.Parameter, which has no dispatch behaviour of its own; a
    model's A_log / dt_bias reach the op as they are) rather than another subclass."""
    if _set_wrap_triton_enabled is None or torch.compiler.is_compiling() or torch.compiler.is_exporting() \
            or torch.jit.is_tracing() or torch._C._len_torch_dispatch_stack() \
            or torch._C._is_torch_function_mode_enabled() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return all(t is None or type(t) in _PLAIN_TYPES for t in x) and not _needs_grad(x)


_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def chunk_kda(x: KDAInputs, opts: KDAOptions, output_final_state: bool):
    """(o, final_state or empty). Training (a gradient is needed, not exporting): the private op pair,
    which saves Aqk, Tm and the chunk index for the backward; plain eager CUDA calls without a gradient: the
    stable op's body without the dispatcher (_plain_eager_cuda); otherwise the stable op."""
    flags = (opts.scale, opts.lower_bound, opts.use_qk_l2norm, opts.use_gate, opts.use_beta_sigmoid,
             opts.allow_neg_eigval, output_final_state)
    if _plain_eager_cuda(x):
        with _set_wrap_triton_enabled(False):      # as triton_op runs the body: kernels launch directly
            return _chunk_kda_v1_body(*x, *flags)
    if torch.compiler.is_exporting() or not _needs_grad(x):
        return torch.ops.kda_ops.chunk_kda_v1(*x, *flags)
    cu, ci, co = x.cu_seqlens, None, None
    if x.q.device.type == "cuda":
        idx = kernels.chunk_index(x.q.shape[0], x.q.shape[1], x.cu_seqlens)
        cu, ci, co = idx.cu_seqlens, idx.chunk_indices, idx.chunk_offsets
    o, ht, _, _ = torch.ops.kda_ops._chunk_kda_fwd(*x[:8], cu, ci, co, *flags)
    return o, ht


def recurrent_kda(x: KDAInputs, opts: KDAOptions):
    flags = (opts.scale, opts.lower_bound, opts.use_qk_l2norm, opts.use_gate, opts.use_beta_sigmoid,
             opts.allow_neg_eigval)
    if _plain_eager_cuda(x):
        with _set_wrap_triton_enabled(False):
            return _recurrent_kda_v1_body(*x, *flags)
    return torch.ops.kda_ops.recurrent_kda_v1(*x, *flags)
