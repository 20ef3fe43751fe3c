"""Run transformers' Kimi Linear (``transformers.models.kimi_linear``, transformers 5.x) through kda_ops.

``patch_kimi_linear()`` rebinds the two module-level KDA functions that ``KimiLinearDeltaAttention.forward``
calls, ``chunk_kimi_delta_attention`` (prefill) and ``recurrent_kimi_delta_attention`` (single-token decode),
to functions that call :func:`kda_ops.fla_compat.chunk_kda` / :func:`~kda_ops.fla_compat.fused_recurrent_kda`,
hence kda_ops' custom ops: the model then compiles with ``fullgraph=True`` through its KDA layers, exports
with ``kda_ops`` nodes (transformers otherwise falls back to its torch loop when exporting) and runs the Triton
kernels on CUDA. ``unpatch_kimi_linear()`` puts the original functions back. Layers already built are
affected too: the layer looks the functions up in its module at every call. Example::

    from kda_ops.integrations.transformers import patch_kimi_linear
    patch_kimi_linear()
    model = AutoModelForCausalLM.from_pretrained("moonshotai/Kimi-Linear-48B-A3B-Instruct", ...)

Requires transformers >= 5 (``pip install kda_ops[hf]``).
"""
from __future__ import annotations

import importlib
from typing import Optional

from .. import fla_compat

__all__ = ["patch_kimi_linear", "unpatch_kimi_linear", "is_kimi_linear_patched"]

_MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"
_CHUNK, _RECURRENT = "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"
_originals: Optional[dict] = None


def chunk_kimi_delta_attention(query, key, value, g, beta, chunk_size=64, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """Prefill: ``(o [B, T, H, V], final_state [B, H, K, V] or None)`` as transformers' function returns."""
    return fla_compat.chunk_kda(
        query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=kwargs.get("cu_seqlens"))


def recurrent_kimi_delta_attention(query, key, value, g, beta, initial_state, output_final_state,
                                   use_qk_l2norm_in_kernel=False, **kwargs):
    """Decode: ``(o [B, T, H, V], final_state [B, H, K, V] or None)`` as transformers' function returns."""
    o, final_state = fla_compat.fused_recurrent_kda(
        query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=kwargs.get("cu_seqlens"))
    return o.to(query.dtype), final_state


def _module():
    try:
        return importlib.import_module(_MODULE)
    except ImportError as e:
        raise ImportError(
            "kda_ops.integrations.transformers needs transformers with Kimi Linear (transformers >= 5): "
            "pip install 'kda_ops[hf]'") from e


def patch_kimi_linear() -> None:
    """Make transformers' Kimi Linear run its KDA prefill and decode through kda_ops (idempotent)."""
    global _originals
    mod = _module()
    if _originals is None:
        _originals = {_CHUNK: getattr(mod, _CHUNK), _RECURRENT: getattr(mod, _RECURRENT)}
    setattr(mod, _CHUNK, chunk_kimi_delta_attention)
    setattr(mod, _RECURRENT, recurrent_kimi_delta_attention)


def unpatch_kimi_linear() -> None:
    """Restore transformers' own functions (no-op when not patched)."""
    global _originals
    if _originals is None:
        return
    mod = _module()
    for name, fn in _originals.items():
        setattr(mod, name, fn)
    _originals = None


def is_kimi_linear_patched() -> bool:
    return _originals is not None
