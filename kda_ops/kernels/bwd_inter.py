"""Backward stage 2: the per-chunk terms that go through the state and through the inverse Tm.

One program per (K-block or V side, chunk, value head). With S the state entering the chunk, dS the
gradient of the state leaving it (bwd_state.py), dVn from there, and U = Tm (beta v), W = Tm (beta k exp(Gam)):

    dAqk = dO Vn^T (causal)                      dXu = Tm^T dVn        dv = beta dXu
    dW   = -dVn S^T                              dXw = Tm^T dW         dkg = beta dXw
    dM   = -dXu Vn^T (strictly lower)            dbeta  = <dXu, v> + <dXw, k exp(Gam)>   (partial)
    dq   = scale (dO S^T) exp(Gam)
    dk   = dkg exp(Gam) + (Vn dS^T) exp(Gam_last - Gam)
    dGam = dq q + dkg k exp(Gam) - (Vn dS^T) k exp(Gam_last - Gam)  (+ the chunk-end row terms)

dM is the gradient through the inverse, -(dXu U^T + dXw W^T) = -Tm^T dVn (U - W S)^T, and U - W S = Vn: one
[BT, V] @ [V, BT] product on the V side, with neither U nor W read and no sum across the K-block programs.

The pairwise (intra-chunk) terms through Aqk and Akk are added by bwd_intra.py; bwd_gate.py
does the reverse in-chunk cumsum.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl

from .common import (BT, ChunkIndex, absent, autotune_configs, chunk_bounds, dot_precision, length_jit, load_rows,
                     lowp_dot, tune_size)


@triton.autotune(
    configs=autotune_configs([
        triton.Config({"BK": 64, "BV": 64}, num_warps=8, num_stages=2),
        triton.Config({"BK": 64, "BV": 32}, num_warps=4, num_stages=2),
        triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=1),
        triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=3),
        # slightly faster than 2 stages at (B, T, HV, K) = (4, 4096, 32, 128)
        triton.Config({"BK": 64, "BV": 32}, num_warps=4, num_stages=3),
        # BK 32: one more K-side program per chunk, but no spills. At K = 128 (bf16, sm_90, triton 3.6) the
        # 4-warp configs above spill 400-670 bytes per thread at BK 64 and none at BK 32 (250-255 registers)
        triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=3),
        triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=2),
        # (BK 32, BV 64, 4 warps, 1 stage) faulted (CUDA illegal memory access) at K = V = 64 with this kernel,
        # alone of its configs, on the H200 (triton 3.6): not listed
        triton.Config({"BK": 32, "BV": 64}, num_warps=8, num_stages=2),
    ]),
    key=["K", "V", "PREC", "TUNE_SIZE"],
    reset_to_zero=["dbeta"],
)
@length_jit
def chunk_kda_bwd_kernel_inter(
    q, k, rq, rk, v, gam, beta, Tm, h, vn, do, dh, dvn,         # inputs
    dq, dk, dgam, dv, dAqk, dM, dbeta,                          # outputs (dbeta: zeroed, accumulated)
    cu_seqlens, chunk_indices, scale, T, N, H, HV, TUNE_SIZE,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOWP_DOT: tl.constexpr,
):
    """Grid (cdiv(K, BK) + 1, NT_total, HV): program i_k < cdiv(K, BK) does K-block i_k (dq, dk, dGam and
    its share of dbeta); the last one does the V side (dAqk, dM, dv and its share of dbeta)."""
    i_k, i_t, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, i_c, bos, eos = chunk_bounds(i_t, cu_seqlens, chunk_indices, T, N, BT, IS_VARLEN)
    t0 = bos + i_c * BT
    if t0 >= eos:
        return
    f_scale = tl.cast(scale, tl.float32)
    if LOWP_DOT:
        DOT_DT = do.dtype.element_ty
    else:
        DOT_DT = tl.float32

    Tc = tl.minimum(eos - t0, BT).to(tl.int32)
    # move every pointer to the chunk's first token once (64-bit), so that the offsets below stay 32-bit
    sq, sg, sv, sa = H * K, HV * K, HV * V, HV * BT
    q += t0 * sq + i_h * K
    k += t0 * sq + i_h * K
    rq += t0 * H + i_h
    rk += t0 * H + i_h
    off_v = t0 * sv + i_hv * V
    v += off_v
    vn += off_v
    do += off_v
    dvn += off_v
    dv += off_v
    off_k = t0 * sg + i_hv * K
    gam += off_k
    dq += off_k
    dk += off_k
    dgam += off_k
    Tm += t0 * sa + i_hv * BT
    dAqk += t0 * sa + i_hv * BT
    dM += t0 * sa + i_hv * BT
    beta += t0 * HV + i_hv
    dbeta += t0 * HV + i_hv

    o_c = tl.arange(0, BT)
    m_t = o_c < Tc
    t_last = Tc - 1
    # [BT]
    b_beta = tl.load(beta + o_c * HV, mask=m_t, other=0.0).to(tl.float32)
    # [BT(i), BT(j)], unit lower triangular
    b_tm = tl.load(Tm + o_c[:, None] * sa + o_c[None, :], mask=m_t[:, None], other=0.0)
    b_tm = tl.where(o_c[:, None] >= o_c[None, :], b_tm, 0.0).to(DOT_DT)
    b_db = tl.zeros([BT], dtype=tl.float32)

    if i_k == tl.cdiv(K, BK):
        # ---- V side: dAqk = dO Vn^T, dXu = Tm^T dVn, dv = beta dXu, dM = -dXu Vn^T, dbeta += <dXu, v>
        b_daqk = tl.zeros([BT, BT], dtype=tl.float32)
        b_dm = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            p_tv = o_c[:, None] * sv + o_v[None, :]
            # [BT, BV]
            b_do = tl.load(do + p_tv, mask=m_tv, other=0.0).to(DOT_DT)
            b_vn = tl.load(vn + p_tv, mask=m_tv, other=0.0).to(DOT_DT)
            b_dvn = tl.load(dvn + p_tv, mask=m_tv, other=0.0).to(DOT_DT)
            b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(tl.float32)
            # [BT, BV] @ [BV, BT] -> [BT, BT]
            b_daqk += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
            # [BT, BT]^T @ [BT, BV] -> [BT, BV]
            b_dxu = tl.dot(tl.trans(b_tm), b_dvn, input_precision=PREC)
            tl.store(dv + p_tv, (b_dxu * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
            b_db += tl.sum(b_dxu * b_v, 1)
            # [BT, BV] @ [BV, BT] -> [BT, BT]
            b_dm += tl.dot(b_dxu.to(DOT_DT), tl.trans(b_vn), input_precision=PREC)
        p_tc = o_c[:, None] * sa + o_c[None, :]
        tl.store(dAqk + p_tc, tl.where(o_c[:, None] >= o_c[None, :], f_scale * b_daqk, 0.0), mask=m_t[:, None])
        tl.store(dM + p_tc, tl.where(o_c[:, None] > o_c[None, :], -b_dm, 0.0), mask=m_t[:, None])
    else:
        # ---- K-block i_k: dq, dk, dGam through the state and dW; dbeta += <dXw, k exp2(gam)>
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        h += (i_t * HV + i_hv).to(tl.int64) * K * V
        dh += (i_t * HV + i_hv).to(tl.int64) * K * V
        b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
        b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        b_dgl = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_kv = m_k[:, None] & m_v[None, :]
            p_tv = o_c[:, None] * sv + o_v[None, :]
            p_kv = o_k[:, None] * V + o_v[None, :]
            # [BT, BV]
            b_do = tl.load(do + p_tv, mask=m_tv, other=0.0).to(DOT_DT)
            b_vn = tl.load(vn + p_tv, mask=m_tv, other=0.0).to(DOT_DT)
            b_dvn = tl.load(dvn + p_tv, mask=m_tv, other=0.0).to(DOT_DT)
            # [BK, BV]
            b_h = tl.load(h + p_kv, mask=m_kv, other=0.0)
            b_dh = tl.load(dh + p_kv, mask=m_kv, other=0.0)
            b_dgl += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
            b_h = b_h.to(DOT_DT)
            # [BT, BV] @ [BV, BK] -> [BT, BK], three times
            b_dqg += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
            b_dkd += tl.dot(b_vn, tl.trans(b_dh.to(DOT_DT)), input_precision=PREC)
            b_dw -= tl.dot(b_dvn, tl.trans(b_h), input_precision=PREC)
        p_tk = o_c[:, None] * sg + o_k[None, :]
        # [BT, BK]
        b_q = load_rows(q, rq, o_c, m_t, o_k, m_k, sq, H, USE_L2NORM)
        b_k = load_rows(k, rk, o_c, m_t, o_k, m_k, sq, H, USE_L2NORM)
        b_g = tl.load(gam + p_tk, mask=m_tk, other=0.0)
        # [BK]
        b_gl = tl.load(gam + t_last * sg + o_k, mask=m_k, other=0.0)
        # gam <= 0 and gam_last - gam <= 0: both factors are bounded by 1
        b_eg = tl.where(m_tk, tl.exp2(b_g), 0.0)
        b_ed = tl.where(m_tk, tl.exp2(b_gl[None, :] - b_g), 0.0)
        # [BT, BT]^T @ [BT, BK] -> [BT, BK]
        b_dxw = tl.dot(tl.trans(b_tm), b_dw.to(DOT_DT), input_precision=PREC)
        b_kg = b_k * b_eg
        b_kd = b_k * b_ed
        b_db += tl.sum(b_dxw * b_kg, 1)
        b_dkg = b_dxw * b_beta[:, None]
        b_dq = f_scale * b_dqg * b_eg
        b_dk = b_dkg * b_eg + b_dkd * b_ed
        b_dgam = b_dq * b_q + b_dkg * b_kg - b_dkd * b_kd
        # chunk end: S' = Diag(exp2(gam_last)) S + kd^T Vn
        b_dlast = b_dgl * tl.exp2(b_gl) + tl.sum(b_dkd * b_kd, 0)
        b_dgam += tl.where(o_c[:, None] == t_last, b_dlast[None, :], 0.0)
        tl.store(dq + p_tk, b_dq, mask=m_tk)
        tl.store(dk + p_tk, b_dk, mask=m_tk)
        tl.store(dgam + p_tk, b_dgam, mask=m_tk)

    # the programs of one chunk add their shares of dbeta
    tl.atomic_add(dbeta + o_c * HV, b_db, mask=m_t, sem="relaxed")


def chunk_kda_bwd_inter(
    q: torch.Tensor, k: torch.Tensor, rq: Optional[torch.Tensor], rk: Optional[torch.Tensor],
    v: torch.Tensor, gam: torch.Tensor, beta: torch.Tensor, Tm: torch.Tensor,
    h: torch.Tensor, vn: torch.Tensor, do: torch.Tensor, dh: torch.Tensor, dvn: torch.Tensor,
    idx: ChunkIndex, scale: float,
):
    """The inter kernel's launcher.

    q, k [B, T, H, K] raw, rq, rk [B, T, H] fp32 l2norm row factors (or None: no l2norm);
    v, vn, do [B, T, HV, V]; dvn [B, T, HV, V] (bwd_state.py); gam [B, T, HV, K] fp32 (log2);
    beta [B, T, HV] activated; Tm [B, T, HV, 64]; h, dh [NT_total, HV, K, V].
    Returns fp32 (dq, dk, dgam) [B, T, HV, K] (the terms through the state and Tm), dv [B, T, HV, V]
    (final, v.dtype), fp32 dAqk (= scale dO Vn^T, causal) and dM (strictly lower) [B, T, HV, 64],
    fp32 dbeta (partial) [B, T, HV].

    >>> dq, dk, dgam, dv, dAqk, dM, dbeta = chunk_kda_bwd_inter(q, k, rq, rk, v, intra.gam, intra.beta,
    ...     intra.Tm, st.h, st.vn, do, dh, dvn, idx, K ** -0.5)
    """
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    dev, f32 = q.device, torch.float32
    dq = torch.empty(B, T, HV, K, dtype=f32, device=dev)
    dk = torch.empty(B, T, HV, K, dtype=f32, device=dev)
    dgam = torch.empty(B, T, HV, K, dtype=f32, device=dev)
    dv = torch.empty_like(v)
    dAqk = torch.empty(B, T, HV, BT, dtype=f32, device=dev)
    dM = torch.empty(B, T, HV, BT, dtype=f32, device=dev)
    dbeta = torch.zeros(B, T, HV, dtype=f32, device=dev)
    pick = lambda t: absent(t, gam)  # noqa: E731

    def grid(meta):
        return (triton.cdiv(K, meta["BK"]) + 1, idx.NT_total, HV)

    wrap_triton(chunk_kda_bwd_kernel_inter)[grid](
        q, k, pick(rq), pick(rk), v, gam, beta, Tm, h, vn, do, dh, dvn,
        dq, dk, dgam, dv, dAqk, dM, dbeta,
        pick(idx.cu_seqlens), pick(idx.chunk_indices), float(scale), T, idx.N, H, HV, tune_size(B * T, HV),
        K=K, V=V, BT=BT,
        USE_L2NORM=rq is not None, IS_VARLEN=idx.is_varlen,
        PREC=dot_precision(v.dtype), LOWP_DOT=lowp_dot(v.dtype),
    )
    return dq, dk, dgam, dv, dAqk, dM, dbeta
