"""The two bundles every layer below the op boundary passes around instead of loose arguments.

``torch.library`` schemas stay flat (ops.py unpacks them once); the reference, the kernels' launchers and the
ONNX translation take a :class:`KDAInputs` and a :class:`KDAOptions`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from torch import Tensor


@dataclass(frozen=True)
class KDAOptions:
    """What the op computes, beyond its tensors.

    scale: the output scale (``K ** -0.5`` by default in the public functions).
    lower_bound: with ``use_gate``, the safe gate ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``;
        None for the unbounded gate ``-exp(A_log) * softplus(g + dt_bias)``.
    use_qk_l2norm: q and k are l2-normalised along K inside the op.
    use_gate: g is the raw gate, activated inside the op.
    use_beta_sigmoid: beta holds logits, ``sigmoid`` inside the op (``2 * sigmoid`` with allow_neg_eigval).
    allow_neg_eigval: see use_beta_sigmoid.
    """
    scale: float
    lower_bound: Optional[float] = None
    use_qk_l2norm: bool = False
    use_gate: bool = False
    use_beta_sigmoid: bool = False
    allow_neg_eigval: bool = False


class KDAInputs(NamedTuple):
    """The op's tensors. Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
    A_log [HV] and dt_bias [HV * K] (float32, with ``use_gate``); initial_state [N, HV, K, V] (any strides);
    cu_seqlens [N + 1] (packed sequences, B == 1)."""
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    A_log: Optional[Tensor] = None
    dt_bias: Optional[Tensor] = None
    initial_state: Optional[Tensor] = None
    cu_seqlens: Optional[Tensor] = None
