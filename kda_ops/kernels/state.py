"""Stage 3 of the forward: the sequential pass over chunks, fused with the chunk output.

One program per (V-block, sequence, value head) holds the state S [K, BV] (K padded to a power of two)
as ONE fp32 accumulator and walks the sequence's chunks in order. Per chunk (all from intra.py):

    Vn = U - W S                                     # [BT, BV]  new values
    O  = qg S + Aqk Vn                               # [BT, BV]  output (scale folded into qg and Aqk)
    S  = diag(exp2(gam_last)) S + kd^T Vn            # state leaving the chunk

Operands. In the forward (intra built with lowp, bf16 inputs) W and qg arrive in bf16 and their dots
take S rounded to that dtype (W, qg and S together: ~3e-4 of relative error on the output); U, Aqk and kd
stay fp32 (rounding U or Aqk costs ~1.6e-3 each since U - W S cancels, kd ~1.7e-3 on the state; numbers
from benchmarks/precision_bf16.py), so Aqk Vn and kd^T Vn run in tf32. (A bf16 kd^T operand, loaded
transposed, faulted in shared memory at K = 100 and 128 with triton 3.6 on the H200.) The backward's
recompute passes fp32 W, qg too and every dot runs in tf32 (IEEE fp32 for fp32 inputs). The smaller W and
qg let two pipeline stages fit in shared memory at K = 128: the loads of chunk c + 1 overlap the dots of
chunk c.
Fusing the output here means the per-chunk states never go through device memory in the plain
forward; a backward that needs them asks for them (STORE_H) together with Vn (STORE_VN).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .common import BT, INTERPRET, absent, autotune_configs, chunk_layout, dot_precision
from .intra import IntraOut


@triton.autotune(
    configs=autotune_configs([
        # one pipeline stage first (it fits at every K); two stages fit at K = 128 (188 KB with bf16 W, qg
        # at BV = 32); configs that do not fit are skipped. (BV = 16 with 8 warps gave wrong results with
        # triton 3.6 on the H200 (tests/test_gpu_configs.py) and faulted at large shapes: not listed.)
        triton.Config({"BV": 32}, num_warps=8, num_stages=1),
        triton.Config({"BV": 32}, num_warps=4, num_stages=2),
        triton.Config({"BV": 32}, num_warps=8, num_stages=2),
        triton.Config({"BV": 16}, num_warps=4, num_stages=2),
        triton.Config({"BV": 64}, num_warps=8, num_stages=2),
        triton.Config({"BV": 64}, num_warps=8, num_stages=1),
    ]),
    key=["K", "V", "STORE_O", "STORE_H", "PREC"],
)
@triton.jit
def chunk_kda_fwd_kernel_state(
    W, U, kd, qg, Aqk, gam,                  # from intra: [B,T,HV,K], [B,T,HV,V] fp32, [B,T,HV,K] x2,
                                             #   [B,T,HV,BT] fp32, [B,T,HV,K] fp32 (W, qg: bf16 in a bf16 forward)
    h0,                                      # [N, HV, K, V] fp32
    o, h, vn, ht,                            # out: [B,T,HV,V], [NT_total, HV, K, V], [B,T,HV,V], [N, HV, K, V] fp32
    cu_seqlens, chunk_offsets, T, HV,
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_O: tl.constexpr, STORE_H: tl.constexpr, STORE_VN: tl.constexpr,
    STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (cdiv(V, BV), N * HV). UPCAST (interpreter, whose 16-bit dots are wrong): operands rounded to
    W's dtype are multiplied in fp32."""
    if UPCAST:
        DOT_DT = tl.float32
    else:
        DOT_DT = W.dtype.element_ty      # bf16 (a bf16 forward) or fp32 (fp16 / fp32 inputs, the recompute)
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = (i_nh // HV).to(tl.int64), i_nh % HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
        eos = bos + T
        boh = (i_n * tl.cdiv(T, BT)).to(tl.int64)
    T_n = (eos - bos).to(tl.int32)
    NT = tl.cdiv(T_n, BT)
    # per-sequence bases of the token-major tensors
    W += (bos * HV + i_hv) * K
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
    o_kt = o_k[:, None] + o_t[None, :] * (HV * K)            # [BK, BT] (kd read transposed)
    o_tv = o_t[:, None] * (HV * V) + o_v[None, :]            # [BT, BV]
    o_tt = o_t[:, None] * (HV * BT) + o_t[None, :]           # [BT, BT]

    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_s += tl.load(h0 + (i_n * HV + i_hv) * K * V + p_kv, mask=m_kv, other=0.0)
    for i_c in range(NT):
        m_t = (i_c * BT + o_t) < T_n
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        t_c = (bos - bos) + i_c * BT                         # int64 chunk offsets in the token-major tensors
        c_k = t_c * (HV * K)
        c_v = t_c * (HV * V)
        if STORE_H:
            tl.store(h + ((boh + i_c) * HV + i_hv) * K * V + p_kv, b_s.to(h.dtype.element_ty), mask=m_kv)
        b_sd = b_s.to(W.dtype.element_ty).to(DOT_DT)          # [BK, BV] the state as a dot operand
        # [BT, BK] @ [BK, BV] -> [BT, BV]
        b_w = tl.load(W + c_k + o_tk, mask=m_tk, other=0.0).to(DOT_DT)
        b_vn = tl.load(U + c_v + o_tv, mask=m_tv, other=0.0) - tl.dot(b_w, b_sd, input_precision=PREC)
        if STORE_VN:
            tl.store(vn + (bos * HV + i_hv) * V + c_v + o_tv, b_vn.to(vn.dtype.element_ty), mask=m_tv)
        if STORE_O:
            # [BT, BK] @ [BK, BV] + [BT, BT] @ [BT, BV] -> [BT, BV]
            b_qg = tl.load(qg + c_k + o_tk, mask=m_tk, other=0.0).to(DOT_DT)
            b_a = tl.load(Aqk + t_c * (HV * BT) + o_tt, mask=m_t[:, None], other=0.0)
            b_o = tl.dot(b_qg, b_sd, input_precision=PREC)
            b_o += tl.dot(b_a, b_vn, input_precision=PREC)
            tl.store(o + (bos * HV + i_hv) * V + c_v + o_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
        # [BK, BT] kd^T; [BK] gam of the chunk's last valid row
        b_kdt = tl.load(kd + c_k + o_kt, mask=tl.trans(m_tk), other=0.0)
        t_last = (bos - bos) + tl.minimum((i_c + 1) * BT, T_n) - 1     # int64
        b_gl = tl.load(gam + t_last * (HV * K) + o_k, mask=m_k, other=0.0)
        # [BK, BT] @ [BT, BV] -> [BK, BV]
        b_s = b_s * tl.exp2(b_gl)[:, None] + tl.dot(b_kdt, b_vn, input_precision=PREC)
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
    intra: IntraOut, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
    output_final_state: bool, dtype: torch.dtype,
    store_o: bool = True, store_h: bool = False, store_vn: bool = False,
) -> StateOut:
    """State pass (+ output) from :func:`kda_ops.kernels.intra.chunk_kda_fwd_intra`'s outputs.

    initial_state [N, HV, K, V] fp32 or None; cu_seqlens [N + 1] or None; dtype: the dtype of v (o, h, vn).
    """
    B, T, HV, K = intra.W.shape
    V = intra.U.shape[-1]
    layout = chunk_layout(B, T, cu_seqlens)
    dev, dt = intra.W.device, dtype
    o = torch.empty(B, T, HV, V, dtype=dt, device=dev) if store_o else None
    h = torch.empty(layout.NT_total, HV, K, V, dtype=dt, device=dev) if store_h else None
    vn = torch.empty(B, T, HV, V, dtype=dt, device=dev) if store_vn else None
    ht = torch.empty(layout.N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    pick = lambda x: absent(x, intra.gam)  # noqa: E731

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), layout.N * HV)

    torch.library.wrap_triton(chunk_kda_fwd_kernel_state)[grid](
        intra.W, intra.U, intra.kd, intra.qg, intra.Aqk, intra.gam, pick(initial_state),
        pick(o), pick(h), pick(vn), pick(ht),
        pick(cu_seqlens), pick(layout.chunk_offsets), T, HV,
        K=K, V=V, BT=BT, BK=max(16, triton.next_power_of_2(K)),
        USE_H0=initial_state is not None, STORE_O=store_o, STORE_H=store_h, STORE_VN=store_vn,
        STORE_HT=output_final_state, IS_VARLEN=cu_seqlens is not None, UPCAST=INTERPRET,
        PREC=dot_precision(dt),
    )
    return StateOut(o, h, vn, ht)
