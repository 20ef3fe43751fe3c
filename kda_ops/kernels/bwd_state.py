"""Backward stage 1 (after the recompute): the reverse state pass over chunks.

With ``dS`` the gradient of the state *leaving* chunk c (``dht`` for the last chunk), per chunk in reverse
(qg = scale q exp2(gam), kd = k exp2(gam_last - gam), W, Aqk from the forward's intra stage):

    dVn   = Aqk^T dO + kd dS                                                    # [BT, BV]
    dS   <- qg^T dO + Diag(exp2(gam_last)) dS - W^T dVn                          # [K, BV]

so after the first chunk ``dS`` is d initial_state. One program per (V-block, sequence, value head) holds
the whole fp32 accumulator, transposed as ``[BV, K]`` (K padded to a power of two, <= 256), and walks its
sequence's chunks backwards. It stores dS leaving every chunk (read by bwd_inter.py, [K, V] per chunk) and dVn.

Holding dS^T makes the pass transposes of the same products,

    dVn^T = dO^T Aqk + dS^T kd^T          dS^T <- dS^T Diag(exp2(gam_last)) + dO^T qg - dVn^T W

where every tile read from memory (Aqk, kd^T, qg, W) is the second dot operand in the layout it is stored in, so
the compiler pipelines its loads through shared memory; the first operands are register tiles (dS^T, dVn^T, and
dO^T, the one tile transposed per chunk).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl

from .common import (BT, ChunkIndex, absent, autotune_configs, dot_precision, length_jit, lowp_dot, seq_bounds,
                     state_strides, tune_lanes)


@triton.autotune(
    configs=autotune_configs([
        # the first config (the only one under the interpreter / KDA_OPS_AUTOTUNE=0) fits K = 256 in shared
        # memory (127 KB with 16-bit operands, 80 KB with fp32 ones; benchmarks/compile_sm90.py state_bwd); configs
        # over the H200's 227 KB are skipped by the autotuner
        triton.Config({"BV": 32}, num_warps=8, num_stages=1),
        triton.Config({"BV": 16}, num_warps=8, num_stages=1),
        # the autotuner's choice at (B, T, HV, K) = (4, 4096, 32, 128), 0.404 ms (128 lanes, two programs each)
        triton.Config({"BV": 64}, num_warps=8, num_stages=2),
        # the autotuner's choice at (1, 8192, 32, 128), 0.318 ms (benchmarks/kernel_times.py --mode fwdbwd)
        triton.Config({"BV": 32}, num_warps=4, num_stages=2),
        triton.Config({"BV": 64}, num_warps=8, num_stages=1),
        triton.Config({"BV": 32}, num_warps=8, num_stages=3),
        triton.Config({"BV": 32}, num_warps=8, num_stages=2),
        triton.Config({"BV": 64}, num_warps=8, num_stages=3),
    ]),
    key=["K", "V", "PREC", "KD_T", "TUNE_SIZE"],
)
@length_jit
def chunk_kda_bwd_kernel_state(
    qg, kd, W, gam, Aqk, do,                 # [B,T,HV,K], [B,T,HV,K] or (KD_T) [NT_total,HV,K,BT], [B,T,HV,K],
                                             #   [B,T,HV,K] fp32, [B,T,HV,BT], [B,T,HV,V]
    dht, s_dhn, s_dhh, s_dhk, s_dhv,         # [N,HV,K,V], any strides (given in elements)
    dh, dvn, dh0,                            # out: [NT_total,HV,K,V], [B,T,HV,V], [N,HV,K,V] fp32
    cu_seqlens, chunk_offsets, T, HV, TUNE_SIZE,
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr, LOWP_DOT: tl.constexpr, KD_T: tl.constexpr,
):
    """Grid (cdiv(V, BV), N * HV)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    if IS_VARLEN:
        bos, eos = seq_bounds(cu_seqlens, i_n, T)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
        eos = bos + T
        boh = (i_n * tl.cdiv(T, BT)).to(tl.int64)
    NT = tl.cdiv(eos - bos, BT)
    if LOWP_DOT:
        DOT_DT = do.dtype.element_ty
    else:
        DOT_DT = tl.float32

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_vk = m_v[:, None] & m_k[None, :]
    sg = HV * K
    sv = HV * V
    sa = HV * BT
    # the state's [BV, BK] block of a [K, V] row-major state
    p_vk = o_v[:, None] + o_k[None, :] * V

    # [BV, BK] fp32: dS^T, the transposed gradient of the state leaving the current chunk (module docstring)
    b_dh = tl.zeros([BV, BK], dtype=tl.float32)
    if USE_DHT:
        p_dht = dht + i_n.to(tl.int64) * s_dhn + i_hv.to(tl.int64) * s_dhh
        b_dh += tl.load(p_dht + o_v[:, None] * s_dhv + o_k[None, :] * s_dhk, mask=m_vk, other=0.0)
    for i_c in range(NT - 1, -1, -1):
        t0 = bos + i_c * BT
        m_t = (t0 + o_t) < eos
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        tl.store(dh + ((boh + i_c) * HV + i_hv) * K * V + p_vk, b_dh.to(dh.dtype.element_ty), mask=m_vk)
        b_dhd = b_dh.to(DOT_DT)
        # 64-bit chunk bases, 32-bit offsets inside the chunk
        off_k = t0 * sg + i_hv * K
        off_v = t0 * sv + i_hv * V
        p_tk = o_t[:, None] * sg + o_k[None, :]
        p_tv = o_t[:, None] * sv + o_v[None, :]
        # [BT, BK]
        b_qg = tl.load(qg + off_k + p_tk, mask=m_tk, other=0.0).to(DOT_DT)
        b_w = tl.load(W + off_k + p_tk, mask=m_tk, other=0.0).to(DOT_DT)
        # [BK, BT]
        if KD_T:
            # the chunk's [BK, BT] block of kd^T, row-major (zeros past the sequence's end)
            p_kt = ((boh + i_c) * HV + i_hv) * (K * BT) + o_k[:, None] * BT + o_t[None, :]
            b_kdt = tl.load(kd + p_kt, mask=m_k[:, None], other=0.0).to(DOT_DT)
        else:
            b_kdt = tl.trans(tl.load(kd + off_k + p_tk, mask=m_tk, other=0.0).to(tl.float32)).to(DOT_DT)
        # [BT(i), BT(j)] (zero for j > i)
        b_a = tl.load(Aqk + (t0 * sa + i_hv * BT) + (o_t[:, None] * sa + o_t[None, :]), mask=m_t[:, None],
                      other=0.0).to(DOT_DT)
        # [BV, BT]: dO^T, transposed in fp32 registers (a 16-bit tile loaded and transposed straight into a dot
        # becomes an MN-major shared-memory wgmma operand, the pattern that faulted with triton 3.6 on the H200:
        # fwd_state.py)
        b_dot = tl.trans(tl.load(do + off_v + p_tv, mask=m_tv, other=0.0).to(tl.float32)).to(DOT_DT)
        # [BK] gam of the chunk's last valid row
        t_last = tl.minimum(t0 + BT, eos) - 1
        b_gl = tl.load(gam + (t_last * sg + i_hv * K) + o_k, mask=m_k, other=0.0)

        # dVn^T = dO^T Aqk + dS^T kd^T                                              [BV, BT]
        b_dvn = tl.dot(b_dot, b_a, input_precision=PREC)
        b_dvn += tl.dot(b_dhd, b_kdt, input_precision=PREC)
        tl.store(dvn + off_v + tl.trans(p_tv), b_dvn.to(dvn.dtype.element_ty), mask=tl.trans(m_tv))
        # dS^T <- dS^T Diag(exp2(gam_last)) + dO^T qg - dVn^T W                    [BV, BK]
        b_dh = b_dh * tl.exp2(b_gl)[None, :]
        b_dh += tl.dot(b_dot, b_qg, input_precision=PREC)
        b_dh -= tl.dot(b_dvn.to(DOT_DT), b_w, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * HV + i_hv) * K * V + p_vk, b_dh, mask=m_vk)


def chunk_kda_bwd_state(
    qg: torch.Tensor, kd: torch.Tensor, kd_t: bool, W: torch.Tensor, gam: torch.Tensor, Aqk: torch.Tensor,
    do: torch.Tensor, dht: Optional[torch.Tensor], need_dh0: bool, idx: ChunkIndex,
):
    """Reverse state pass.

    qg, W [B, T, HV, K] and kd (the forward intra stage's, any float dtype; kd_t: kd is kd^T per chunk
    [NT_total, HV, K, 64], else [B, T, HV, K]); gam [B, T, HV, K] fp32 (log2 units);
    Aqk [B, T, HV, 64] (scale included, zero above the diagonal); do [B, T, HV, V];
    dht [N, HV, K, V] (any strides) or None.
    Returns (dh [NT_total, HV, K, V]: gradient of the state leaving each chunk, laid out like the forward's
    per-chunk states; dvn [B, T, HV, V] (both in do.dtype for 16-bit inputs, else fp32);
    dh0 [N, HV, K, V] fp32 or None).

    >>> dh, dvn, dh0 = chunk_kda_bwd_state(intra.qg, intra.kd, intra.kd_t, W, intra.gam, intra.Aqk, do, None,
    ...                                    True, idx)
    """
    B, T, HV, K = W.shape
    V = do.shape[-1]
    # with 16-bit inputs bwd_inter.py feeds dh and dvn to bf16/fp16 dots: storing them in that dtype loses nothing
    # there and halves their memory (the fp32 accumulator stays in registers)
    dt = do.dtype if lowp_dot(do.dtype) else torch.float32
    dh = torch.empty(idx.NT_total, HV, K, V, dtype=dt, device=do.device)
    dvn = torch.empty(B, T, HV, V, dtype=dt, device=do.device)
    dh0 = torch.empty(idx.N, HV, K, V, dtype=torch.float32, device=do.device) if need_dh0 else None
    pick = lambda t: absent(t, gam)  # noqa: E731

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), idx.N * HV)

    wrap_triton(chunk_kda_bwd_kernel_state)[grid](
        qg, kd, W, gam, Aqk, do, pick(dht), *state_strides(dht), dh, dvn, pick(dh0),
        pick(idx.cu_seqlens), pick(idx.chunk_offsets), T, HV, tune_lanes(idx.N, HV),
        K=K, V=V, BT=BT, BK=max(16, triton.next_power_of_2(K)),
        USE_DHT=dht is not None, STORE_DH0=need_dh0, IS_VARLEN=idx.is_varlen, KD_T=kd_t,
        PREC=dot_precision(do.dtype), LOWP_DOT=lowp_dot(do.dtype),
    )
    return dh, dvn, dh0
