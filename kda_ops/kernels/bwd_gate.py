"""Backward stage 4: dg from dGam (the reverse in-chunk cumsum) and the gate chain rule.

One program per (chunk, value head, K-block), after bwd_intra.py (each chunk's dGam rows come from four of its
programs): dg = reverse cumsum of dGam over the chunk's rows, zero where the forward floored the activated gate
(common.gate_floor: G_MIN, a full reset such as g = -inf or a raw gate of +inf through the in-op gate; or the
16-bit floor); with the gate in the op, the chain rule through
``-exp(A_log) softplus(g + dt_bias)`` or ``lower_bound sigmoid(exp(A_log) (g + dt_bias))``, and per-program
partial sums for dA_log / ddt_bias (reduced by the launcher: no atomics).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl

from ..options import KDAInputs, KDAOptions
from .common import BT, ChunkIndex, absent, chunk_bounds, gate_floor, gate_scale, length_jit, softplus


@length_jit
def chunk_kda_bwd_kernel_gate(
    dgam, g_raw, A_log, dt_bias,               # inputs (dgam: dGam from chunk_kda_bwd_kernel_intra)
    dg, dA_log_p, ddt_bias_p,                  # outputs
    cu_seqlens, chunk_indices, lower_bound, T, N, HV,
    K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, HAS_ALOG: tl.constexpr, HAS_BIAS: tl.constexpr,
    IS_VARLEN: tl.constexpr, G_FLOOR: tl.constexpr,
):
    """One program per (chunk, value head, K-block): grid (NT_total, HV, cdiv(K, BK)). dg = reverse cumsum of
    dGam, the gate chain rule. The chunk's rows are taken last to first (position i holds row Tc - 1 - i), so the
    reverse cumsum is an inclusive forward one over the positions."""
    i_t, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c, bos, eos = chunk_bounds(i_t, cu_seqlens, chunk_indices, T, N, BT, IS_VARLEN)
    t0 = bos + i_c * BT
    if t0 >= eos:
        return
    Tc = tl.minimum(eos - t0, BT).to(tl.int32)
    sg = HV * K
    o_t = tl.arange(0, BT)
    m_t = o_t < Tc
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    p_tk = (t0 * sg + i_hv * K) + (Tc - 1 - o_t)[:, None] * sg + o_k[None, :]      # [BT, BK] rows last to first
    # [BT, BK] dg = reverse cumsum of dGam inside the chunk
    b_dg = tl.cumsum(tl.load(dgam + p_tk, mask=m_tk, other=0.0), 0)
    b_x = tl.load(g_raw + p_tk, mask=m_tk, other=0.0).to(tl.float32)
    if USE_GATE:
        b_a = gate_scale(A_log, i_hv, HAS_ALOG)
        if HAS_BIAS:
            b_x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        if USE_LOWER_BOUND:
            lb = tl.cast(lower_bound, tl.float32)
            b_ax = b_a * b_x
            b_s = tl.sigmoid(b_ax)
            b_dg = tl.where(lb * b_s < G_FLOOR, 0.0, b_dg)        # the forward's floor: no gradient
            b_dax = b_dg * lb * b_s * (1.0 - b_s)
            b_dx = b_dax * b_a
            b_dalog = tl.where(m_tk & (b_dax != 0.0), b_dax * b_ax, 0.0)
        else:
            # g = -a softplus(x): dg/dx = -a sigmoid(x), dg/dA_log = g
            b_gact = -b_a * softplus(b_x)
            b_dg = tl.where(b_gact < G_FLOOR, 0.0, b_dg)           # the forward's floor: no gradient
            b_dx = -b_a * tl.sigmoid(b_x) * b_dg
            # a zero dg wins over an infinite gate (raw g = +inf, a full reset): selection, not 0 * inf
            b_dalog = tl.where(m_tk & (b_dg != 0.0), b_gact * b_dg, 0.0)
        b_dx = tl.where(m_tk, b_dx, 0.0)
        tl.store(dg + p_tk, b_dx.to(dg.dtype.element_ty), mask=m_tk)
        if HAS_BIAS:
            tl.store(ddt_bias_p + (i_t * HV + i_hv) * K + o_k, tl.sum(b_dx, 0), mask=m_k)
        if HAS_ALOG:
            tl.store(dA_log_p + (i_t * HV + i_hv) * tl.num_programs(2) + i_k, tl.sum(tl.sum(b_dalog, 0), 0))
    else:
        b_dg = tl.where(b_x < G_FLOOR, 0.0, b_dg)                  # the forward's floor: no gradient
        tl.store(dg + p_tk, b_dg.to(dg.dtype.element_ty), mask=m_tk)


def chunk_kda_bwd_gate(dgam: torch.Tensor, x: KDAInputs, opts: KDAOptions, idx: ChunkIndex
                       ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """dgam fp32 [B, T, HV, K]: dGam (bwd_intra.py); x.g [B, T, HV, K] the op's gate (raw with opts.use_gate);
    x.A_log [HV], x.dt_bias [HV * K] or None.
    Returns (dg [B, T, HV, K] in x.g.dtype, dA_log [HV] fp32 or None, ddt_bias [HV * K] fp32 or None).
    """
    g = x.g
    B, T, HV, K = g.shape
    use_gate = opts.use_gate
    has_alog = use_gate and x.A_log is not None
    has_bias = use_gate and x.dt_bias is not None
    lower_bound = opts.lower_bound
    dg = torch.empty_like(g)
    BK = min(32, max(16, triton.next_power_of_2(K)))
    NK = triton.cdiv(K, BK)
    # per-program partial sums (zero for programs past the real work), reduced below: no atomics, no sync
    dA_log_p = torch.zeros(idx.NT_total, HV, NK, dtype=torch.float32, device=g.device) if has_alog else None
    ddt_bias_p = torch.zeros(idx.NT_total, HV, K, dtype=torch.float32, device=g.device) if has_bias else None
    pick = lambda t: absent(t, dgam)  # noqa: E731
    wrap_triton(chunk_kda_bwd_kernel_gate)[(idx.NT_total, HV, NK)](
        dgam, g, pick(x.A_log if has_alog else None), pick(x.dt_bias if has_bias else None),
        dg, pick(dA_log_p), pick(ddt_bias_p),
        pick(idx.cu_seqlens), pick(idx.chunk_indices), 0.0 if lower_bound is None else float(lower_bound),
        T, idx.N, HV, K=K, BT=BT, BK=BK,
        USE_GATE=use_gate, USE_LOWER_BOUND=lower_bound is not None, HAS_ALOG=has_alog, HAS_BIAS=has_bias,
        IS_VARLEN=idx.is_varlen, G_FLOOR=gate_floor(opts, x.v.dtype), num_warps=4,
    )
    dA_log = dA_log_p.sum((0, 2)) if has_alog else None
    ddt_bias = ddt_bias_p.sum(0).reshape(HV * K) if has_bias else None
    return dg, dA_log, ddt_bias
