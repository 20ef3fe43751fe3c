"""The decode step: KDA token by token from a given state, in one launch (the CUDA path of
``kda_ops::recurrent_kda_v1``).

One program per (V-block, sequence, value head) holds the state tile S [BK, BV] (BK = K padded to a
power of two, so every program sees whole key rows) as one fp32 accumulator and walks the few tokens
of its sequence. Per token, with the in-op pre-processing fused:

    q, k <- l2norm(q, k)                        (USE_L2NORM; q, k of q/k head i_hv // G: grouped values)
    g    <- gate(g + dt_bias, A_log)            (USE_GATE; softplus or safe sigmoid gate)
    beta <- sigmoid(beta) (x2)                  (USE_BETA_SIGMOID, ALLOW_NEG_EIGVAL)
    S    <- diag(exp(g)) S
    S    <- S + beta k (v - S^T k)^T
    o    <- scale S^T q                         (read the updated state)

The state is functional: read from initial_state, written to a new final_state. The l2 norms and the
gate are recomputed by each V-block program (a few hundred flops on data it loads anyway), which is
cheaper than a second launch at decode sizes. Grid sizes come from shapes only: no host sync.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl

from ..options import KDAInputs, KDAOptions
from .common import (L2NORM_EPS, absent, gate_scale, length_jit, sanitize_cu_seqlens, seq_bounds, softplus,
                     state_strides)

# The launch config, fixed: on the H200, BV = 16 with one warp is the fastest or within 2% of eight (BV, warps)
# configs at every decode shape measured (`python benchmarks/bench_decode.py --sweep`). Without an autotuner (and
# without heuristics) an eager decode call goes through one launch wrapper, and the first call benchmarks nothing.
DECODE_BV = 16
DECODE_WARPS = 1

@length_jit
def recurrent_kda_fwd_kernel(
    q, k, v, g, beta,                        # [B, T, H, K] x2, [B, T, HV, V], [B, T, HV, K], [B, T, HV]
    A_log, dt_bias,                          # [HV], [HV * K] fp32 (dummies when absent)
    h0, s_h0n, s_h0h, s_h0k, s_h0v,          # [N, HV, K, V] fp32, any strides (given in elements)
    o, ht,                                   # out: [B, T, HV, V] (v dtype), [N, HV, K, V] fp32
    cu_seqlens,                              # [N + 1] (dummy when absent)
    scale, lower_bound, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_A_LOG: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    HAS_LOWER_BOUND: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """Grid (cdiv(V, BV), N * HV)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos, eos = seq_bounds(cu_seqlens, i_n, T)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    # Inductor may pass Python floats as fp64: cast once, keep the loop in fp32
    scale = tl.cast(scale, tl.float32)
    lower_bound = tl.cast(lower_bound, tl.float32)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    if USE_GATE:
        b_a = gate_scale(A_log, i_hv, HAS_A_LOG)
        if HAS_DT_BIAS:
            # [BK]
            b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        else:
            b_bias = tl.zeros([BK], dtype=tl.float32)

    # [BK, BV]
    p_h0 = h0 + i_n.to(tl.int64) * s_h0n + i_hv.to(tl.int64) * s_h0h
    b_h = tl.load(p_h0 + o_k[:, None] * s_h0k + o_v[None, :] * s_h0v, mask=m_kv, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        # [BK], [BK], [BV], [BK], scalar
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + (t * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + L2NORM_EPS)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + L2NORM_EPS)
        if USE_GATE:
            b_x = b_g + b_bias
            if HAS_LOWER_BOUND:
                b_g = lower_bound * tl.sigmoid(b_a * b_x)
            else:
                b_g = -b_a * softplus(b_x)
        if USE_BETA_SIGMOID:
            b_beta = tl.sigmoid(b_beta)
            if ALLOW_NEG_EIGVAL:
                b_beta = 2.0 * b_beta
        # S' = diag(exp(g)) S: [BK, 1] * [BK, BV]
        b_h = b_h * tl.exp(b_g)[:, None]
        # v - S'^T k: sum_k [BK, 1] * [BK, BV] -> [BV]
        b_vn = b_v - tl.sum(b_k[:, None] * b_h, axis=0)
        # S = S' + beta k vn^T: [BK, 1] * [1, BV] -> [BK, BV]
        b_h = b_h + (b_beta * b_k)[:, None] * b_vn[None, :]
        # o = scale S^T q: sum_k [BK, 1] * [BK, BV] -> [BV]
        b_o = tl.sum((b_q * scale)[:, None] * b_h, axis=0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(ht + i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :], b_h, mask=m_kv)


def recurrent_kda_triton(x: KDAInputs, opts: KDAOptions) -> Tuple[torch.Tensor, torch.Tensor]:
    """KDA decode step (any small T) on the GPU; same semantics as the recurrence (kda_ops.naive_recurrent_kda).

    x: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (raw gate with opts.use_gate); beta [B, T, HV]
    (logits with opts.use_beta_sigmoid), all contiguous; A_log [HV] fp32 or None; dt_bias [HV * K] fp32 or None;
    initial_state [N, HV, K, V] fp32 (required; any strides); cu_seqlens [N + 1] with B == 1, or None.
    Returns (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] fp32); initial_state is not modified.

    >>> o, ht = recurrent_kda_triton(x, opts)
    """
    q, k, v, h0, cu_seqlens = x.q, x.k, x.v, x.initial_state, x.cu_seqlens
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is None:
        o = torch.empty_like(v)
    else:
        # clamped to [0, T] and non-decreasing on the device (no sync): any values stay inside the tensors;
        # tokens no sequence covers get o = 0
        cu_seqlens = sanitize_cu_seqlens(cu_seqlens, T)
        o = torch.zeros_like(v)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    use_gate = opts.use_gate
    A_log = x.A_log if use_gate else None
    dt_bias = x.dt_bias if use_gate else None
    lower_bound = opts.lower_bound

    BV = min(DECODE_BV, triton.next_power_of_2(V))
    wrap_triton(recurrent_kda_fwd_kernel)[(triton.cdiv(V, BV), N * HV)](
        q, k, v, x.g, x.beta, absent(A_log, q), absent(dt_bias, q),
        h0, *state_strides(h0), o, ht, absent(cu_seqlens, q),
        float(opts.scale), 0.0 if lower_bound is None else float(lower_bound), T,
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        USE_L2NORM=opts.use_qk_l2norm, USE_GATE=use_gate, HAS_A_LOG=A_log is not None,
        HAS_DT_BIAS=dt_bias is not None, HAS_LOWER_BOUND=lower_bound is not None,
        USE_BETA_SIGMOID=opts.use_beta_sigmoid, ALLOW_NEG_EIGVAL=opts.allow_neg_eigval,
        IS_VARLEN=cu_seqlens is not None, num_warps=DECODE_WARPS, num_stages=1,
    )
    return o, ht
