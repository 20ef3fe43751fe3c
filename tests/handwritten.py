"""KDA written out again for the tests, from the formulas of the public docstrings only, importing nothing
from kda_ops: the in-op pre-processing and the token-by-token recurrence, in float64 and differentiable by
autograd. A bug in kda_ops.reference (preprocess, naive_recurrent_kda) cannot pass a comparison with this
by being shared.

    q, k <- q / sqrt(sum(q^2) + 1e-6), k / sqrt(sum(k^2) + 1e-6)            (use_qk_l2norm)
    g <- -exp(A_log) * softplus(g + dt_bias)                                 (use_gate, no lower_bound)
    g <- lower_bound * sigmoid(exp(A_log) * (g + dt_bias))                   (use_gate, lower_bound)
    beta <- sigmoid(beta), or 2 * sigmoid(beta) with allow_neg_eigval        (use_beta_sigmoid)

    per token t and value head h (q/k head h // (HV // H)):
        S <- diag(exp(g_t)) S                        S: [K, V]
        S <- S + beta_t k_t (v_t - S^T k_t)^T
        o_t = scale * S^T q_t
"""
from __future__ import annotations

import math

import torch

EPS = 1e-6


def hw_l2norm(x):
    return x / torch.sqrt(torch.sum(x ** 2, dim=-1, keepdim=True) + EPS)


def hw_gate(g, A_log, dt_bias, lower_bound):
    """g [..., HV, K] raw -> log decay."""
    HV, K = g.shape[-2], g.shape[-1]
    x = g if dt_bias is None else g + dt_bias.double().reshape(HV, K)
    a = 1.0 if A_log is None else torch.exp(A_log.double()).reshape(HV, 1)
    if lower_bound is None:
        return -a * torch.log1p(torch.exp(x))            # softplus; |x| stays far below exp overflow here
    return lower_bound / (1.0 + torch.exp(-(a * x)))


def hw_beta(beta, allow_neg_eigval):
    s = 1.0 / (1.0 + torch.exp(-beta))
    return 2.0 * s if allow_neg_eigval else s


def hw_sequence(q, k, v, g, beta, scale, h0):
    """One sequence, already pre-processed. q, k [T, H, K]; v [T, HV, V]; g [T, HV, K]; beta [T, HV];
    h0 [HV, K, V]. Returns (o [T, HV, V], S [HV, K, V])."""
    T, H = q.shape[0], q.shape[1]
    HV = v.shape[1]
    head = [h * H // HV for h in range(HV)]               # q/k head of each value head
    S = [h0[h] for h in range(HV)]
    rows = []
    for t in range(T):
        row = []
        for h in range(HV):
            kt, qt = k[t, head[h]], q[t, head[h]]
            Sh = torch.exp(g[t, h])[:, None] * S[h]
            Sh = Sh + beta[t, h] * torch.outer(kt, v[t, h] - kt @ Sh)
            S[h] = Sh
            row.append(scale * (qt @ Sh))
        rows.append(torch.stack(row))
    o = torch.stack(rows) if rows else v.new_zeros(0, HV, v.shape[2])
    return o, torch.stack(S)


def hw_kda(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm_in_kernel=False,
           use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
           lower_bound=None, cu_seqlens=None, A_log=None, dt_bias=None, output_final_state=True):
    """The whole op in float64: (o [B, T, HV, V], final state [N, HV, K, V])."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = hw_l2norm(q), hw_l2norm(k)
    if use_gate_in_kernel:
        g = hw_gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = hw_beta(beta, allow_neg_eigval)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(c) for c in cu_seqlens]
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    outs = [[] for _ in range(B)]
    finals = []
    for n, (b, lo, hi) in enumerate(spans):
        h0 = q.new_zeros(HV, K, V) if initial_state is None else initial_state[n].double()
        o, S = hw_sequence(q[b, lo:hi], k[b, lo:hi], v[b, lo:hi], g[b, lo:hi], beta[b, lo:hi], scale, h0)
        outs[b].append(o)
        finals.append(S)
    o = torch.stack([torch.cat(parts) for parts in outs])
    return o, torch.stack(finals)
