"""Forward stage 3: the sequential pass over chunks, fused with the chunk output.

One program per (V-block, sequence, value head) holds the state S [K, BV] (K padded to a power of two)
as ONE fp32 accumulator and walks the sequence's chunks in order. Per chunk (all from fwd_intra.py / fwd_wu.py):

    Vn = U - W S                                     # [BT, BV]  new values
    O  = qg S + Aqk Vn                               # [BT, BV]  output (scale folded into qg and Aqk)
    S  = diag(exp2(gam_last)) S + kd^T Vn            # state leaving the chunk

Operands, two modes (see fwd_intra.IntraOut):
* the forward with bf16 inputs (the intra stage built with lowp): W, qg, U, Aqk arrive in bf16 and kd as kd^T blocks
  [K, BT] per chunk in bf16 (KD_T), loaded as a plain row-major [BK, BT] tile. All four dots are bf16 dots:
  W S and qg S take S rounded to bf16, Aqk Vn and kd^T Vn take Vn rounded to bf16; S and Vn accumulate in
  fp32. Rounding all of these costs ~2.4e-3 relative RMS on o and on the final state vs fp64
  (the GPU tests' bound for bf16 is 5e-3). kd^T is stored transposed because a bf16 tile loaded through a
  transposed pointer pattern faulted in shared memory at K = 100 and 128 with triton 3.6 on the H200.
* otherwise (fp16 / fp32 inputs; the backward's recompute of a bf16 op takes the bf16 mode): every operand
  fp32 and token-major, kd^T read through a transposed pointer pattern, every dot in tf32 (IEEE fp32 for fp32
  inputs).
Fusing the output here means the per-chunk states never go through device memory in the plain
forward; a backward that needs them asks for them (STORE_H) together with Vn (STORE_VN).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl

from .common import (BT, ChunkIndex, INTERPRET, absent, autotune_configs, dot_precision, length_jit, seq_bounds,
                     state_strides, tune_lanes)


@triton.autotune(
    configs=autotune_configs([
        # one pipeline stage first (it fits at every K); two stages fit up to K = 128 (bf16 forward at BV = 32:
        # 128 KB; fp32 operands: 160 KB) and at K = 256 only with BV = 16 in the bf16 forward (220 KB; sm_90
        # allows 227 KB); three stages at K = 128 in the bf16 forward (BV 16 / 32 / 64: 178 / 188 / 208 KB);
        # configs that do not fit are skipped (benchmarks/compile_sm90.py prints the shared memory per config).
        # The pass waits on its loads (one program per SM and V-block walks the chunks): a third stage won at both
        # shapes measured, at (1, 8192, 32, 128) BV 32 / 4 warps / 3 stages takes 0.223 ms against
        # 0.308 with two, at (4, 4096, 32, 128) BV 64 / 8 warps / 3 stages 0.367 against 0.458
        # (benchmarks/tune_sweep.py). At 128 lanes (sequences x value heads), BV 128 / 8 warps / 2 stages (180 KB,
        # one program per SM) runs them in one wave where BV 64 needs two: 0.327 ms at (4, 4096, 32, 128), and
        # 0.269 against 0.304 for the backward's recompute (no output; h and Vn stored).
        # (BV = 16 with 8 warps gave wrong results with triton 3.6 on the H200 (tests/test_gpu_configs.py) and
        # faulted at large shapes: not listed.)
        triton.Config({"BV": 32}, num_warps=8, num_stages=1),
        triton.Config({"BV": 32}, num_warps=4, num_stages=2),
        triton.Config({"BV": 32}, num_warps=8, num_stages=2),
        triton.Config({"BV": 16}, num_warps=4, num_stages=2),
        triton.Config({"BV": 64}, num_warps=8, num_stages=2),
        triton.Config({"BV": 64}, num_warps=8, num_stages=1),
        triton.Config({"BV": 32}, num_warps=4, num_stages=3),
        triton.Config({"BV": 16}, num_warps=4, num_stages=3),
        triton.Config({"BV": 64}, num_warps=8, num_stages=3),
        triton.Config({"BV": 128}, num_warps=8, num_stages=2),
    ]),
    key=["K", "V", "STORE_O", "STORE_H", "PREC", "KD_T", "TUNE_SIZE"],
)
@length_jit
def chunk_kda_fwd_kernel_state(
    W, U, kd, qg, Aqk, gam,                  # from intra: [B,T,HV,K], [B,T,HV,V], [B,T,HV,K] or (KD_T)
                                             #   [NT_total,HV,K,BT], [B,T,HV,K], [B,T,HV,BT], [B,T,HV,K] fp32
                                             #   (all but gam bf16 in a bf16 forward, else fp32)
    h0, s_h0n, s_h0h, s_h0k, s_h0v,          # [N, HV, K, V] fp32, any strides (given in elements)
    o, h, vn, ht,                            # out: [B,T,HV,V], [NT_total, HV, K, V], [B,T,HV,V], [N, HV, K, V] fp32
    cu_seqlens, chunk_offsets, T, HV, TUNE_SIZE,
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_O: tl.constexpr, STORE_H: tl.constexpr, STORE_VN: tl.constexpr,
    STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    KD_T: tl.constexpr,
):
    """Grid (cdiv(V, BV), N * HV). KD_T: kd holds kd^T blocks [K, BT] per chunk (zeros past a sequence's end).
    UPCAST (interpreter, whose 16-bit dots are wrong): operands rounded to their storage dtype (bf16 or
    fp32) are multiplied in fp32."""
    # operand dtypes: S goes into the dots in W's dtype (W S, qg S), Vn in Aqk's (Aqk Vn, kd^T Vn): bf16 in a
    # bf16 forward and its recompute, fp32 otherwise (fp16 / fp32 inputs)
    S_DT = W.dtype.element_ty
    VN_DT = Aqk.dtype.element_ty
    if UPCAST:
        DOT_DT = tl.float32
        DOT_DT2 = tl.float32
    else:
        DOT_DT = S_DT
        DOT_DT2 = VN_DT
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = (i_nh // HV).to(tl.int64), i_nh % HV
    if IS_VARLEN:
        bos, eos = seq_bounds(cu_seqlens, i_n, T)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
        eos = bos + T
        boh = (i_n * tl.cdiv(T, BT)).to(tl.int64)
    T_n = (eos - bos).to(tl.int32)
    NT = tl.cdiv(T_n, BT)
    # per-sequence bases of the token-major tensors
    W += (bos * HV + i_hv) * K
    if KD_T:
        kd += (boh * HV + i_hv) * (K * BT)
    else:
        kd += (bos * HV + i_hv) * K
    qg += (bos * HV + i_hv) * K
    gam += (bos * HV + i_hv) * K
    U += (bos * HV + i_hv) * V
    Aqk += (bos * HV + i_hv) * BT

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]                   # [BK, BV] offsets inside one [K, V] state
    # loop-invariant int32 tile offsets; the chunk moves the scalar base pointers
    o_tk = o_t[:, None] * (HV * K) + o_k[None, :]            # [BT, BK]
    if KD_T:
        o_kt = o_k[:, None] * BT + o_t[None, :]              # [BK, BT] row-major in the chunk's kd^T block
    else:
        o_kt = o_k[:, None] + o_t[None, :] * (HV * K)        # [BK, BT] (token-major kd read transposed)
    o_tv = o_t[:, None] * (HV * V) + o_v[None, :]            # [BT, BV]
    o_tt = o_t[:, None] * (HV * BT) + o_t[None, :]           # [BT, BT]

    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0 = h0 + i_n * s_h0n + i_hv.to(tl.int64) * s_h0h
        b_s += tl.load(p_h0 + o_k[:, None] * s_h0k + o_v[None, :] * s_h0v, mask=m_kv, other=0.0)
    for i_c in range(NT):
        m_t = (i_c * BT + o_t) < T_n
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        t_c = (bos - bos) + i_c * BT                         # int64 chunk offsets in the token-major tensors
        c_k = t_c * (HV * K)
        c_v = t_c * (HV * V)
        if STORE_H:
            tl.store(h + ((boh + i_c) * HV + i_hv) * K * V + p_kv, b_s.to(h.dtype.element_ty), mask=m_kv)
        b_sd = b_s.to(S_DT).to(DOT_DT)                       # [BK, BV] the state as a dot operand
        # [BT, BK] @ [BK, BV] -> [BT, BV]
        b_w = tl.load(W + c_k + o_tk, mask=m_tk, other=0.0).to(DOT_DT)
        b_u = tl.load(U + c_v + o_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, b_sd, input_precision=PREC)
        if STORE_VN:
            tl.store(vn + (bos * HV + i_hv) * V + c_v + o_tv, b_vn.to(vn.dtype.element_ty), mask=m_tv)
        b_vnd = b_vn.to(VN_DT).to(DOT_DT2)                   # [BT, BV] Vn as a dot operand
        if STORE_O:
            # [BT, BK] @ [BK, BV] + [BT, BT] @ [BT, BV] -> [BT, BV]
            b_qg = tl.load(qg + c_k + o_tk, mask=m_tk, other=0.0).to(DOT_DT)
            b_a = tl.load(Aqk + t_c * (HV * BT) + o_tt, mask=m_t[:, None], other=0.0).to(DOT_DT2)
            b_o = tl.dot(b_qg, b_sd, input_precision=PREC)
            b_o += tl.dot(b_a, b_vnd, input_precision=PREC)
            tl.store(o + (bos * HV + i_hv) * V + c_v + o_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
        # [BK, BT] kd^T; [BK] gam of the chunk's last valid row
        if KD_T:
            c_kt = ((bos - bos) + i_c) * (HV * K * BT)       # int64 offset of the chunk's block
            b_kdt = tl.load(kd + c_kt + o_kt, mask=m_k[:, None], other=0.0).to(DOT_DT2)
        else:
            b_kdt = tl.load(kd + c_k + o_kt, mask=tl.trans(m_tk), other=0.0).to(DOT_DT2)
        t_last = (bos - bos) + tl.minimum((i_c + 1) * BT, T_n) - 1     # int64
        b_gl = tl.load(gam + t_last * (HV * K) + o_k, mask=m_k, other=0.0)
        # [BK, BT] @ [BT, BV] -> [BK, BV]
        b_s = b_s * tl.exp2(b_gl)[:, None] + tl.dot(b_kdt, b_vnd, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + (i_n * HV + i_hv) * K * V + p_kv, b_s, mask=m_kv)


class StateOut(NamedTuple):
    """o [B,T,HV,V] (v.dtype) or None; h [NT_total,HV,K,V] (v.dtype, state ENTERING each chunk; chunk c of
    sequence n at n * cdiv(T, 64) + c, or chunk_offsets[n] + c for varlen) or None; vn [B,T,HV,V] (v.dtype)
    or None; final state [N,HV,K,V] fp32 or None."""
    o: Optional[torch.Tensor]
    h: Optional[torch.Tensor]
    vn: Optional[torch.Tensor]
    final_state: Optional[torch.Tensor]


def chunk_kda_fwd_state(
    W: torch.Tensor, U: torch.Tensor, kd: torch.Tensor, kd_t: bool, qg: torch.Tensor, Aqk: torch.Tensor,
    gam: torch.Tensor, initial_state: Optional[torch.Tensor], idx: ChunkIndex, output_final_state: bool,
    dtype: torch.dtype, store_o: bool = True, store_h: bool = False, store_vn: bool = False,
) -> StateOut:
    """State pass (+ output) from the intra stage's outputs (fwd_intra.IntraOut: kd in the layout kd_t says, qg,
    Aqk, gam) and fwd_wu's W, U. initial_state [N, HV, K, V] fp32 (any strides) or None; dtype: the dtype of v
    (o, h, vn).
    """
    B, T, HV, K = W.shape
    V = U.shape[-1]
    dev, dt = W.device, dtype
    o = torch.empty(B, T, HV, V, dtype=dt, device=dev) if store_o else None
    h = torch.empty(idx.NT_total, HV, K, V, dtype=dt, device=dev) if store_h else None
    vn = torch.empty(B, T, HV, V, dtype=dt, device=dev) if store_vn else None
    ht = torch.empty(idx.N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    pick = lambda t: absent(t, gam)  # noqa: E731

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), idx.N * HV)

    wrap_triton(chunk_kda_fwd_kernel_state)[grid](
        W, U, kd, qg, Aqk, gam, pick(initial_state), *state_strides(initial_state),
        pick(o), pick(h), pick(vn), pick(ht),
        pick(idx.cu_seqlens), pick(idx.chunk_offsets), T, HV, tune_lanes(idx.N, HV),
        K=K, V=V, BT=BT, BK=max(16, triton.next_power_of_2(K)),
        USE_H0=initial_state is not None, STORE_O=store_o, STORE_H=store_h, STORE_VN=store_vn,
        STORE_HT=output_final_state, IS_VARLEN=idx.is_varlen, UPCAST=INTERPRET,
        PREC=dot_precision(dt), KD_T=kd_t,
    )
    return StateOut(o, h, vn, ht)
