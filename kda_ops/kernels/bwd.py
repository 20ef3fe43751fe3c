"""Op-level launcher of the KDA backward (the CUDA branch of ``kda_ops::chunk_kda_bwd``).

Stages (one file each):
  0. recompute the forward's intermediates with the forward stages (intra.py: gam, beta, W, U, kd, qg, and
     Aqk, Tm unless the forward's are given: those two are [T, 64] per head, cheap to keep, and the bulk of
     the intra stage's work; state.py: per-chunk states h and Vn, too large to keep);
  1. state_bwd.py  reverse state pass: dS leaving every chunk, dVn, d initial_state;
  2. chunk_bwd.py  per chunk: dv, dAqk, dM, the state / inverse terms of dq, dk, dGam, dbeta;
  3. intra_bwd.py  per chunk: the pairwise in-chunk terms, dg = reverse cumsum, gate / beta chain rule;
  4. prep_bwd.py   GVA sum of dq/dk over value heads, l2norm chain rule.
The math is kda_ops.reference.chunk_kda_bwd_torch. No host syncs: varlen grids use a static bound on the
number of chunks and a device-side index tensor (common.chunk_layout).
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from .chunk_bwd import chunk_kda_bwd_inter
from .intra import chunk_kda_fwd_intra
from .intra_bwd import chunk_kda_bwd_intra
from .prep_bwd import chunk_kda_bwd_qk
from .state import chunk_kda_fwd_state
from .state_bwd import chunk_kda_bwd_state


def chunk_kda_bwd_triton(
    do: Tensor, dht: Optional[Tensor],
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Optional[Tensor], dt_bias: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor],
    scale: float, lower_bound: Optional[float],
    use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    saved: Optional[Tuple[Tensor, Tensor]] = None,
):
    """Chunked KDA backward on the GPU (same semantics as kda_ops.reference.chunk_kda_bwd_torch).

    do [B, T, HV, V]; dht [N, HV, K, V] fp32 or None; the other arguments are the forward's
    (q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; A_log [HV]; dt_bias [HV * K];
    initial_state [N, HV, K, V]; cu_seqlens [N + 1] with B == 1), all contiguous; saved: the (Aqk, Tm) that
    chunk_kda_fwd_triton returned for these inputs, or None (recomputed).
    Returns (dq, dk, dv, dg, dbeta in the dtypes of q, k, v, g, beta; dA_log [HV] fp32 or None;
    ddt_bias [HV * K] fp32 or None; dh0 [N, HV, K, V] fp32 or None). No host sync.

    >>> dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = chunk_kda_bwd_triton(
    ...     do, None, q, k, v, g, beta, A_log, dt_bias, h0, None, K ** -0.5, None, True, True, True, False)
    """
    # 0. recompute the forward intermediates
    # lowp: the forward's own storage (bf16 W, U, qg, Aqk, kd^T with bf16 inputs), so the recomputed states
    # and Vn are the forward's; stages 1 and 2 round these operands to bf16 for their dots anyway
    intra = chunk_kda_fwd_intra(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound,
                                use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, lowp=True,
                                saved=saved)
    del saved
    st = chunk_kda_fwd_state(intra, initial_state, cu_seqlens, False, v.dtype,
                             store_o=False, store_h=True, store_vn=True)
    gam, beta_act, Tm = intra.gam, intra.beta, intra.Tm
    rq, rk = intra.rq, intra.rk      # l2norm row factors (None without the l2norm)
    # 1. reverse state pass
    kd_t = intra.kdt is not None
    dh, dvn, dh0 = chunk_kda_bwd_state(intra.qg, intra.kdt if kd_t else intra.kd, intra.W, gam, intra.Aqk,
                                       do, dht, initial_state is not None, cu_seqlens, kd_t)
    del intra       # U and W are not needed past the state passes (stage 2 takes Vn = U - W S)
    # 2. per chunk: through the state and the inverse
    dq, dk, dgam, dv, dAqk, dM, dbeta_p = chunk_kda_bwd_inter(
        q, k, rq, rk, v, gam, beta_act, Tm, st.h, st.vn, do, dh, dvn, cu_seqlens, scale)
    del st, dh, dvn, Tm
    # 3. per chunk: pairwise in-chunk terms, cumsum, gate and beta
    dq, dk, dg, dbeta, dA_log, ddt_bias = chunk_kda_bwd_intra(
        q, k, rq, rk, gam, beta_act, dAqk, dM, dq, dk, dgam, dbeta_p, g, beta, A_log, dt_bias,
        cu_seqlens, lower_bound, use_gate, use_beta_sigmoid, allow_neg_eigval)
    del dAqk, dM, dgam, dbeta_p
    # 4. GVA sum and l2norm
    dq, dk = chunk_kda_bwd_qk(dq, dk, q, k, use_qk_l2norm)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0
