"""Forward stage 2: W and U of each chunk from the intra stage's Tm (fwd_intra.py).

    W = Tm (beta k exp2(gam))        [BT, K]
    U = Tm diag(beta) v              [BT, V]

A kernel of its own: it needs far fewer registers than the Aqk / inverse kernel, so more programs share an SM.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl

from ..options import KDAInputs, KDAOptions
from .common import (ChunkIndex, absent, autotune_configs, chunk_bounds, dot_precision, finite, first_row, kd_chunk,
                     length_jit, load_beta, lowp_dot, poison_rows, rows_marked, rows_nonfinite, tune_size)
from .fwd_intra import IntraOut


@triton.autotune(
    configs=autotune_configs([
        triton.Config({"BK": 32}, num_warps=4, num_stages=1),
        triton.Config({"BK": 32}, num_warps=4, num_stages=2),
        triton.Config({"BK": 64}, num_warps=4, num_stages=2),
        triton.Config({"BK": 64}, num_warps=8, num_stages=2),
        triton.Config({"BK": 32}, num_warps=8, num_stages=1),
        triton.Config({"BK": 32}, num_warps=8, num_stages=2),
    ]),
    key=["K", "V", "PREC", "TUNE_SIZE"],
)
@length_jit
def chunk_kda_fwd_kernel_wu(
    v, beta_act, Tm, kbg,                    # [B,T,HV,V]; fp32 [B,T,HV]; [B,T,HV,BT], [B,T,HV,K]
    W, U,                                    # out: [B,T,HV,K], [B,T,HV,V] (Tm, kbg, W, U bf16 in a bf16 forward,
                                             #   else fp32)
    qg, kd, gam,                             # the intra stage's, written only for a chunk with an invalid row
                                             #   (NaN rows): [B,T,HV,K], [B,T,HV,K] or (KD_T) [NT_total,HV,K,BT],
                                             #   [B,T,HV,K] fp32
    beta,                                    # the op's input, read for its check only: [B,T,HV]
    cu_seqlens, chunk_indices, T, N, HV, TUNE_SIZE,
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOWP_DOT: tl.constexpr, KD_T: tl.constexpr,
):
    """W = Tm kbg and U = Tm diag(beta) v of one (chunk, value head), from chunk_kda_fwd_kernel_intra's Tm and
    kbg: grid (NT_total, HV). A kernel of its own (FLA's recompute_w_u is one too): it needs far fewer
    registers than the Aqk / inverse kernel, so more programs share an SM. In a bf16 forward both are bf16
    dots (relative RMS error of o vs fp64: 2.38e-3 -> 2.90e-3).
    Non-finite inputs (fwd_intra.py's note): the intra kernel marked kbg -0.0 where k or the gate is invalid, so
    kbg goes into the dot as it is (a mark is a zero) and its marked rows are invalid; so are the rows of a
    non-finite beta (checked from the input: load_beta) and of v with a NaN or inf, which are zeroed whole
    (nothing an invalid row holds is used). From the chunk's first invalid row on, this kernel writes NaN rows
    into qg, kd and gam (common.poison_rows)."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, i_c, bos, eos = chunk_bounds(i_t, cu_seqlens, chunk_indices, T, N, BT, IS_VARLEN)
    t0 = bos + i_c * BT
    if t0 >= eos:
        return
    Tc = tl.minimum(eos - t0, BT)
    if LOWP_DOT:
        DOT_DT = W.dtype.element_ty
    else:
        DOT_DT = tl.float32
    o_t = tl.arange(0, BT)
    m_t = o_t < Tc
    sg = HV * K
    sv = HV * V
    sa = HV * BT
    v += t0 * sv + i_hv * V
    kbg += t0 * sg + i_hv * K
    W += t0 * sg + i_hv * K
    U += t0 * sv + i_hv * V
    Tm += t0 * sa + i_hv * BT
    qg += t0 * sg + i_hv * K
    gam += t0 * sg + i_hv * K
    kd = kd_chunk(kd, i_t, t0, i_hv, HV, K, BT, KD_T)
    b_beta = tl.load(beta_act + (t0 + o_t) * HV + i_hv, mask=m_t, other=0.0)                # [BT]
    # [BT, BT]
    b_tm = tl.load(Tm + o_t[:, None] * sa + o_t[None, :], mask=m_t[:, None], other=0.0).to(DOT_DT)
    # [BT] invalid rows
    bad = ~finite(load_beta(beta, i_hv, t0, Tc, HV, BT, USE_BETA_SIGMOID, ALLOW_NEG_EIGVAL))
    # W over K-blocks and U over V-blocks of the same width BK. With a V-block width of its own (16 at V = 16),
    # U came out wrong on the H200 with 4 warps (triton 3.6; tests/test_gpu_configs.py, the K = 32, V = 16 case)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_tk = o_t[:, None] * sg + o_k[None, :]
        b_kbg = tl.load(kbg + p_tk, mask=m_tk, other=0.0)                                     # [BT, BK]
        # [BT, BT] @ [BT, BK] -> [BT, BK]
        b_w = tl.dot(b_tm, b_kbg.to(DOT_DT), input_precision=PREC)
        tl.store(W + p_tk, b_w.to(W.dtype.element_ty), mask=m_tk)
        bad = bad | rows_marked(b_kbg)
    for i_v in range(tl.cdiv(V, BK)):
        o_v = i_v * BK + tl.arange(0, BK)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        # [BT, BK]
        b_v = tl.load(v + o_t[:, None] * sv + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        bad_v = rows_nonfinite(b_v)
        bad = bad | bad_v
        b_v = tl.where(bad_v[:, None], 0.0, b_v)
        # [BT, BT] @ [BT, BK] -> [BT, BK]
        b_u = tl.dot(b_tm, (b_v * b_beta[:, None]).to(DOT_DT), input_precision=PREC)
        tl.store(U + o_t[:, None] * sv + o_v[None, :], b_u.to(U.dtype.element_ty), mask=m_tv)
    f_bad = first_row(bad, BT)
    if f_bad < Tc:   # rare
        poison_rows(qg, kd, gam, f_bad, Tc, HV, K, BT, BK, KD_T)


def chunk_kda_fwd_wu(x: KDAInputs, opts: KDAOptions, intra: IntraOut, kbg: torch.Tensor,
                     idx: ChunkIndex) -> Tuple[torch.Tensor, torch.Tensor]:
    """W [B,T,HV,K] and U [B,T,HV,V] in kbg's dtype (bf16 dots when that is bf16) from the intra stage's
    activated beta [B,T,HV] fp32, Tm [B,T,HV,64] and kbg [B,T,HV,K] (chunk_kda_fwd_intra's) and x.v [B,T,HV,V].
    x.beta is read for its check: writes NaN rows into intra.qg, intra.kd and intra.gam from a chunk's first
    invalid row on."""
    v = x.v
    B, T, HV, V = v.shape
    K = kbg.shape[-1]
    Tm = intra.Tm
    W = torch.empty(B, T, HV, K, dtype=kbg.dtype, device=v.device)
    U = torch.empty(B, T, HV, V, dtype=kbg.dtype, device=v.device)
    wrap_triton(chunk_kda_fwd_kernel_wu)[(idx.NT_total, HV)](
        v, intra.beta, Tm, kbg, W, U, intra.qg, intra.kd, intra.gam, x.beta,
        absent(idx.cu_seqlens, v), absent(idx.chunk_indices, v), T, idx.N, HV,
        tune_size(B * T, HV), K=K, V=V, BT=Tm.shape[-1],
        USE_BETA_SIGMOID=opts.use_beta_sigmoid, ALLOW_NEG_EIGVAL=opts.allow_neg_eigval,
        IS_VARLEN=idx.is_varlen, PREC=dot_precision(v.dtype),
        LOWP_DOT=kbg.dtype == torch.bfloat16 and lowp_dot(v.dtype), KD_T=intra.kd_t,
    )
    return W, U
