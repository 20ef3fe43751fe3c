"""Backward stage 5: q/k gradients back through the pre-processing.

Sums the per-value-head gradients over the G = HV // H value heads that share a q/k head (grouped-value
attention), then, with the l2norm in the op, y = x r, r = (|x|^2 + eps)^-1/2: dx = r (dy - y <y, dy>).
"""
from __future__ import annotations

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl

from .common import L2NORM_EPS, length_jit


@triton.jit
def gva_l2norm_bwd(dx_hv, x, dx, o_t, m_t, i_h, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, USE_L2NORM: tl.constexpr, eps):
    """dx [BT rows, head i_h] = l2norm chain rule of the sum of dx_hv over the head's G value heads."""
    G: tl.constexpr = HV // H
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    # [BT, BK]
    b_dy = tl.zeros([BT, BK], dtype=tl.float32)
    for i_g in range(G):
        b_dy += tl.load(dx_hv + (o_t[:, None] * HV + i_h * G + i_g) * K + o_k[None, :], mask=m_tk, other=0.0)
    p_x = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    if USE_L2NORM:
        b_x = tl.load(x + p_x, mask=m_tk, other=0.0).to(tl.float32)
        # [BT]
        b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) + eps)
        b_y = b_x * b_r[:, None]
        b_dy = b_r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, 1)[:, None])
    tl.store(dx + p_x, b_dy.to(dx.dtype.element_ty), mask=m_tk)


@length_jit
def chunk_kda_bwd_kernel_qk(
    dq_hv, dk_hv, q, k,     # inputs: fp32 [B*T, HV, K] gradients, raw q/k [B*T, H, K]
    dq, dk,                 # outputs [B*T, H, K]
    n_tokens, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    """Grid (cdiv(B * T, BT), H)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < n_tokens
    f_eps = tl.cast(eps, tl.float32)
    gva_l2norm_bwd(dq_hv, q, dq, o_t, m_t, i_h, H, HV, K, BT, BK, USE_L2NORM, f_eps)
    gva_l2norm_bwd(dk_hv, k, dk, o_t, m_t, i_h, H, HV, K, BT, BK, USE_L2NORM, f_eps)


def chunk_kda_bwd_qk(dq_hv: torch.Tensor, dk_hv: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     use_qk_l2norm: bool):
    """dq_hv, dk_hv fp32 [B, T, HV, K] (w.r.t. the normalised q/k of each value head); q, k raw [B, T, H, K].
    Returns (dq, dk) [B, T, H, K] in the q/k dtype.

    >>> dq, dk = chunk_kda_bwd_qk(dq_hv, dk_hv, q, k, use_qk_l2norm=True)
    """
    B, T, H, K = q.shape
    HV = dq_hv.shape[2]
    BK = max(16, triton.next_power_of_2(K))
    BT = max(8, 2048 // BK)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    wrap_triton(chunk_kda_bwd_kernel_qk)[(triton.cdiv(B * T, BT), H)](
        dq_hv, dk_hv, q, k, dq, dk, B * T, float(L2NORM_EPS.value),
        H=H, HV=HV, K=K, BT=BT, BK=BK, USE_L2NORM=use_qk_l2norm, num_warps=4,
    )
    return dq, dk
