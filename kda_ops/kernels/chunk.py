"""The op-level launchers of the chunked KDA: they compose the stages (one file each) into the forward and the
backward. Neither reads tensor values on the host: grids come from shapes and the call's chunk index.

Forward (chunk_kda_fwd_triton):
  fwd_intra.py   gate / beta activation, l2norm factors, gam, Aqk, Tm = (I + L)^-1, kd, qg
  fwd_wu.py      W = Tm kbg, U = Tm diag(beta) v
  fwd_state.py   the pass over chunks with the output fused: o and the final state
Backward (chunk_kda_bwd_triton):
  0. the forward's intermediates again with the forward stages (Aqk and Tm taken from the forward when it kept
     them: [T, 64] per head, cheap to keep, and the bulk of the intra stage's work; the per-chunk states h and
     Vn from fwd_state.py, too large to keep);
  1. bwd_state.py  reverse state pass: dS leaving every chunk, dVn, d initial_state;
  2. bwd_inter.py  per chunk: dv, dAqk, dM, the state / inverse terms of dq, dk, dGam, dbeta;
  3. bwd_intra.py  per chunk: the pairwise in-chunk terms, the beta chain rule;
  4. bwd_gate.py   dg = reverse in-chunk cumsum of dGam, the gate chain rule, dA_log, ddt_bias;
  5. bwd_qk.py     GVA sum of dq/dk over value heads, l2norm chain rule.
The math is kda_ops.reference's chunked implementation.
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from ..options import KDAInputs, KDAOptions
from .bwd_gate import chunk_kda_bwd_gate
from .bwd_inter import chunk_kda_bwd_inter
from .bwd_intra import chunk_kda_bwd_intra
from .bwd_qk import chunk_kda_bwd_qk
from .bwd_state import chunk_kda_bwd_state
from .common import ChunkIndex, zero_uncovered
from .fwd_intra import IntraOut, chunk_kda_fwd_intra
from .fwd_state import chunk_kda_fwd_state
from .fwd_wu import chunk_kda_fwd_wu


def chunk_kda_fwd_triton(
    x: KDAInputs, opts: KDAOptions, idx: ChunkIndex, output_final_state: bool,
) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor]:
    """Chunked KDA forward on the GPU (same semantics as kda_ops.reference's chunked forward).

    x: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (raw gate with opts.use_gate); beta [B, T, HV] (logits
    with opts.use_beta_sigmoid), all contiguous; A_log [HV] fp32 or None; dt_bias [HV * K] fp32 or None;
    initial_state [N, HV, K, V] fp32 (any strides: read in place) or None; x.cu_seqlens is not read: idx
    (kernels.chunk_index of the call) carries the sanitised copy.
    Returns (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32 or None, Aqk, Tm): the last two are
    the intra-chunk stage's [B, T, HV, 64] (bf16 for bf16 v, else fp32), which the backward takes instead of
    recomputing them (``chunk_kda_bwd_triton(..., saved=(Aqk, Tm))``). Tokens no sequence covers (cu_seqlens not
    starting at 0 or not ending at T) get o = 0. No host sync.

    >>> idx = chunk_index(B, T, cu_seqlens)
    >>> o, ht, Aqk, Tm = chunk_kda_fwd_triton(x, opts, idx, output_final_state=True)
    """
    intra, W, U = _intra_wu(x, opts, idx, None)
    out = chunk_kda_fwd_state(W, U, intra.kd, intra.kd_t, intra.qg, intra.Aqk, intra.gam, x.initial_state, idx,
                              output_final_state, x.v.dtype, store_o=True)
    return zero_uncovered(out.o, idx), out.final_state, intra.Aqk, intra.Tm


def chunk_kda_bwd_triton(
    do: Tensor, dht: Optional[Tensor], x: KDAInputs, opts: KDAOptions, idx: ChunkIndex,
    saved: Optional[Tuple[Tensor, Tensor]] = None,
):
    """Chunked KDA backward on the GPU (same semantics as kda_ops.reference's chunked backward).

    do [B, T, HV, V] contiguous; dht [N, HV, K, V] fp32 (any strides) or None; x, opts, idx: the forward's;
    saved: the (Aqk, Tm) that chunk_kda_fwd_triton returned for these inputs, or None (recomputed).
    Returns (dq, dk, dv, dg, dbeta in the dtypes of q, k, v, g, beta; dA_log [HV] fp32 or None;
    ddt_bias [HV * K] fp32 or None; dh0 [N, HV, K, V] fp32 or None). No host sync.

    >>> dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = chunk_kda_bwd_triton(do, None, x, opts, idx, (Aqk, Tm))
    """
    v = x.v
    # 0. recompute the forward intermediates in the forward's own storage (bf16 W, U, qg, Aqk, kd^T with bf16
    # inputs), so that the recomputed states and Vn are the forward's; stages 1 and 2 round these operands to
    # bf16 for their dots anyway
    intra, W, U = _intra_wu(x, opts, idx, saved)
    del saved
    st = chunk_kda_fwd_state(W, U, intra.kd, intra.kd_t, intra.qg, intra.Aqk, intra.gam, x.initial_state, idx,
                             False, v.dtype, store_o=False, store_h=True, store_vn=True)
    del U       # bwd_inter takes Vn = U - W S
    # 1. reverse state pass
    dh, dvn, dh0 = chunk_kda_bwd_state(intra.qg, intra.kd, intra.kd_t, W, intra.gam, intra.Aqk, do, dht,
                                       x.initial_state is not None, idx)
    del W
    gam, beta_act, Tm, rq, rk = intra.gam, intra.beta, intra.Tm, intra.rq, intra.rk
    del intra
    # 2. per chunk: through the state and the inverse
    dq, dk, dgam, dv, dAqk, dM, dbeta_p = chunk_kda_bwd_inter(
        x.q, x.k, rq, rk, v, gam, beta_act, Tm, st.h, st.vn, do, dh, dvn, idx, opts.scale)
    del st, dh, dvn, Tm
    # 3. per chunk: pairwise in-chunk terms and beta
    dq, dk, dbeta = chunk_kda_bwd_intra(x, opts, idx, rq, rk, gam, beta_act, dAqk, dM, dq, dk, dgam, dbeta_p)
    del dAqk, dM, dbeta_p
    # 4. cumsum and gate
    dg, dA_log, ddt_bias = chunk_kda_bwd_gate(dgam, x, opts, idx)
    del dgam
    # 5. GVA sum and l2norm
    dq, dk = chunk_kda_bwd_qk(dq, dk, x.q, x.k, opts.use_qk_l2norm)
    for grad in (dq, dk, dv, dg, dbeta):
        zero_uncovered(grad, idx)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0


def _intra_wu(x: KDAInputs, opts: KDAOptions, idx: ChunkIndex, saved: Optional[Tuple[Tensor, Tensor]]
              ) -> Tuple[IntraOut, Tensor, Tensor]:
    """The intra stage in the forward's storage (lowp) and W, U from it."""
    intra, kbg = chunk_kda_fwd_intra(x, opts, idx, lowp=True, saved=saved)
    W, U = chunk_kda_fwd_wu(x, opts, intra, kbg, idx)
    return intra, W, U
