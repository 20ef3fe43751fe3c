"""Forward stage 1: everything inside one chunk that does not depend on the state.

One program per (chunk, value head): the gate and beta activation (common.py's helpers), gam, beta, Aqk, L
and Tm, and kd, qg and kbg from the q, k and gam tiles it loads anyway; W and U follow from Tm and kbg in
fwd_wu.py. This kernel needs ~250 registers per thread in its main loop (two programs per SM at 4 warps); the W/U
kernel needs far fewer, so it runs more programs per SM.

    gam      [BT, K]   in-chunk cumsum of the activated log decay, log2 units (stored: the kernel re-reads it)
    Aqk      [BT, BT]  scale * sum_d q_i k_j exp2(gam_i - gam_j), j <= i
    L        [BT, BT]  beta_i * sum_d k_i k_j exp2(gam_i - gam_j), j < i          (not stored)
    Tm       [BT, BT]  (I + L)^-1, unit lower triangular
    W        [BT, K]   Tm diag(beta) (k * exp2(gam))
    U        [BT, V]   Tm diag(beta) v
    kd       [BT, K]   k * exp2(gam_last - gam)          (the state update's key, read by fwd_state.py;
                                                          stored as kd^T [K, BT] per chunk in the forward)
    qg       [BT, K]   scale * q * exp2(gam)             (the output's query, read by fwd_state.py)

Numerics. The pairwise decay exp2(gam_i - gam_j) (<= 1 for j <= i) is never formed as exp2(gam_i) *
exp2(-gam_j) over a span where that can overflow (with the unsafe gate the per-step decay is unbounded).
Per K-block, chosen in the kernel from the data (no host sync):
* fast (every 16-row block of the chunk spans at most 2 span, gam_f - gam_l with f, l its first and last rows;
  span is common.SPAN_UNIT with the in-op l2norm, whose rows enter the dots normalised, else common.SPAN; tested
  first for the chunk's two 32-row halves as the blocks, which weak gates pass, with 2 blocks instead of 4; a test
  that failed for a K-block is not tried again for the chunk's later K-blocks, which then start from the next
  level down, as the channels of a head share its decay rate): every
  pair j <= i by one tensor-core dot per operand and block of rows i, in place (group_dots):
  (x_i exp2(gam_i - c)) . (k_j exp2(c - gam_j)) for the columns j up to the block's last row, around
  c = gam_l + span. Within the block all factors are in [2^-span, 2^span]; the factors of earlier columns are
  at most 2^-span, and one that flushes to zero drops a term below 2^(span - 126) (none of any size where the
  block spans at most span). A K-block costs 5 exp2 tiles, 8 dots and 1 tile of row loads (the blocks' last
  rows, also the test's reference: group_delta);
* otherwise (a block spans more than 2 span, e.g. strong decay without lower_bound) the pairs of different
  blocks are taken exactly, by levels 32 and 64 of a binary split of the chunk (split_level): at level S each
  S-row segment pairs the rows of its second half with the columns of its first half in one dot per operand,
  factored around the segment's middle row (both factors <= 1 for any decay). Then down the split inside the
  blocks: level 16, then the same test for the 8-row halves of the blocks, whose pairs take one dot per operand,
  factored around each half's reference and masked to the halves (diagonal_dots); where that fails, level 8 and
  the 4-row quarters; then level 4 and the 2-row pairs; at worst level 2 and single rows (the diagonal i == j,
  decay 1, which always pass). Every path covers each pair j <= i once: 8, 10, 12 or 14 dots per K-block, and
  per level one more row load (the segments' middle rows: the split's reference, and the first rows of the
  second halves) and a reduction for its test.
With the in-op safe gate no block spans more than 2 common.SPAN (common.bounded_gate): the kernel is then built
without the test and the exact path (BOUNDED). With the in-op l2norm as well and lower_bound >= -5, no 32-row
half spans more than 2 SPAN_UNIT: the fast path then takes the halves as its blocks (DIAG = 32,
diagonal_rows; 4 dots per K-block). With 16-bit inputs, the in-op gate and the in-op l2norm each step's log decay
is floored at common.G_MIN_16BIT (G_FLOOR; common.gate_floor), which keeps every 16-row block within 2 SPAN_UNIT:
the kernel is then built without the exact path (EXACT False), the halves where their test passes, else the 16-row
blocks with no test.
The inverse is blockwise: D = (I + L_diag)^-1 for the four diagonal blocks at once (by doubling, six batched
[4, 16, 16] dots in tf32x3 / IEEE fp32), then the block merges as Tm = sum_{p<4} (-D L_off)^p D, three dots
X <- D - (D L_off) X (a nilpotent series: exact). L and D stay in registers: the diagonal blocks are taken out
of L and D is put back into a [64, 64] tile by reshapes. All of this is fp32 (the inverse merges in tf32); the
W, U dots are bf16 in the bf16 forward (below), tf32 otherwise.
Storage, two modes (``lowp``, see IntraOut):
* forward and the backward's recompute (``lowp`` and bf16 inputs): Tm and W's right operand beta k exp2(gam)
  in bf16, so that W and U are bf16 dots (relative RMS error of o vs fp64: 2.38e-3 -> 2.90e-3);
  W, qg, U, Aqk and kd in bf16, so that every dot of the state pass is a bf16 dot; kd goes out transposed, one
  [K, BT] block per (chunk, value head) (``kd_t``), so the state pass loads kd^T as a plain row-major tile.
  Rounding U, Aqk, kd, W, qg and the dot operands S and Vn to bf16 together costs ~2.4e-3 relative RMS on the
  output and on the final state vs fp64 (U, Aqk or Vn alone ~1.6e-3, since U - W S cancels; kd alone ~1.7e-3
  on the state; W, qg and S together ~3e-4).
* otherwise (fp16 and fp32 inputs, or lowp off): everything fp32 and token-major, kd as
  [B, T, HV, K] (fp16's range is too small for the state as a dot operand).
The Aqk / Akk dots take bf16 operands for bf16 inputs and tf32 for fp16 ones (the fast path's factors
reach 2^span, past fp16's range).
Non-finite inputs (causality as in the recurrence): a row is invalid when an element of its k (key head) is not
finite, its activated gate is NaN or +inf (-inf is a full reset, floored), its activated beta is not finite, or an
element of its v is not finite. The gate's invalid elements count as a zero log decay (selection in gam_block);
beta's are zeroed where beta is a factor. k is loaded as it is: below the diagonal, a non-finite k_r makes row r and
column r of Akk non-finite and nothing else (a dot carries a NaN operand element into its own row or column only),
and those entries are selected to 0 after the K loop, which is what a zeroed k_r would give, so every row before the
chunk's first invalid row f comes out as with a finite value there (in Aqk the entries stay at i >= r, rows that
become NaN). This kernel finds no rows (a row reduction here costs the autotuned forward ~10% on the H200, ~240
registers live): the W/U kernel (fwd_wu.py) does, and writes NaN rows of qg, kd and gam from f on (o = NaN from f
on, and a NaN state leaving the chunk). What this kernel passes on is elementwise: kbg is marked -0.0 where k or the
gate is invalid (the gate's validity is marked in gam's lowest mantissa bit by the pre-processing,
common.gam_block; common.mark_invalid), so the W/U kernel feeds kbg into its dot as it is (a mark is a zero)
and finds those rows from the marks, reading neither k nor the gate again; it checks the raw beta itself
(load_beta).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl

from ..options import KDAInputs, KDAOptions
from .common import (BC, BT, L2NORM_EPS, SPAN, SPAN_UNIT, ChunkIndex, absent, autotune_configs, bounded_gate,
                     chunk_bounds, chunk_tile, dot_precision, finite, gam_block, gam_valid, gate_args, gate_floor,
                     gate_scale, kd_chunk, l2norm_factor, length_jit, load_beta, lowp_dot, mark_invalid, pass_tiles,
                     tune_size)


INTRA_KEY = ["K", "USE_L2NORM", "USE_GATE", "PREC", "SAVED_A", "TUNE_SIZE", "BOUNDED", "DIAG", "EXACT"]


@triton.autotune(
    configs=autotune_configs([
        triton.Config({"BK": 32}, num_warps=8, num_stages=1),
        triton.Config({"BK": 64}, num_warps=8, num_stages=1),
        triton.Config({"BK": 32}, num_warps=4, num_stages=1),   # 255 regs: two programs per SM
    ]),
    key=INTRA_KEY,
)
@length_jit
def chunk_kda_fwd_kernel_intra(
    q, k, g, beta, A_log, dt_bias,           # [B,T,H,K] x2, [B,T,HV,K], [B,T,HV], [HV], [HV*K]
    gam, beta_act, Aqk, Tm,                  # out: [B,T,HV,K], [B,T,HV], [B,T,HV,BT] x2 (fp32; bf16 in a bf16
                                             #   forward)
    rq, rk,                                  # out (USE_L2NORM): [B,T,H] fp32 l2norm row factors
    kd, qg, kbg,                             # out: [B,T,HV,K] or (KD_T) [NT_total,HV,K,BT], [B,T,HV,K] x2
                                             #   (bf16 in a bf16 forward, else fp32)
    cu_seqlens, chunk_indices, scale, lower_bound, T, N, H, HV, TUNE_SIZE,
    K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, USE_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    ALLOW_NEG_EIGVAL: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOWP_DOT: tl.constexpr,
    INV_PREC: tl.constexpr, KD_T: tl.constexpr, SAVED_A: tl.constexpr, BOUNDED: tl.constexpr, DIAG: tl.constexpr,
    EXACT: tl.constexpr, G_FLOOR: tl.constexpr,
):
    """One program per (chunk, value head): grid (NT_total, HV). gam, beta, Aqk, Tm, kd, qg and kbg; W and U
    follow from Tm and kbg in chunk_kda_fwd_kernel_wu. SAVED_A (the backward, with the forward's Aqk and Tm
    kept): only gam, beta, the l2norm factors, kd, qg and kbg; Aqk and Tm are not touched."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, i_c, bos, eos = chunk_bounds(i_t, cu_seqlens, chunk_indices, T, N, BT, IS_VARLEN)
    t0 = bos + i_c * BT
    if t0 >= eos:
        return
    Tc = tl.minimum(eos - t0, BT)
    f_scale = tl.cast(scale, tl.float32)
    f_lb = tl.cast(lower_bound, tl.float32)
    if LOWP_DOT:   # operand dtype of the Aqk / Akk dots: bf16 for bf16 inputs, else fp32
        DOT_DT = q.dtype.element_ty
    else:
        DOT_DT = tl.float32

    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    m_t = o_t < Tc
    # row strides of the token-major tensors
    sq = H * K
    sg = HV * K
    sa = HV * BT
    q += t0 * sq + i_h * K
    k += t0 * sq + i_h * K
    gam += t0 * sg + i_hv * K
    Aqk += t0 * sa + i_hv * BT
    Tm += t0 * sa + i_hv * BT
    qg += t0 * sg + i_hv * K
    kbg += t0 * sg + i_hv * K
    kd = kd_chunk(kd, i_t, t0, i_hv, HV, K, BT, KD_T)

    # ---- pre-processing: beta, l2norm row factors, gate + cumsum (gam is stored and re-read below); invalid
    # elements zeroed (see "Non-finite inputs" above)
    b_beta = load_beta(beta, i_hv, t0, Tc, HV, BT, USE_BETA_SIGMOID, ALLOW_NEG_EIGVAL)    # [BT]
    b_beta = tl.where(finite(b_beta), b_beta, 0.0)
    tl.store(beta_act + (t0 + o_t) * HV + i_hv, b_beta, mask=m_t)
    # one pass over the K-blocks: the sums of squares of q and k, and the gate with its cumsum. The raw tiles of
    # block i_k + 1 are loaded while block i_k is worked on: at two programs per SM nothing else hides their
    # latency (past the last block the loads are masked off)
    b_ssq = tl.zeros([BT], dtype=tl.float32)
    b_ssk = tl.zeros([BT], dtype=tl.float32)
    b_a = gate_scale(A_log, i_hv, HAS_A_LOG)
    g_c = g + t0 * sg + i_hv * K
    db_c = dt_bias + i_hv * K
    n_q, n_k, n_g, n_db = pass_tiles(q, k, g_c, db_c, Tc, 0, sq, sg, K, BT, BK, USE_L2NORM, USE_GATE and HAS_DT_BIAS)
    for i_k in range(tl.cdiv(K, BK)):
        b_q, b_k, b_g, b_db = n_q, n_k, n_g, n_db
        n_q, n_k, n_g, n_db = pass_tiles(q, k, g_c, db_c, Tc, i_k + 1, sq, sg, K, BT, BK, USE_L2NORM,
                                         USE_GATE and HAS_DT_BIAS)
        o_k = i_k * BK + tl.arange(0, BK)
        if USE_L2NORM:
            b_q = b_q.to(tl.float32)
            b_k = b_k.to(tl.float32)
            b_ssq += tl.sum(b_q * b_q, axis=1)
            b_ssk += tl.sum(b_k * b_k, axis=1)
        b_gam = gam_block(b_g, b_db, b_a, f_lb, Tc, i_k, K, BT, BK, USE_GATE, HAS_DT_BIAS, HAS_LOWER_BOUND,
                          G_FLOOR)                                                                    # [BT, BK]
        tl.store(gam + o_t[:, None] * sg + o_k[None, :], b_gam, mask=m_t[:, None] & (o_k[None, :] < K))
    if USE_L2NORM:   # kept for the W/U kernel and the backward; the first value head of the group stores them
        b_rq = l2norm_factor(b_ssq, L2NORM_EPS, False)                                        # [BT]
        b_rk = l2norm_factor(b_ssk, L2NORM_EPS, True)                                         # [BT]
        m_r = o_t < tl.where(i_hv % (HV // H) == 0, Tc, 0)
        tl.store(rq + (t0 + o_t) * H + i_h, b_rq, mask=m_r)
        tl.store(rk + (t0 + o_t) * H + i_h, b_rk, mask=m_r)
        # the rows enter the Aqk / Akk dots normalised (|q_i|, |k_i| <= 1), which is what lets the fast path take
        # the wider span (common.SPAN_UNIT)
        span = SPAN_UNIT
    else:
        b_rq = tl.full([BT], 1.0, dtype=tl.float32)
        b_rk = tl.full([BT], 1.0, dtype=tl.float32)
        span = SPAN
    b_bk = b_beta * b_rk                                                                  # [BT] kbg's row factor
    tl.debug_barrier()

    # ---- Aqk and Akk for all rows of the chunk, accumulated over K-blocks (q, k with their l2norm factors)
    m_blk = (o_t[:, None] // BC) == (o_t[None, :] // BC)                    # [BT, BT] same diagonal block
    # q_i . k_j exp2(gam_i - gam_j) (j <= i) and k_i . k_j exp2(gam_i - gam_j) (j < i), every block in the
    # dot layout; entries above the diagonal are masked once after the K loop
    b_aqk = tl.zeros([BT, BT], dtype=tl.float32)
    lvl = tl.full((), 0, tl.int32)      # the fast path's first level to test (the K loop below)
    b_akk = tl.zeros([BT, BT], dtype=tl.float32)
    # q and k of K-block i_k + 1 are loaded while block i_k is worked on, as in the pass (gam is not: here the
    # kernel is at its register limit; two more tiles spill 16 bytes, which measured faster than waiting)
    n_q = chunk_tile(q, Tc, sq, 0, K, BT, BK)
    n_k = chunk_tile(k, Tc, sq, 0, K, BT, BK)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        # [BT, BK]
        b_q = n_q.to(tl.float32)
        b_k = n_k.to(tl.float32)
        n_q = chunk_tile(q, Tc, sq, i_k + 1, K, BT, BK)
        n_k = chunk_tile(k, Tc, sq, i_k + 1, K, BT, BK)
        b_g = chunk_tile(gam, Tc, sg, i_k, K, BT, BK)
        # the state pass's operands, l2norm factors applied: qg = scale q exp2(gam), kd = k exp2(gam_last - gam)
        b_gl = tl.load(gam + (Tc - 1) * sg + o_k, mask=m_k, other=0.0)                       # [BK]
        o_tk = o_t[:, None] * sg + o_k[None, :]
        tl.store(qg + o_tk, (b_q * (f_scale * b_rq)[:, None] * tl.exp2(b_g)).to(qg.dtype.element_ty), mask=m_tk)
        # W's right operand: beta k exp2(gam), marked -0.0 where k or the gate is invalid (the W/U kernel's flags;
        # a NaN or inf k makes the product non-finite)
        b_kbg = b_k * b_bk[:, None] * tl.exp2(b_g)
        b_kbg = mark_invalid(b_kbg, finite(b_kbg) & gam_valid(b_g), kbg.dtype.element_ty)
        tl.store(kbg + o_tk, b_kbg, mask=m_tk)
        b_kd = (b_k * b_rk[:, None] * tl.exp2(tl.minimum(b_gl[None, :] - b_g, 0.0))).to(kd.dtype.element_ty)
        if KD_T:
            # into the [BK, BT] block of kd^T; rows past Tc are zeros (k loaded as 0 there) and stored too:
            # the state pass reads the block without a token mask
            tl.store(kd + o_t[:, None] + o_k[None, :] * BT, b_kd, mask=m_k[None, :])
        else:
            tl.store(kd + o_tk, b_kd, mask=m_tk)
        if not SAVED_A:
            if USE_L2NORM:
                # a non-finite k element stays non-finite (its row factor is 0: 0 * inf and 0 * NaN are NaN)
                b_q = b_q * b_rq[:, None]
                b_k = b_k * b_rk[:, None]
            # Every pair by one factored dot per operand and 16-row block when every |gam_i - c(i)| <= span in this
            # K-block (c(i) = gam_l + span, l the last row of i's block: group_delta): the row factors
            # exp2(gam_i - c) and the column factors exp2(c - gam_j) of the block then stay in [2^-span, 2^span]
            # (common.SPAN, SPAN_UNIT say why nothing overflows and what a flush costs). (DIAG = 32: the 32-row
            # halves of the chunk, which the safe gate bounds; diagonal_rows)
            if BOUNDED:     # the safe gate bounds the span (common.bounded_gate): no test, no exact path
                b_dm = group_delta(b_g, last_rows(gam, o_t, o_k, m_k, sg, Tc, DIAG), o_t, Tc, span)  # [BT, BK]
                b_aqk, b_akk = group_dots(b_aqk, b_akk, b_q, b_k, b_g, b_dm, gam, o_k, m_k, sg, o_t, Tc, span, DIAG,
                                          BT, DOT_DT, PREC)
            else:
                # The tests start from the level the previous K-block took (lvl: 0 the 32-row halves, 1 the 16-row
                # blocks, 2 the exact path; 0 at the first K-block): a test that failed there is not tried again
                # in the chunk (the channels of a head share its decay rate, so the next K-block mostly fails it too).
                # The 32-row halves where both span at most 2 span (2 dots per operand), else the 16-row blocks
                path = lvl
                if path == 0:
                    b_dm = group_delta(b_g, last_rows(gam, o_t, o_k, m_k, sg, Tc, 2 * BC), o_t, Tc, span)
                    if tl.max(tl.max(tl.abs(b_dm), axis=1), axis=0) <= span:
                        b_aqk, b_akk = group_dots(b_aqk, b_akk, b_q, b_k, b_g, b_dm, gam, o_k, m_k, sg, o_t, Tc,
                                                  span, 2 * BC, BT, DOT_DT, PREC)
                    else:
                        path = tl.full((), 1, tl.int32)
                if path == 1:
                    b_dm = group_delta(b_g, last_rows(gam, o_t, o_k, m_k, sg, Tc, BC), o_t, Tc, span)
                    ok = True       # without EXACT the gate's floor bounds every 16-row block (G_FLOOR): no test
                    if EXACT:
                        ok = tl.max(tl.max(tl.abs(b_dm), axis=1), axis=0) <= span
                    if ok:
                        b_aqk, b_akk = group_dots(b_aqk, b_akk, b_q, b_k, b_g, b_dm, gam, o_k, m_k, sg, o_t, Tc,
                                                  span, BC, BT, DOT_DT, PREC)
                    else:
                        path = tl.full((), 2, tl.int32)
                if EXACT:
                    if path == 2:
                        # pairs of different blocks, exact for any decay: levels 32 and 64 of the binary split
                        # (split_level)
                        for up in tl.static_range(1, 3):
                            b_gm = segment_rows(gam, o_t, o_k, m_k, sg, Tc, BC << up, BC << (up - 1))
                            b_aqk, b_akk = split_level(b_aqk, b_akk, b_q, b_k, b_g, b_gm, o_t, BC << up, BT, DOT_DT,
                                                       PREC)
                        # down the split from level 16: each level S, then the same test for the S/2-row halves
                        # of its segments, whose pairs take one dot per operand where it passes (at S = 2 the halves
                        # are single rows, the diagonal i == j, where gam_i - c(i) = span). Every path covers each
                        # pair j <= i once. Level 16 is written out (its masks are constants; this is where most
                        # blocks that fail the 16-row test pass): its halves are referred to their last rows
                        # (group_delta, as the fast path's blocks). The levels below load two rows per segment, its
                        # first row and its middle row (the split's reference and the first row of the second
                        # half), and issue their test before the split's dots (level 16 issues it after them: in the
                        # sm_90 build that spills less)
                        b_gm = segment_rows(gam, o_t, o_k, m_k, sg, Tc, BC, BC // 2)
                        b_dm = group_delta(b_g, last_rows(gam, o_t, o_k, m_k, sg, Tc, BC // 2), o_t, Tc, span)
                        b_aqk, b_akk = split_level(b_aqk, b_akk, b_q, b_k, b_g, b_gm, o_t, BC, BT, DOT_DT, PREC)
                        ok = tl.max(tl.max(tl.abs(b_dm), axis=1), axis=0) <= span
                        if ok:
                            b_aqk, b_akk = diagonal_dots(b_aqk, b_akk, b_q, b_k, b_dm, o_t, BC // 2, DOT_DT,
                                                         PREC)
                        else:
                            go = True
                            for lv in range(3, 0, -1):
                                if go:
                                    b_gm = segment_rows(gam, o_t, o_k, m_k, sg, Tc, 1 << lv, 1 << (lv - 1))
                                    b_gf = tl.where(((o_t % (1 << lv)) >= (1 << (lv - 1)))[:, None], b_gm,
                                                    segment_rows(gam, o_t, o_k, m_k, sg, Tc, 1 << lv, 0))
                                    b_dm = anchor_delta(b_g, b_gf, o_t, Tc, span)
                                    ok = tl.max(tl.max(tl.abs(b_dm), axis=1), axis=0) <= span
                                    b_aqk, b_akk = split_level(b_aqk, b_akk, b_q, b_k, b_g, b_gm, o_t, 1 << lv, BT,
                                                               DOT_DT, PREC)
                                    if ok:
                                        b_aqk, b_akk = diagonal_dots(b_aqk, b_akk, b_q, b_k, b_dm, o_t,
                                                                     1 << (lv - 1), DOT_DT, PREC)
                                        go = False
                lvl = path
    if not SAVED_A:
        b_aqk = tl.where(o_t[None, :] <= o_t[:, None], b_aqk, 0.0)
        # below the diagonal, a non-finite k_r (loaded as it is) makes row r and column r of Akk non-finite, and
        # nothing else: selected to 0, as a zeroed k_r would give (the inverse's dots would carry a NaN to every row
        # of the block, 0 * NaN); in Aqk such entries stay only at i >= r, rows that the W/U kernel turns to NaN
        b_akk = tl.where((o_t[None, :] < o_t[:, None]) & finite(b_akk), b_akk, 0.0)
        # scale, beta: Aqk is stored; L = diag(beta) Akk stays in registers
        b_aqk = b_aqk * f_scale
        b_akk = b_akk * b_beta[:, None]
        p_a = o_t[:, None] * sa + o_t[None, :]              # [BT, BT]
        tl.store(Aqk + p_a, b_aqk.to(Aqk.dtype.element_ty), mask=m_t[:, None])

        # ---- Tm = (I + L)^-1. With Ld the diagonal 16x16 blocks of L, Lo the rest and D = (I + Ld)^-1:
        # I + L = (I + Ld)(I + D Lo) and D Lo is strictly block lower (nilpotent, 4 blocks), so
        # Tm = sum_{p < 4} (-D Lo)^p D, i.e. three steps of X <- D - (D Lo) X from X = D.
        # D: the four diagonal blocks at once, [NB, BC, BC]. Ld is strictly lower in each block (Ld^16 = 0), so
        # D = (I - Ld)(I + Ld^2)(I + Ld^4)(I + Ld^8): six batched [NB, BC, BC] dots, three of them in sequence,
        # in place of 15 steps of forward substitution, each with two cross-warp reductions. The dots run as
        # tf32x3 (three tf32 products: about fp32 accuracy) for 16-bit inputs, IEEE fp32 for fp32 inputs.
        # The blocks are taken out of L and put back into a [BT, BT] tile in registers (L's rows past Tc are zero:
        # beta is zero there).
        o_b = tl.arange(0, BT // BC)
        m_b4 = (o_b[:, None, None, None] == o_b[None, None, :, None])          # [NB, 1, NB, 1] same block
        b_ld = tl.sum(tl.where(m_b4, tl.reshape(b_akk, [BT // BC, BC, BT // BC, BC]), 0.0), axis=2)  # [NB, BC, BC]
        b_d = tl.where(o_c[None, :, None] == o_c[None, None, :], 1.0, 0.0) - b_ld    # [NB, BC, BC] I - Ld
        b_n = b_ld
        for _ in range(3):
            b_n = tl.dot(b_n, b_n, input_precision=INV_PREC)                # Ld^2, Ld^4, Ld^8
            b_d += tl.dot(b_d, b_n, input_precision=INV_PREC)
        b_dd = tl.reshape(tl.where(m_b4, b_d[:, :, None, :], 0.0), [BT, BT])    # [BT, BT] D, block diagonal
        # [BT, BT] @ [BT, BT] -> [BT, BT]
        b_m = tl.dot(b_dd, tl.where(m_blk, 0.0, b_akk), input_precision=PREC)
        b_tm = b_dd
        for _ in range(BT // BC - 1):
            b_tm = b_dd - tl.dot(b_m, b_tm, input_precision=PREC)
        tl.store(Tm + p_a, b_tm.to(Tm.dtype.element_ty), mask=m_t[:, None])


# The backward's rerun (SAVED_A) of the same kernel, with configs of its own: without Aqk, L and the inverse the
# build needs 152 registers a thread at BK 64 / 8 warps and 167 at BK 32 / 4 warps (sm_90, K = 128;
# `python benchmarks/compile_sm90.py intra`), so a cap of 128 adds programs per SM where it does not spill
# (BK 64 / 8 warps, BK 16 / 4 warps: two and four programs per SM); the forward's build needs 255.
chunk_kda_fwd_kernel_intra_rerun = triton.autotune(
    configs=autotune_configs([
        triton.Config({"BK": 32}, num_warps=4, num_stages=1),
        triton.Config({"BK": 64}, num_warps=8, num_stages=1, maxnreg=128),
        triton.Config({"BK": 16}, num_warps=4, num_stages=1, maxnreg=128),
    ]),
    key=INTRA_KEY,
)(chunk_kda_fwd_kernel_intra.fn)


@triton.jit
def segment_rows(gam, o_t, o_k, m_k, sg, Tc, R, OFF):
    """[BT, BK] the K-block's gam at row (i // R) * R + OFF of each row i's R-row segment, 0 where that row is past
    Tc - 1 or past K."""
    o_r = (o_t // R) * R + OFF
    return tl.load(gam + o_r[:, None] * sg + o_k[None, :], mask=(o_r < Tc)[:, None] & m_k[None, :], other=0.0)


@triton.jit
def anchor_delta(b_g, b_gf, o_t, Tc, span):
    """[BT, BK] gam_i - c(i), c(i) = gam_f - span, f the first row of i's block (b_gf, segment_rows with OFF 0);
    0 on rows past Tc. gam does not increase along the chunk, so |gam_i - c(i)| <= span for every row of a block
    exactly when the block spans at most 2 span (gam_f - gam_last), the same condition as around the midpoint of
    its first and last rows, from one row instead of two; and any increase of gam from f on fails it (b_g: the
    K-block's gam rows)."""
    return tl.where((o_t < Tc)[:, None], b_g - b_gf + span, 0.0)


@triton.jit
def last_rows(gam, o_t, o_k, m_k, sg, Tc, R):
    """[BT, BK] the K-block's gam at the last row of each row i's R-row group, or at row Tc - 1 where the group
    ends past it; 0 past K."""
    o_r = tl.minimum((o_t // R) * R + R - 1, Tc - 1)
    return tl.load(gam + o_r[:, None] * sg + o_k[None, :], mask=m_k[None, :], other=0.0)


@triton.jit
def group_delta(b_g, b_gl, o_t, Tc, span):
    """[BT, BK] gam_i - c(i), c(i) = gam_l + span, l the last row of i's group (b_gl, last_rows); 0 on rows past
    Tc. gam does not increase along the chunk, so |gam_i - c(i)| <= span for every row of a group exactly when
    the group spans at most 2 span (gam_f - gam_l, f its first row), the same condition as around the midpoint of
    its first and last rows, from one row instead of two; and any increase of gam towards l fails it."""
    return tl.where((o_t < Tc)[:, None], b_g - b_gl - span, 0.0)


@triton.jit
def group_dots(b_aqk, b_akk, b_q, b_k, b_g, b_dm, gam, o_k, m_k, sg, o_t, Tc, span, R: tl.constexpr,
               BT: tl.constexpr, DOT_DT: tl.constexpr, PREC: tl.constexpr):
    """Every pair j <= i of the chunk, one dot per operand for each R-row group of rows i (in place, no mask),
    where every group spans at most 2 span: (x_i exp2(gam_i - c)) . (k_j exp2(c - gam_j)) for the rows i of the
    group and the columns j up to its last row l, around c = gam_l + span (b_dm = gam_i - c(i), group_delta).
    Within the group every exponent is then in [-span, span], so nothing overflows or flushes. The row factors are
    at most 2^(gam_f - gam_l - span) (f the group's first row); a column before the group whose factor flushes to
    zero drops a term below 2^(gam_f - gam_l - span - 126) |x_i| |k_j|: none of any size where the group spans at
    most span, at most 2^(span - 126) |x_i| |k_j| otherwise (the fast path's bound, common.SPAN_UNIT). Columns
    past the group are clamped to 2^span and make entries above the diagonal only, which the caller discards after
    the K loop. gam: the chunk's first row of gam, row stride sg. Returns b_aqk, b_akk."""
    b_e = tl.exp2(b_dm)                                                 # [BT, BK] exp2(gam_i - c(i))
    b_qe = (b_q * b_e).to(DOT_DT)
    b_ke = (b_k * b_e).to(DOT_DT)
    for grp in tl.static_range(BT // R):
        # [BK] c (a group past the chunk's end has zero rows: any row's value will do)
        b_c = tl.load(gam + tl.minimum(grp * R + R - 1, Tc - 1) * sg + o_k, mask=m_k, other=0.0) + span
        m_r = ((o_t // R) == grp)[:, None]                              # [BT, 1] the group's rows
        # [BK, BT] k_j exp2(c - gam_j)
        b_kc = tl.trans((b_k * tl.exp2(tl.minimum(b_c[None, :] - b_g, span))).to(DOT_DT))
        # [BT, BK] @ [BK, BT] -> [BT, BT]
        b_aqk = tl.dot(tl.where(m_r, b_qe, 0.0).to(DOT_DT), b_kc, b_aqk, input_precision=PREC)
        b_akk = tl.dot(tl.where(m_r, b_ke, 0.0).to(DOT_DT), b_kc, b_akk, input_precision=PREC)
    return b_aqk, b_akk


@triton.jit
def diagonal_dots(b_aqk, b_akk, b_q, b_k, b_dm, o_t, R, DOT_DT: tl.constexpr, PREC: tl.constexpr):
    """The pairs inside the diagonal R-row blocks in one dot per operand, factored around each block's reference c:
    (x_i exp2(gam_i - c)) . (k_j exp2(c - gam_j)), b_dm = gam_i - c(i) (anchor_delta) within the span.
    Entries outside the blocks are discarded here (their factors' product may overflow), those above the diagonal
    by the caller after the K loop. Returns b_aqk, b_akk with the K-block's sums added."""
    m_blk = (o_t[:, None] // R) == (o_t[None, :] // R)                  # [BT, BT] same diagonal block
    b_e = tl.exp2(b_dm)                                                 # [BT, BK] exp2(gam_i - c(i))
    b_kc = tl.trans((b_k * tl.exp2(-b_dm)).to(DOT_DT))                  # [BK, BT]
    # [BT, BK] @ [BK, BT] -> [BT, BT]
    b_aqk += tl.where(m_blk, tl.dot((b_q * b_e).to(DOT_DT), b_kc, input_precision=PREC), 0.0)
    b_akk += tl.where(m_blk, tl.dot((b_k * b_e).to(DOT_DT), b_kc, input_precision=PREC), 0.0)
    return b_aqk, b_akk


@triton.jit
def split_level(b_aqk, b_akk, b_q, b_k, b_g, b_gr, o_t, S, BT: tl.constexpr, DOT_DT: tl.constexpr,
                PREC: tl.constexpr):
    """One level of the binary split of a chunk's pairs j < i: in each S-row segment, the rows i of its second
    half against the columns j of its first half, factored around the segment's middle row R (j < R <= i):
    exp2(gam_i - gam_j) = exp2(gam_i - gam_R) exp2(gam_R - gam_j), both factors <= 1 whatever the decay (gam
    does not increase: g <= 0 is the op's contract; written exp2(-|gam - gam_R|), so on this path a net
    increase of gam, from g > 0, would be taken as the same decrease). b_q, b_k, b_g: the K-block's [BT, BK]
    rows (zero past Tc); b_gr: gam at the middle row of each row's segment (segment_rows). Returns b_aqk and b_akk
    with the sums (q_i e_i) . (k_j e_j) and (k_i e_i) . (k_j e_j)
    over the K-block added at those pairs only (at S = BT the dots make no others and accumulate in place). A
    factor that flushes to zero stands for a true product below 2^-126."""
    b_e = tl.exp2(-tl.abs(b_g - b_gr))                              # [BT, BK]
    m_hi = ((o_t % S) >= S // 2)[:, None]                          # [BT, 1] rows in the second half
    b_kc = tl.trans(tl.where(m_hi, 0.0, b_k * b_e).to(DOT_DT))    # [BK, BT] columns of the first half
    b_e = tl.where(m_hi, b_e, 0.0)
    # [BT, BK] @ [BK, BT] -> [BT, BT]
    if S == BT:   # one segment: the dots make no other pairs
        b_aqk = tl.dot((b_q * b_e).to(DOT_DT), b_kc, b_aqk, input_precision=PREC)
        b_akk = tl.dot((b_k * b_e).to(DOT_DT), b_kc, b_akk, input_precision=PREC)
    else:
        m_seg = (o_t // S)[:, None] == (o_t // S)[None, :]          # [BT, BT] same segment
        b_aqk += tl.where(m_seg, tl.dot((b_q * b_e).to(DOT_DT), b_kc, input_precision=PREC), 0.0)
        b_akk += tl.where(m_seg, tl.dot((b_k * b_e).to(DOT_DT), b_kc, input_precision=PREC), 0.0)
    return b_aqk, b_akk


def diagonal_rows(opts: KDAOptions) -> int:
    """The rows of the blocks that the forward intra kernel's safe-gate build (BOUNDED) takes by one factored dot
    per operand each (group_dots): the chunk's 32-row halves (2 BC) when the in-op safe gate and the in-op l2norm
    bound every half within 2 SPAN_UNIT whatever the inputs (each step's log decay in [lower_bound, 0], 2 BC - 1
    steps from its first row to its last: lower_bound >= -224 / (31 log2(e)) = -5.0085), else its 16-row blocks
    (BC). With halves a K-block takes 4 dots instead of 8. From the options alone (the other builds test the
    halves on the data, then the 16-row blocks unless the gate's floor bounds them: EXACT)."""
    return 2 * BC if opts.use_qk_l2norm and bounded_gate(opts, SPAN_UNIT, (2 * BC - 1) / 2) else BC


class IntraOut(NamedTuple):
    """What :func:`chunk_kda_fwd_intra` stores (token-major like the inputs unless said; BT = 64).

    Always fp32: gam [B,T,HV,K] log2 units; beta [B,T,HV] activated.
    In ``wdt`` (bf16 when built with lowp from bf16 inputs, else fp32): Tm [B,T,HV,BT] (I + L)^-1;
    Aqk [B,T,HV,BT] (row i of a chunk at its token, column j = position in the chunk, scale included, zero
    for j > i); qg [B,T,HV,K] = scale q exp2(gam) (q, k l2-normalised when use_qk_l2norm).
    kd = k exp2(gam_last - gam), in the layout kd_t says:
    * kd_t False: [B,T,HV,K] fp32, token-major (lowp off, or fp16 / fp32 inputs);
    * kd_t True: [NT_total,HV,K,BT] bf16 (lowp with bf16 inputs): kd^T, one [K, BT] block per (chunk, value
      head), chunk c of sequence n at n * cdiv(T, BT) + c, or chunk_offsets[n] + c for varlen (the layout of the
      per-chunk states); columns past a sequence's end are zeros.
    rq, rk [B,T,H] fp32: the l2norm row factors 1 / sqrt(|x|^2 + eps) of q and k (use_qk_l2norm; else None).
    """
    gam: torch.Tensor
    beta: torch.Tensor
    Aqk: torch.Tensor
    Tm: torch.Tensor
    kd: torch.Tensor
    kd_t: bool
    qg: torch.Tensor
    rq: Optional[torch.Tensor]
    rk: Optional[torch.Tensor]


def chunk_kda_fwd_intra(x: KDAInputs, opts: KDAOptions, idx: ChunkIndex, lowp: bool = False,
                        saved: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                        ) -> Tuple[IntraOut, torch.Tensor]:
    """Pre-processing + intra-chunk stage (one launch). Uses x.q, x.k [B,T,H,K]; x.v [B,T,HV,V] (shape and dtype);
    x.g [B,T,HV,K]; x.beta [B,T,HV]; x.A_log [HV] / x.dt_bias [HV*K] (with opts.use_gate) or None; all
    contiguous. idx: the call's chunk index.
    lowp: when v is bf16, store Tm, kbg, qg, Aqk in bf16 and kd transposed per chunk in bf16 (kd_t: what the
    forward's state pass reads; the backward's recompute uses it too); fp32 and token-major otherwise.
    saved: (Aqk, Tm) of a forward with the same inputs and lowp (the backward): taken as they are, and the
    kernel skips Aqk, L and the inverse (the bulk of its work); the rest is computed as always.
    Returns (IntraOut, kbg): kbg [B,T,HV,K] = beta k exp2(gam) in Tm's dtype, W's right operand (fwd_wu.py),
    transient.

    >>> out, kbg = chunk_kda_fwd_intra(x, opts, chunk_index(B, T, None))
    """
    q, k, v = x.q, x.k, x.v
    B, T, H, K = q.shape
    HV = v.shape[-2]
    dev = q.device
    f32 = torch.float32
    kd_t = lowp and v.dtype == torch.bfloat16     # fp16: S could overflow as a dot operand
    wdt = v.dtype if kd_t else f32
    if saved is not None:
        for name, t in zip(("Aqk", "Tm"), saved):
            if t.shape != (B, T, HV, BT) or t.dtype != wdt or not t.is_contiguous():
                raise ValueError(f"saved {name}: expected a contiguous {wdt} tensor of shape {(B, T, HV, BT)}, "
                                 f"got {t.dtype} {tuple(t.shape)}")
    Aqk, Tm = saved if saved is not None else (torch.empty(B, T, HV, BT, dtype=wdt, device=dev) for _ in range(2))
    out = IntraOut(
        gam=torch.empty(B, T, HV, K, dtype=f32, device=dev),
        beta=torch.empty(B, T, HV, dtype=f32, device=dev),
        Aqk=Aqk,
        Tm=Tm,
        kd=(torch.empty(idx.NT_total, HV, K, BT, dtype=wdt, device=dev) if kd_t
            else torch.empty(B, T, HV, K, dtype=f32, device=dev)),
        kd_t=kd_t,
        qg=torch.empty(B, T, HV, K, dtype=wdt, device=dev),
        rq=torch.empty(B, T, H, dtype=f32, device=dev) if opts.use_qk_l2norm else None,
        rk=torch.empty(B, T, H, dtype=f32, device=dev) if opts.use_qk_l2norm else None,
    )
    # transient: W's right operand beta k exp2(gam)
    kbg = torch.empty(B, T, HV, K, dtype=wdt, device=dev)
    gate = gate_args(x, opts)
    floor = gate_floor(opts, v.dtype)
    kernel = chunk_kda_fwd_kernel_intra if saved is None else chunk_kda_fwd_kernel_intra_rerun
    wrap_triton(kernel)[(idx.NT_total, HV)](
        q, k, x.g, x.beta, absent(gate.A_log, q), absent(gate.dt_bias, q),
        out.gam, out.beta, out.Aqk, out.Tm, absent(out.rq, q), absent(out.rk, q),
        out.kd, out.qg, kbg,
        absent(idx.cu_seqlens, q), absent(idx.chunk_indices, q),
        float(opts.scale), gate.lower_bound, T, idx.N,
        H, HV, tune_size(B * T, HV), K=K, BT=BT, BC=BC, **gate.flags, USE_L2NORM=opts.use_qk_l2norm,
        IS_VARLEN=idx.is_varlen, PREC=dot_precision(v.dtype),
        # bf16 operands only: the fast path's factors reach 2^SPAN, past fp16's range (fp16 inputs: tf32)
        LOWP_DOT=lowp_dot(v.dtype) and v.dtype == torch.bfloat16,
        INV_PREC="ieee" if v.dtype == torch.float32 else "tf32x3", KD_T=kd_t, SAVED_A=saved is not None,
        BOUNDED=bounded_gate(opts, SPAN), DIAG=diagonal_rows(opts), G_FLOOR=floor,
        # the floor keeps every 16-row block within twice the span: no exact path (common.G_MIN_16BIT)
        EXACT=not bounded_gate(opts, SPAN_UNIT if opts.use_qk_l2norm else SPAN, (BC - 1) / 2, floor),
    )
    return out, kbg
