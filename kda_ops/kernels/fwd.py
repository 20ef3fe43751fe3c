"""The op-level forward launcher: pre-processing + intra-chunk (two launches), state pass + output (one launch)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .intra import chunk_kda_fwd_intra
from .state import chunk_kda_fwd_state


def chunk_kda_fwd_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    output_final_state: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Chunked KDA forward on the GPU (same semantics as kda_ops.reference.chunk_kda_fwd_torch).

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (raw gate when use_gate); beta [B, T, HV] (logits
    when use_beta_sigmoid); A_log [HV] fp32 or None; dt_bias [HV * K] fp32 or None; initial_state
    [N, HV, K, V] fp32 or None; cu_seqlens [N + 1] int32/int64 with B == 1, or None. All contiguous.
    Returns (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 or None, Aqk, Tm): the last two are
    the intra-chunk stage's [B, T, HV, 64] (bf16 for bf16 v, else fp32), which the backward takes instead of
    recomputing them (``chunk_kda_bwd_triton(..., saved=(Aqk, Tm))``). No host sync.

    >>> o, ht, Aqk, Tm = chunk_kda_fwd_triton(q, k, v, g, beta, A_log, dt_bias, None, None, K ** -0.5, None,
    ...                              True, True, True, False, True)
    """
    intra = chunk_kda_fwd_intra(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound,
                                use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, lowp=True)
    out = chunk_kda_fwd_state(intra, initial_state, cu_seqlens, output_final_state, v.dtype, store_o=True)
    return out.o, out.final_state, intra.Aqk, intra.Tm
