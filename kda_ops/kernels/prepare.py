"""Stage 1 of the forward: the in-op pre-processing of the gate and beta.

* the gate activation (``use_gate``) and the in-chunk cumulative sum of the log decay, in log2 units:
  ``gam = cumsum_chunk(g) / ln 2`` so that ``exp(cumsum g) == exp2(gam)``;
* the beta activation (``sigmoid``, or ``2 * sigmoid`` with ``allow_neg_eigval``).

The jit helpers here are also called inside the fused intra-chunk kernel (intra.py), which is what the
op-level forward launches; :func:`chunk_kda_fwd_prepare` is the stand-alone stage (gam and beta only),
for a backward that needs them without the rest.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import BT, absent, chunk_bounds, chunk_layout

RCP_LN2 = 1.4426950408889634   # 1 / ln(2)


@triton.jit
def softplus(x):
    # log(1 + exp(x)) without overflow
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def load_gam_block(g, A_log, dt_bias, i_hv, t0, Tc, i_k, lower_bound,
                   HV, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                   HAS_LOWER_BOUND: tl.constexpr):
    """Loads the gate of one chunk and K-block, activates it, returns gam [BT, BK] fp32 (log2 units).

    Rows past the chunk's valid length Tc get a zero log decay, so gam stays finite (they are masked later).
    """
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = o_t < Tc
    m_k = o_k < K
    # [BT, BK]
    p_g = g + (t0 + o_t[:, None]) * (HV * K) + i_hv * K + o_k[None, :]
    b_g = tl.load(p_g, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    if USE_GATE:
        if HAS_DT_BIAS:
            # [BK]
            b_g = b_g + tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        if HAS_A_LOG:
            b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        else:
            b_a = 1.0
        if HAS_LOWER_BOUND:
            b_g = lower_bound * tl.sigmoid(b_a * b_g)
        else:
            b_g = -b_a * softplus(b_g)
        b_g = tl.where(m_t[:, None] & m_k[None, :], b_g, 0.0)
    return tl.cumsum(b_g, axis=0) * 1.4426950408889634


@triton.jit
def load_beta(beta, i_hv, t0, Tc, HV, BT: tl.constexpr,
              USE_BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr):
    """Activated beta of one chunk: [BT] fp32 (zero past Tc)."""
    o_t = tl.arange(0, BT)
    m_t = o_t < Tc
    b_beta = tl.load(beta + (t0 + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    if USE_BETA_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
        if ALLOW_NEG_EIGVAL:
            b_beta = 2.0 * b_beta
        b_beta = tl.where(m_t, b_beta, 0.0)
    return b_beta


@triton.jit
def chunk_kda_fwd_kernel_prepare(
    g, beta, A_log, dt_bias,                 # [B, T, HV, K], [B, T, HV], [HV], [HV * K]
    gam, beta_act,                           # out: [B, T, HV, K] fp32, [B, T, HV] fp32
    cu_seqlens, chunk_indices, lower_bound, T, N, HV,
    K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """One program per (chunk, value head, K-block)."""
    i_t, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c, bos, eos = chunk_bounds(i_t, cu_seqlens, chunk_indices, T, N, BT, IS_VARLEN)
    t0 = bos + i_c * BT
    if t0 >= eos:
        return
    Tc = tl.minimum(eos - t0, BT)
    lb = tl.cast(lower_bound, tl.float32)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    b_gam = load_gam_block(g, A_log, dt_bias, i_hv, t0, Tc, i_k, lb, HV, K, BT, BK,
                           USE_GATE, HAS_A_LOG, HAS_DT_BIAS, HAS_LOWER_BOUND)
    p_gam = gam + (t0 + o_t[:, None]) * (HV * K) + i_hv * K + o_k[None, :]
    tl.store(p_gam, b_gam, mask=(o_t[:, None] < Tc) & (o_k[None, :] < K))
    if i_k == 0:
        b_beta = load_beta(beta, i_hv, t0, Tc, HV, BT, USE_BETA_SIGMOID, ALLOW_NEG_EIGVAL)
        tl.store(beta_act + (t0 + o_t) * HV + i_hv, b_beta, mask=o_t < Tc)


def chunk_kda_fwd_prepare(
    g: torch.Tensor, beta: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], lower_bound: Optional[float],
    use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
):
    """gam [B, T, HV, K] fp32 (in-chunk cumsum of the activated log decay, log2 units) and the activated
    beta [B, T, HV] fp32. g: [B, T, HV, K] (raw gate when use_gate); beta: [B, T, HV]."""
    B, T, HV, K = g.shape
    layout = chunk_layout(B, T, cu_seqlens)
    gam = torch.empty(B, T, HV, K, dtype=torch.float32, device=g.device)
    beta_act = torch.empty(B, T, HV, dtype=torch.float32, device=g.device)
    BK = min(64, triton.next_power_of_2(K))
    grid = (layout.NT_total, HV, triton.cdiv(K, BK))
    torch.library.wrap_triton(chunk_kda_fwd_kernel_prepare)[grid](
        g, beta, absent(A_log, g), absent(dt_bias, g),
        gam, beta_act,
        absent(cu_seqlens, g), absent(layout.chunk_indices, g),
        0.0 if lower_bound is None else float(lower_bound), T, layout.N, HV,
        K=K, BT=BT, BK=BK,
        USE_GATE=use_gate, HAS_A_LOG=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
        HAS_LOWER_BOUND=lower_bound is not None, USE_BETA_SIGMOID=use_beta_sigmoid,
        ALLOW_NEG_EIGVAL=allow_neg_eigval, IS_VARLEN=cu_seqlens is not None,
    )
    return gam, beta_act
