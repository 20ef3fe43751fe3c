"""Backward stage 3: the pairwise in-chunk terms, the reverse in-chunk cumsum, the gate and beta chain rule.

Aqk[i, j] = scale sum_d q_i k_j exp(Gam_i - Gam_j) (j <= i) and Akk[i, j] = sum_d k_i k_j exp(Gam_i - Gam_j)
(j < i). Given dAqk (= P, with the scale) and dM (stage 2), dAkk = beta_i dM:

    dq_i  += sum_j P_ij k_j e_ij             dk_j += sum_i P_ij q_i e_ij + sum_i dAkk_ij k_i e_ij
    X_i    = sum_j dM_ij k_j e_ij            dk_i += beta_i X_i           dbeta_i += <k_i, X_i>
    dGam  += q dq_a - k dk_aq + k (dk_ai - dk_aj)

e_ij = exp(Gam_i - Gam_j) is never formed as exp(Gam_i) exp(-Gam_j) over a span that can overflow: the
chunk is cut into 16-row blocks; for one row block, all earlier columns are factored around the block's first
row (row-direction sums) and all later rows around the block's last row (column-direction sums), so both
factors are <= 1 and each side is one tensor-core dot over the chunk; the diagonal 16x16 block is exact per
token pair, as one [16, 16, BK] tile.

One program per (chunk, value head) loops over K-blocks (the decay is elementwise in K) and walks the row
blocks last to first, carrying the running sum of dGam so that dg = reverse cumsum of dGam inside the
chunk; then the gate and beta chain rules (per-program partial sums for dA_log / ddt_bias).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .chunk_bwd import load_rows
from .common import BC, BT, autotune_configs, chunk_bounds, chunk_layout, dot_precision


@triton.autotune(
    configs=autotune_configs([
        triton.Config({"BK": 32}, num_warps=8, num_stages=1),
        triton.Config({"BK": 16}, num_warps=4, num_stages=1),
        triton.Config({"BK": 32}, num_warps=4, num_stages=1),
        triton.Config({"BK": 64}, num_warps=8, num_stages=1),
    ]),
    key=["K", "USE_GATE", "PREC"],
    restore_value=["dq", "dk"],
)
@triton.jit
def chunk_kda_bwd_kernel_intra(
    q, k, rq, rk, gam, beta, dAqk, dM, g_raw, beta_raw, A_log, dt_bias,  # inputs
    dq, dk, dgam, dbeta_p,                     # inputs: stage-2 terms (dq, dk completed in place)
    dg, dbeta, dA_log_p, ddt_bias_p,           # outputs
    cu_seqlens, chunk_indices, lower_bound, T, N, H, HV,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr, HAS_ALOG: tl.constexpr,
    HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (chunk, value head): grid (NT_total, HV). Loops K-blocks, then row blocks last to first."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, i_c, bos, eos = chunk_bounds(i_t, cu_seqlens, chunk_indices, T, N, BT, IS_VARLEN)
    t0 = bos + i_c * BT
    if t0 >= eos:
        return
    Tc = tl.minimum(eos - t0, BT).to(tl.int32)
    NC = tl.cdiv(Tc, BC)
    # move every pointer to the chunk's first token once (64-bit), so that the offsets below stay 32-bit
    sq, sg, sa = H * K, HV * K, HV * BT
    q += t0 * sq + i_h * K
    k += t0 * sq + i_h * K
    rq += t0 * H + i_h
    rk += t0 * H + i_h
    gam += t0 * sg + i_hv * K
    dq += t0 * sg + i_hv * K
    dk += t0 * sg + i_hv * K
    dgam += t0 * sg + i_hv * K
    dg += t0 * sg + i_hv * K
    g_raw += t0 * sg + i_hv * K
    dAqk += t0 * sa + i_hv * BT
    dM += t0 * sa + i_hv * BT
    beta += t0 * HV + i_hv
    beta_raw += t0 * HV + i_hv
    dbeta += t0 * HV + i_hv
    dbeta_p += t0 * HV + i_hv

    o_t = tl.arange(0, BT)          # position in the chunk
    o_c = tl.arange(0, BC)          # position in a row block
    m_t = o_t < Tc
    # [BT]
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dalog = tl.zeros([BK], dtype=tl.float32)
    if USE_GATE:
        if HAS_ALOG:
            b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        else:
            b_a = 1.0
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        # [BT, BK] the whole chunk
        b_q = load_rows(q, rq, o_t, m_t, o_k, m_k, sq, H, USE_L2NORM)
        b_k = load_rows(k, rk, o_t, m_t, o_k, m_k, sq, H, USE_L2NORM)
        b_g = tl.load(gam + o_t[:, None] * sg + o_k[None, :], mask=m_tk, other=0.0)
        b_carry = tl.zeros([BK], dtype=tl.float32)
        b_ddt = tl.zeros([BK], dtype=tl.float32)
        if USE_GATE:
            if HAS_BIAS:
                b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            else:
                b_bias = tl.zeros([BK], dtype=tl.float32)
        for i_i in range(NC - 1, -1, -1):
            r0 = i_i * BC
            o_i = r0 + o_c
            m_i = o_i < Tc
            m_ik = m_i[:, None] & m_k[None, :]
            p_ik = o_i[:, None] * sg + o_k[None, :]
            # [BC, BK] the row block
            b_qi = load_rows(q, rq, o_i, m_i, o_k, m_k, sq, H, USE_L2NORM)
            b_ki = load_rows(k, rk, o_i, m_i, o_k, m_k, sq, H, USE_L2NORM)
            b_gi = tl.load(gam + p_ik, mask=m_ik, other=0.0)
            # [BC]
            b_bi = tl.load(beta + o_i * HV, mask=m_i, other=0.0).to(tl.float32)
            # [BC, BT] rows of the block, [BT, BC] columns of the block, [BC, BC] diagonal block
            p_r = o_i[:, None] * sa + o_t[None, :]
            p_c = o_t[:, None] * sa + o_i[None, :]
            p_d = o_i[:, None] * sa + o_i[None, :]
            b_pr = tl.load(dAqk + p_r, mask=m_i[:, None], other=0.0)
            b_mr = tl.load(dM + p_r, mask=m_i[:, None], other=0.0)
            b_pc = tl.load(dAqk + p_c, mask=m_t[:, None], other=0.0)
            b_mc = tl.load(dM + p_c, mask=m_t[:, None], other=0.0) * b_beta[:, None]
            b_pd = tl.load(dAqk + p_d, mask=m_i[:, None], other=0.0)
            b_md = tl.load(dM + p_d, mask=m_i[:, None], other=0.0)

            # row direction, columns before the block: reference = first row of the block
            b_gr = tl.load(gam + r0 * sg + o_k, mask=m_k, other=0.0)
            m_b = (o_t < r0)[:, None] & m_k[None, :]
            b_kb = tl.where(m_b, b_k * tl.exp2(b_gr[None, :] - b_g), 0.0)
            b_ei = tl.where(m_ik, tl.exp2(b_gi - b_gr[None, :]), 0.0)
            # [BC, BT] @ [BT, BK] -> [BC, BK], twice
            b_dqa = tl.dot(b_pr, b_kb, input_precision=PREC) * b_ei
            b_x = tl.dot(b_mr, b_kb, input_precision=PREC) * b_ei
            # column direction, rows after the block: reference = last valid row of the block
            r2 = tl.minimum(r0 + BC, Tc) - 1
            b_gr2 = tl.load(gam + r2 * sg + o_k, mask=m_k, other=0.0)
            m_a = ((o_t > r2) & m_t)[:, None] & m_k[None, :]
            b_ea = tl.where(m_a, tl.exp2(b_g - b_gr2[None, :]), 0.0)
            b_ei2 = tl.where(m_ik, tl.exp2(b_gr2[None, :] - b_gi), 0.0)
            # [BT, BC]^T @ [BT, BK] -> [BC, BK], twice
            b_dkaq = tl.dot(tl.trans(b_pc), b_q * b_ea, input_precision=PREC) * b_ei2
            b_dkaj = tl.dot(tl.trans(b_mc), b_k * b_ea, input_precision=PREC) * b_ei2
            # diagonal block, exact per token pair: [BC(i), BC(j), BK], e_ij for j <= i
            m_d = (o_c[:, None] >= o_c[None, :])[:, :, None] & m_ik[:, None, :]
            b_e = tl.where(m_d, tl.exp2(b_gi[:, None, :] - b_gi[None, :, :]), 0.0)
            b_dqa += tl.sum(b_pd[:, :, None] * b_ki[None, :, :] * b_e, 1)
            b_x += tl.sum(b_md[:, :, None] * b_ki[None, :, :] * b_e, 1)
            b_dkaq += tl.sum(b_pd[:, :, None] * b_qi[:, None, :] * b_e, 0)
            b_dkaj += tl.sum((b_md * b_bi[:, None])[:, :, None] * b_ki[:, None, :] * b_e, 0)

            b_dkai = b_bi[:, None] * b_x
            # combine with the stage-2 terms
            b_dqo = tl.load(dq + p_ik, mask=m_ik, other=0.0) + b_dqa
            b_dko = tl.load(dk + p_ik, mask=m_ik, other=0.0) + b_dkaq + b_dkai + b_dkaj
            tl.store(dq + p_ik, b_dqo, mask=m_ik)
            tl.store(dk + p_ik, b_dko, mask=m_ik)
            b_dgam = tl.load(dgam + p_ik, mask=m_ik, other=0.0)
            b_dgam += b_qi * b_dqa - b_ki * b_dkaq + b_ki * (b_dkai - b_dkaj)
            # dg = reverse cumsum of dGam inside the chunk
            b_dg = tl.cumsum(b_dgam, 0, reverse=True) + b_carry[None, :]
            b_carry += tl.sum(b_dgam, 0)
            if USE_GATE:
                b_xg = tl.load(g_raw + p_ik, mask=m_ik, other=0.0).to(tl.float32) + b_bias[None, :]
                if USE_LOWER_BOUND:
                    lb = tl.cast(lower_bound, tl.float32)
                    b_ax = b_a * b_xg
                    b_s = tl.sigmoid(b_ax)
                    b_dax = b_dg * lb * b_s * (1.0 - b_s)
                    b_dx = b_dax * b_a
                    b_dalog += tl.sum(tl.where(m_ik, b_dax * b_ax, 0.0), 0)
                else:
                    # g = -a softplus(x): dg/dx = -a sigmoid(x), dg/dA_log = g
                    b_sp = tl.maximum(b_xg, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_xg)))
                    b_dx = -b_a * tl.sigmoid(b_xg) * b_dg
                    b_dalog += tl.sum(tl.where(m_ik, -b_a * b_sp * b_dg, 0.0), 0)
                b_dx = tl.where(m_ik, b_dx, 0.0)
                b_ddt += tl.sum(b_dx, 0)
                tl.store(dg + p_ik, b_dx.to(dg.dtype.element_ty), mask=m_ik)
            else:
                tl.store(dg + p_ik, b_dg.to(dg.dtype.element_ty), mask=m_ik)
            # dbeta_i += <k_i, X_i>, placed at the block's rows of the chunk vector
            b_dbi = tl.sum(b_ki * b_x, 1)
            b_db += tl.sum(tl.where(o_t[:, None] == o_i[None, :], b_dbi[None, :], 0.0), 1)
        if USE_GATE:
            if HAS_BIAS:
                tl.store(ddt_bias_p + (i_t * HV + i_hv) * K + o_k, b_ddt, mask=m_k)

    # [BT]
    b_db += tl.load(dbeta_p + o_t * HV, mask=m_t, other=0.0)
    if USE_BETA_SIGMOID:
        b_s = tl.sigmoid(tl.load(beta_raw + o_t * HV, mask=m_t, other=0.0).to(tl.float32))
        b_db = b_db * b_s * (1.0 - b_s)
        if ALLOW_NEG_EIGVAL:
            b_db = 2.0 * b_db
    tl.store(dbeta + o_t * HV, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    if USE_GATE:
        if HAS_ALOG:
            tl.store(dA_log_p + i_t * HV + i_hv, tl.sum(b_dalog, 0))


def chunk_kda_bwd_intra(
    q: torch.Tensor, k: torch.Tensor, rq: Optional[torch.Tensor], rk: Optional[torch.Tensor],
    gam: torch.Tensor, beta: torch.Tensor, dAqk: torch.Tensor, dM: torch.Tensor,
    dq: torch.Tensor, dk: torch.Tensor, dgam: torch.Tensor, dbeta_p: torch.Tensor,
    g: torch.Tensor, beta_raw: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], lower_bound: Optional[float],
    use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
):
    """Stage 3 launcher.

    q, k [B, T, H, K] raw, rq, rk [B, T, H] fp32 l2norm row factors or None; gam fp32 [B, T, HV, K] (log2);
    beta [B, T, HV] activated; dAqk, dM fp32 [B, T, HV, 64]; dq, dk, dgam fp32 [B, T, HV, K] and dbeta_p
    fp32 [B, T, HV] from stage 2 (dq, dk are completed in place); g [B, T, HV, K] (raw gate when use_gate);
    beta_raw [B, T, HV] (the op's input); A_log [HV], dt_bias [HV * K] or None.
    Returns (dq, dk fp32 [B, T, HV, K] w.r.t. the normalised q/k per value head, dg [B, T, HV, K] in g.dtype,
    dbeta [B, T, HV] in beta_raw.dtype, dA_log [HV] fp32 or None, ddt_bias [HV * K] fp32 or None).

    >>> dq, dk, dg, dbeta, dA_log, ddt_bias = chunk_kda_bwd_intra(q, k, rq, rk, intra.gam, intra.beta, dAqk,
    ...     dM, dq, dk, dgam, dbeta_p, g, beta, A_log, dt_bias, None, None, True, True, False)
    """
    B, T, H, K = q.shape
    HV = gam.shape[2]
    layout = chunk_layout(B, T, cu_seqlens)
    dg = torch.empty_like(g)
    dbeta = torch.empty_like(beta_raw)
    has_alog = use_gate and A_log is not None
    has_bias = use_gate and dt_bias is not None
    # per-program partial sums (zero for programs past the real work), reduced below: no atomics, no sync
    dA_log_p = torch.zeros(layout.NT_total, HV, dtype=torch.float32, device=q.device) if has_alog else None
    ddt_bias_p = torch.zeros(layout.NT_total, HV, K, dtype=torch.float32, device=q.device) if has_bias else None
    dummy = gam
    pick = lambda x: dummy if x is None else x  # noqa: E731
    torch.library.wrap_triton(chunk_kda_bwd_kernel_intra)[(layout.NT_total, HV)](
        q, k, pick(rq), pick(rk), gam, beta, dAqk, dM, g, beta_raw, pick(A_log if has_alog else None),
        pick(dt_bias if has_bias else None),
        dq, dk, dgam, dbeta_p,
        dg, dbeta, pick(dA_log_p), pick(ddt_bias_p),
        pick(cu_seqlens), pick(layout.chunk_indices), 0.0 if lower_bound is None else float(lower_bound),
        T, layout.N, H, HV, K=K, BT=BT, BC=BC,
        USE_L2NORM=rq is not None, USE_GATE=use_gate, USE_LOWER_BOUND=lower_bound is not None,
        USE_BETA_SIGMOID=use_beta_sigmoid, ALLOW_NEG_EIGVAL=allow_neg_eigval, HAS_ALOG=has_alog,
        HAS_BIAS=has_bias, IS_VARLEN=cu_seqlens is not None, PREC=dot_precision(q.dtype),
    )
    dA_log = dA_log_p.sum(0) if has_alog else None
    ddt_bias = ddt_bias_p.sum(0).reshape(HV * K) if has_bias else None
    return dq, dk, dg, dbeta, dA_log, ddt_bias
