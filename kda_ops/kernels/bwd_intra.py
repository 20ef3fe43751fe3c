"""Backward stage 3: the pairwise in-chunk terms and the beta chain rule (the cumsum and gate follow in bwd_gate.py).

Aqk[i, j] = scale sum_d q_i k_j exp(Gam_i - Gam_j) (j <= i) and Akk[i, j] = sum_d k_i k_j exp(Gam_i - Gam_j)
(j < i). Given dAqk (= P, with the scale) and dM (bwd_inter.py), dAkk = beta_i dM:

    dq_i  += sum_j P_ij k_j e_ij             dk_j += sum_i P_ij q_i e_ij + sum_i dAkk_ij k_i e_ij   (= dk_a)
    X_i    = sum_j dM_ij k_j e_ij            dk_i += beta_i X_i           dbeta_i += <k_i, X_i>
    dGam  += q dq_a + k (beta X - dk_a)

e_ij = exp(Gam_i - Gam_j) is never formed as exp(Gam_i) exp(-Gam_j) over a span that can overflow.

chunk_kda_bwd_kernel_intra, one program per (chunk, 16-row block r, value head): grid (NT_total * 4, HV).
   It loops over K-blocks (the decay is elementwise in K) and owns the rows r0..r0+15 of the chunk: the
   row-direction sums dq_a, X of those rows and the column-direction sum dk_a of those columns. Each sum is
   a loop over the chunk's other 16-row blocks c, one [16, 16] @ [16, BK] tensor-core dot per block, factored
   around a reference row of block r: row direction over the blocks c <= r (P and dM rows r0..r0+15, columns
   of block c), column direction over the blocks c >= r (P and dM rows of block c, columns r0..r0+15, loaded
   transposed: element (a, b) = P[c0 + b, r0 + a]). Per K-block one of two cases, chosen in the kernel from
   the data (no host sync), by a test on block r's own rows at a span s (common.SPAN, or the wider
   common.SPAN_UNIT with the in-op l2norm, whose rows enter the dots normalised, as in the forward's test,
   fwd_intra.py, which tests the four blocks at once):
   * fast (|gam_i - c| <= s for every row i of block r, c the midpoint of its first and last rows' gam, and
     past SPAN s + log2 max(|P|, 2 |dM|) <= 122 over the diagonal block, so that no dot overflows; within SPAN
     any gradient below 2^62 fits): reference = c, and the dots cover the diagonal block r too: row side
     exp2(gam_i - c), column side exp2(c - gam_j), the factor on the side of block r in [2^-s, 2^s], the other
     one <= 1 (so the other blocks' spans do not matter);
   * exact (block r spans more than s, e.g. strong decay without lower_bound): the dots cover the earlier
     blocks only, factored around block r's first row (row direction), and the later blocks only, factored
     around its last row (column direction), so both factors are <= 1; the diagonal 16x16 block r is done
     first, exactly per token pair, elementwise on [16, BK] tiles in 16 steps (step u pairs each row of the
     block with the block's u-th row), and added to dq, dk and dGam on its own (exact_diagonal): a second
     read-modify-write of block r's rows, in place of converting each step's terms into the dots' layout.
   With the in-op safe gate (common.bounded_gate) no block can span more than SPAN: the kernel is built
   without the test and the exact case (BOUNDED), which takes it from 188 to 80 registers at BK 32 / 4 warps.
   It completes dq and dk of its rows in place, writes its rows' dGam (bwd_inter's dgam plus the terms above)
   over the dgam buffer, and writes its rows' dbeta (<k_i, X_i> summed over K-blocks, plus bwd_inter's, through
   the beta chain rule).
bwd_gate.py then turns each chunk's dGam rows (written by four programs of this kernel) into dg.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl

from ..options import KDAInputs, KDAOptions
from .common import (BC, BT, ChunkIndex, SPAN, SPAN_UNIT, absent, autotune_configs, bounded_gate, chunk_bounds,
                     dot_precision, length_jit, load_rows, tf32_round, tune_size)


@triton.autotune(
    configs=autotune_configs([
        # the first one (the interpreter's) fits every K up to 256 and fp32 inputs
        # registers at K = 128, bf16 inputs, sm_90, Triton 3.6 (benchmarks/compile_sm90.py intra_bwd), in order:
        # 188 (two programs per SM); 128 capped (one K-block: two programs of 8 warps; a 192-byte spill at
        # K = 256, hence the uncapped twin); 148 (255 at K = 256); 254; 165 (capped at 168, else 229)
        triton.Config({"BK": 32}, num_warps=4, num_stages=1),
        triton.Config({"BK": 128}, num_warps=8, num_stages=1, maxnreg=128),
        triton.Config({"BK": 128}, num_warps=8, num_stages=1),
        triton.Config({"BK": 64}, num_warps=4, num_stages=1),
        triton.Config({"BK": 16}, num_warps=4, num_stages=1, maxnreg=168),
    ]),
    key=["K", "PREC", "TUNE_SIZE", "BOUNDED"],
    restore_value=["dq", "dk", "dgam"],
)
@length_jit
def chunk_kda_bwd_kernel_intra(
    q, k, rq, rk, gam, beta, dAqk, dM, beta_raw,  # inputs
    dq, dk, dgam, dbeta_p,                     # stage-2 terms: dq, dk completed in place, dgam replaced by dGam
    dbeta,                                     # output
    cu_seqlens, chunk_indices, T, N, H, HV, TUNE_SIZE,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, BOUNDED: tl.constexpr,
):
    """One program per (chunk, row block, value head): grid (NT_total * BT // BC, HV). Loops K-blocks."""
    i_tr, i_hv = tl.program_id(0), tl.program_id(1)
    i_t, i_r = i_tr // (BT // BC), i_tr % (BT // BC)
    i_h = i_hv // (HV // H)
    i_n, i_c, bos, eos = chunk_bounds(i_t, cu_seqlens, chunk_indices, T, N, BT, IS_VARLEN)
    t0 = bos + i_c * BT
    r0 = i_r * BC
    if t0 + r0 >= eos:
        return
    Tc = tl.minimum(eos - t0, BT).to(tl.int32)
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
    dAqk += t0 * sa + i_hv * BT
    dM += t0 * sa + i_hv * BT
    beta += t0 * HV + i_hv
    beta_raw += t0 * HV + i_hv
    dbeta += t0 * HV + i_hv
    dbeta_p += t0 * HV + i_hv

    o_c = tl.arange(0, BC)
    o_i = r0 + o_c                  # the rows of block r
    m_i = o_i < Tc
    NC = tl.cdiv(Tc, BC)
    # block r's last row (scalar): with its first row r0 the exact path's references and the fast path's midpoint
    rl = tl.minimum(r0 + BC - 1, Tc - 1)
    # [BC]
    b_bi = tl.load(beta + o_i * HV, mask=m_i, other=0.0).to(tl.float32)
    b_db = tl.zeros([BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ik = m_i[:, None] & m_k[None, :]
        p_ik = o_i[:, None] * sg + o_k[None, :]
        # [BK] block r's references: a for the row direction, b for the column direction
        if BOUNDED:     # its middle row (within SPAN of every row of the block: common.bounded_gate)
            fast = True
            b_ga = tl.load(gam + tl.minimum(r0 + BC // 2, Tc - 1) * sg + o_k, mask=m_k, other=0.0)
            b_gb = b_ga
        else:
            # the test: largest |gam_i - c| over the rows i of block r in this K-block, c the midpoint of its first
            # and last rows (rows past Tc give zero); only block r's own factors depend on it (the others are <= 1)
            b_g0 = tl.load(gam + r0 * sg + o_k, mask=m_k, other=0.0)
            b_gl = tl.load(gam + rl * sg + o_k, mask=m_k, other=0.0)
            b_c = 0.5 * (b_g0 + b_gl)
            b_d = tl.load(gam + p_ik, mask=m_ik, other=0.0) - b_c[None, :]
            b_s = tl.max(tl.max(tl.where(m_ik, tl.abs(b_d), 0.0), axis=1), axis=0)
            fast = b_s <= SPAN
            if USE_L2NORM:
                # q and k enter the dots normalised (|q_i|, |k_i| <= 1): up to SPAN_UNIT, where the diagonal
                # block's largest pair weight w = max(|P|, 2 |dM|) (beta <= 2) leaves room: a dot over its 16
                # columns stays below 2^126 when s + log2 w <= 122 (non-finite or huge gradients take the exact
                # path). Only read where SPAN is passed.
                if (b_s > SPAN) & (b_s <= SPAN_UNIT):
                    p_d = o_i[:, None] * sa + (r0 + o_c)[None, :]
                    m_d = m_i[:, None] & ((r0 + o_c)[None, :] <= o_i[:, None])
                    b_w = tl.maximum(tl.max(tl.abs(tl.load(dAqk + p_d, mask=m_d, other=0.0))),
                                     2.0 * tl.max(tl.abs(tl.load(dM + p_d, mask=m_d, other=0.0))))
                    fast = b_s + tl.log2(b_w) <= 122.0
            b_ga = tl.where(fast, b_c, b_g0)
            b_gb = tl.where(fast, b_c, b_gl)
        # [BC, BK] accumulators, before the factors of block r's own rows
        b_dqa = tl.zeros([BC, BK], dtype=tl.float32)
        b_x = tl.zeros([BC, BK], dtype=tl.float32)
        b_dka = tl.zeros([BC, BK], dtype=tl.float32)
        # row direction (rows i of block r): the column blocks j < r (+ block r itself when fast), column
        # factors exp2(gam_a - gam_j) clamped at <= 0 for the earlier blocks, in block r at SPAN_UNIT (>= s)
        for i_j in range(0, i_r + tl.where(fast, 1, 0)):
            o_j = i_j * BC + o_c
            m_j = o_j < Tc
            b_gj = tl.load(gam + o_j[:, None] * sg + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.0)
            b_kj = load_rows(k, rk, o_j, m_j, o_k, m_k, sq, H, USE_L2NORM)
            b_kj = tf32_round(b_kj * tl.exp2(tl.minimum(b_ga[None, :] - b_gj, tl.where(i_j < i_r, 0.0, SPAN_UNIT))),
                              PREC)
            # [BC, BC] P[i, j] (j <= i) and dM[i, j] (j < i)
            p_a = o_i[:, None] * sa + o_j[None, :]
            b_p = tl.load(dAqk + p_a, mask=m_i[:, None] & (o_j[None, :] <= o_i[:, None]), other=0.0)
            b_m = tl.load(dM + p_a, mask=m_i[:, None] & (o_j[None, :] < o_i[:, None]), other=0.0)
            # [BC, BC] @ [BC, BK] -> [BC, BK], twice
            b_dqa += tl.dot(b_p, b_kj, input_precision=PREC)
            b_x += tl.dot(b_m, b_kj, input_precision=PREC)
        # column direction (columns j of block r): the row blocks i > r (+ block r itself when fast), row
        # factors exp2(gam_i - gam_b) clamped in block r at SPAN_UNIT (>= s), at <= 0 for the later blocks
        for i_j in range(i_r + tl.where(fast, 0, 1), NC):
            o_j = i_j * BC + o_c
            m_j = o_j < Tc
            b_gj = tl.load(gam + o_j[:, None] * sg + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.0)
            b_ej = tl.exp2(tl.minimum(b_gj - b_gb[None, :], tl.where(i_j > i_r, 0.0, SPAN_UNIT)))
            b_qj = tf32_round(load_rows(q, rq, o_j, m_j, o_k, m_k, sq, H, USE_L2NORM) * b_ej, PREC)
            b_bj = tl.load(beta + o_j * HV, mask=m_j, other=0.0).to(tl.float32)
            b_kj = tf32_round(load_rows(k, rk, o_j, m_j, o_k, m_k, sq, H, USE_L2NORM) * (b_bj[:, None] * b_ej), PREC)
            # [BC, BC] P[j, i] (j >= i) and dM[j, i] (j > i), loaded transposed: rows i of block r
            p_a = o_j[None, :] * sa + o_i[:, None]
            b_p = tl.load(dAqk + p_a, mask=m_j[None, :] & (o_j[None, :] >= o_i[:, None]), other=0.0)
            b_m = tl.load(dM + p_a, mask=m_j[None, :] & (o_j[None, :] > o_i[:, None]), other=0.0)
            # [BC, BC] @ [BC, BK] -> [BC, BK], twice into one sum
            b_dka += tl.dot(b_p, b_qj, input_precision=PREC)
            b_dka += tl.dot(b_m, b_kj, input_precision=PREC)
        # [BC, BK] the own-block factors exp2(gam_i - gam_a) (row side) and exp2(gam_b - gam_j) (column side):
        # in [2^-s, 2^s] when fast, <= 1 otherwise (the clamp only keeps rows past Tc finite)
        b_gi = tl.load(gam + p_ik, mask=m_ik, other=0.0)
        b_ea = tl.exp2(tl.minimum(b_gi - b_ga[None, :], SPAN_UNIT))
        b_eb = tl.exp2(tl.minimum(b_gb[None, :] - b_gi, SPAN_UNIT))
        b_corr = tl.zeros([BC, BK], dtype=tl.float32)
        if PREC == "tf32" and fast:
            # dGam's pair terms: q_i ea dq_a + beta_i k_i ea X - k_i eb dk_a. Each multiplier is replaced by the
            # tf32 value the other direction's dot took for the same row of block r (its own-block operand), so
            # that the two terms of every pair of the diagonal block cancel in dA_log / ddt_bias as in exact
            # arithmetic; the residues go into b_corr (zero with IEEE dots). On the exact path the dots do not
            # cover the diagonal block.
            b_qi = load_rows(q, rq, o_i, m_i, o_k, m_k, sq, H, USE_L2NORM)
            b_ki = load_rows(k, rk, o_i, m_i, o_k, m_k, sq, H, USE_L2NORM)
            b_v = b_qi * b_ea
            b_corr += (tf32_round(b_v, PREC) - b_v) * b_dqa
            b_v = b_ki * (b_bi[:, None] * b_ea)
            b_corr += (tf32_round(b_v, PREC) - b_v) * b_x
            b_v = b_ki * b_eb
            b_corr -= (tf32_round(b_v, PREC) - b_v) * b_dka
        b_dqa *= b_ea
        b_x *= b_ea
        b_dka *= b_eb
        b_db += add_terms(q, k, rq, rk, dq, dk, dgam, o_i, m_i, o_k, m_k, b_bi, b_dqa, b_x, b_dka, b_corr,
                          sq, sg, H, USE_L2NORM)
        if not fast:
            tl.debug_barrier()      # the stores above before the second read-modify-write of the same rows
            b_db += exact_diagonal(q, k, rq, rk, gam, beta, dAqk, dM, dq, dk, dgam, o_i, m_i, o_k, m_k, r0, Tc,
                                   b_bi, sq, sg, sa, H, HV, BC, BK, USE_L2NORM)

    # [BC]
    b_db += tl.load(dbeta_p + o_i * HV, mask=m_i, other=0.0)
    if USE_BETA_SIGMOID:
        b_s = tl.sigmoid(tl.load(beta_raw + o_i * HV, mask=m_i, other=0.0).to(tl.float32))
        b_db = b_db * b_s * (1.0 - b_s)
        if ALLOW_NEG_EIGVAL:
            b_db = 2.0 * b_db
    tl.store(dbeta + o_i * HV, b_db.to(dbeta.dtype.element_ty), mask=m_i)


@triton.jit
def add_terms(q, k, rq, rk, dq, dk, dgam, o_i, m_i, o_k, m_k, b_bi, b_dqa, b_x, b_dka, b_corr, sq, sg, H,
              USE_L2NORM: tl.constexpr):
    """Adds pair terms of block r's rows [BC, BK] (dq_a, X, dk_a and dGam's correction b_corr) to the rows'
    dq, dk and dGam in place; returns their dbeta terms <k_i, X_i> [BC]."""
    p_ik = o_i[:, None] * sg + o_k[None, :]
    m_ik = m_i[:, None] & m_k[None, :]
    b_qi = load_rows(q, rq, o_i, m_i, o_k, m_k, sq, H, USE_L2NORM)
    b_ki = load_rows(k, rk, o_i, m_i, o_k, m_k, sq, H, USE_L2NORM)
    b_dkai = b_bi[:, None] * b_x
    tl.store(dq + p_ik, tl.load(dq + p_ik, mask=m_ik, other=0.0) + b_dqa, mask=m_ik)
    tl.store(dk + p_ik, tl.load(dk + p_ik, mask=m_ik, other=0.0) + b_dka + b_dkai, mask=m_ik)
    b_dgam = tl.load(dgam + p_ik, mask=m_ik, other=0.0) + b_qi * b_dqa + b_ki * (b_dkai - b_dka) + b_corr
    tl.store(dgam + p_ik, b_dgam, mask=m_ik)
    return tl.sum(b_ki * b_x, 1)


@triton.jit
def exact_diagonal(q, k, rq, rk, gam, beta, dAqk, dM, dq, dk, dgam, o_i, m_i, o_k, m_k, r0, Tc, b_bi,
                   sq, sg, sa, H, HV, BC: tl.constexpr, BK: tl.constexpr, USE_L2NORM: tl.constexpr):
    """The pairs of the diagonal block r exactly, for one K-block: step s pairs the rows t of block r with its
    row u = r0 + s; (t, u) is a row-direction pair when u <= t, a column-direction pair (u, t) when u >= t.
    The terms are added to dq, dk and dGam here (add_terms) and their dbeta terms returned: kept apart from
    the dots' accumulators, they stay in the layout they are loaded in, and the dots' accumulators are not
    live across the 16 steps."""
    b_gi = tl.load(gam + o_i[:, None] * sg + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)
    b_dqa = tl.zeros([BC, BK], dtype=tl.float32)
    b_x = tl.zeros([BC, BK], dtype=tl.float32)
    b_dka = tl.zeros([BC, BK], dtype=tl.float32)
    for s in range(tl.minimum(BC, Tc - r0)):
        o_u = tl.full([1], r0 + s, tl.int32)
        m_u = o_u < Tc
        # [1, BK] row u of q and k as stored (their l2norm factors go into the [BC] coefficients below)
        m_uk = m_u[:, None] & m_k[None, :]
        b_ku = tl.load(k + o_u[:, None] * sq + o_k[None, :], mask=m_uk, other=0.0).to(tl.float32)
        b_qu = tl.load(q + o_u[:, None] * sq + o_k[None, :], mask=m_uk, other=0.0).to(tl.float32)
        b_d = b_gi - tl.load(gam + o_u[:, None] * sg + o_k[None, :], mask=m_uk, other=0.0)
        # [BC] P[t, u], dM[t, u] (u <= t), P[u, t], beta_u dM[u, t] (u >= t)
        b_ptu = tl.load(dAqk + o_i * sa + o_u, mask=m_i & (o_u <= o_i), other=0.0)
        b_mtu = tl.load(dM + o_i * sa + o_u, mask=m_i & (o_u < o_i), other=0.0)
        b_put = tl.load(dAqk + o_u * sa + o_i, mask=m_u & (o_u >= o_i), other=0.0)
        b_mut = tl.load(dM + o_u * sa + o_i, mask=m_u & (o_u > o_i), other=0.0)
        b_bu = tl.load(beta + o_u * HV, mask=m_u, other=0.0).to(tl.float32)                   # [1]
        if USE_L2NORM:
            b_rku = tl.load(rk + o_u * H, mask=m_u, other=0.0)                                 # [1]
            b_ptu *= b_rku
            b_mtu *= b_rku
            b_put *= tl.load(rq + o_u * H, mask=m_u, other=0.0)
            b_bu *= b_rku
        b_mut *= b_bu
        # [BC, BK] e(t, u) = exp2(gam_t - gam_u) where u <= t and e(u, t) where u >= t: both are
        # exp2(-|gam_t - gam_u|) there (gam does not increase: g <= 0 is the op's contract), one exp2 for the
        # two (<= 1)
        b_e = tl.exp2(-tl.abs(b_d))
        b_ke = b_ku * b_e
        b_dqa += b_ptu[:, None] * b_ke
        b_x += b_mtu[:, None] * b_ke
        b_dka += b_put[:, None] * (b_qu * b_e)
        b_dka += b_mut[:, None] * b_ke
    return add_terms(q, k, rq, rk, dq, dk, dgam, o_i, m_i, o_k, m_k, b_bi, b_dqa, b_x, b_dka,
                     tl.zeros([BC, BK], dtype=tl.float32), sq, sg, H, USE_L2NORM)


def chunk_kda_bwd_intra(
    x: KDAInputs, opts: KDAOptions, idx: ChunkIndex, rq: Optional[torch.Tensor], rk: Optional[torch.Tensor],
    gam: torch.Tensor, beta: torch.Tensor, dAqk: torch.Tensor, dM: torch.Tensor,
    dq: torch.Tensor, dk: torch.Tensor, dgam: torch.Tensor, dbeta_p: torch.Tensor,
):
    """Row-block kernel launcher. x: the op's inputs (q, k [B, T, H, K] raw; beta [B, T, HV] the raw beta);
    rq, rk [B, T, H] fp32 l2norm row factors or None; gam fp32 [B, T, HV, K] (log2); beta [B, T, HV] activated;
    dAqk, dM fp32 [B, T, HV, 64]; dq, dk, dgam fp32 [B, T, HV, K] and dbeta_p fp32 [B, T, HV] from bwd_inter
    (dq, dk are completed in place, dgam is overwritten with dGam).
    Returns (dq, dk fp32 [B, T, HV, K] w.r.t. the normalised q/k per value head, dbeta [B, T, HV] in
    x.beta.dtype).

    >>> dq, dk, dbeta = chunk_kda_bwd_intra(x, opts, idx, rq, rk, intra.gam, intra.beta, dAqk, dM, dq, dk, dgam,
    ...                                     dbeta_p)
    """
    q, k, beta_raw = x.q, x.k, x.beta
    B, T, H, K = q.shape
    HV = gam.shape[2]
    dbeta = torch.empty_like(beta_raw)
    pick = lambda t: absent(t, gam)  # noqa: E731
    wrap_triton(chunk_kda_bwd_kernel_intra)[(idx.NT_total * (BT // BC), HV)](
        q, k, pick(rq), pick(rk), gam, beta, dAqk, dM, beta_raw,
        dq, dk, dgam, dbeta_p,
        dbeta,
        pick(idx.cu_seqlens), pick(idx.chunk_indices),
        T, idx.N, H, HV, tune_size(B * T, HV), K=K, BT=BT, BC=BC,
        USE_L2NORM=rq is not None, USE_BETA_SIGMOID=opts.use_beta_sigmoid, ALLOW_NEG_EIGVAL=opts.allow_neg_eigval,
        IS_VARLEN=idx.is_varlen, PREC=dot_precision(q.dtype), BOUNDED=bounded_gate(opts, SPAN),
    )
    return dq, dk, dbeta
