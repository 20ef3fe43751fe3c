"""KDA in plain torch: the definition (naive recurrence) and the chunked implementation.

Two things live here and nothing else:

* :func:`naive_recurrent_kda` -- the token-by-token recurrence of docs/algorithm.md. It *is* the
  definition; every other implementation is tested against it (usually in float64).
* :func:`chunk_kda_fwd_torch` / :func:`chunk_kda_bwd_torch` -- the chunked form (chunks of 64
  tokens, vectorised over batch, heads and chunks; sequential only over chunks in the state pass)
  with a hand-derived backward. This is the CPU implementation of the ``kda_ops`` ops and the
  blueprint the Triton backward follows.

This module imports only kda_ops.options (the argument bundles). Shapes use the letters of docs/algorithm.md:
``B`` batch, ``T`` tokens, ``H`` q/k heads, ``HV`` value heads (``G = HV // H``), ``K``/``V`` head dims,
``N`` sequences, ``C`` chunk size, ``NT`` chunks per sequence.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .options import KDAInputs, KDAOptions

# eps inside the l2 norm: x / sqrt(sum(x^2) + eps). Kernels use the same constant.
L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------------------------
# Pre-processing done inside the op (optional): l2norm of q/k, the KDA gate, the beta sigmoid.
# Each forward has its hand-written backward next to it.
# ----------------------------------------------------------------------------------------------
def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2norm_bwd(x: Tensor, dy: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    # y = x r, r = (|x|^2 + eps)^-1/2  =>  dx = r (dy - y <y, dy>)
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))


def _gate_parts(g_raw: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor]):
    """Returns (a, x): a = exp(A_log) broadcast as [HV, 1] (or None), x = g_raw + dt_bias."""
    HV, K = g_raw.shape[-2], g_raw.shape[-1]
    x = g_raw if dt_bias is None else g_raw + dt_bias.view(HV, K).to(g_raw.dtype)
    a = None if A_log is None else A_log.to(g_raw.dtype).exp().view(HV, 1)
    return a, x


def kda_gate(g_raw: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
             lower_bound: Optional[float]) -> Tensor:
    """Log decay from the raw gate. g_raw: [..., HV, K]; A_log: [HV]; dt_bias: [HV * K].

    lower_bound None: g = -exp(A_log) * softplus(g_raw + dt_bias)
    lower_bound set:  g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))   (A_log None -> 1)
    """
    a, x = _gate_parts(g_raw, A_log, dt_bias)
    if lower_bound is None:
        return -a * torch.nn.functional.softplus(x)
    return lower_bound * torch.sigmoid(x if a is None else a * x)


def _times(d: Tensor, y: Tensor) -> Tensor:
    """d * y with a zero gradient d winning over an infinite y (a raw gate of +-inf has y = inf there)."""
    return torch.where(d == 0, torch.zeros((), dtype=d.dtype), d * y)


def kda_gate_bwd(g_raw: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
                 lower_bound: Optional[float], dg: Tensor):
    """Returns (dg_raw, dA_log or None, ddt_bias or None) for :func:`kda_gate`."""
    a, x = _gate_parts(g_raw, A_log, dt_bias)
    reduce_dims = tuple(range(dg.dim() - 2))
    if lower_bound is None:
        # g = -a softplus(x): dg/dx = -a sigmoid(x), dg/dA_log = g
        dx = -a * torch.sigmoid(x) * dg
        dA_log = _times(dg, -a * torch.nn.functional.softplus(x)).sum(reduce_dims).sum(-1)
    else:
        ax = x if a is None else a * x
        s = torch.sigmoid(ax)
        dax = dg * lower_bound * s * (1 - s)
        dx = dax if a is None else dax * a
        dA_log = None if a is None else _times(dax, ax).sum(reduce_dims).sum(-1)
    ddt_bias = None if dt_bias is None else dx.sum(reduce_dims).reshape(-1)
    return dx, dA_log, ddt_bias


def beta_activation(beta: Tensor, allow_neg_eigval: bool) -> Tensor:
    s = torch.sigmoid(beta)
    return 2 * s if allow_neg_eigval else s


def beta_activation_bwd(beta: Tensor, allow_neg_eigval: bool, dout: Tensor) -> Tensor:
    s = torch.sigmoid(beta)
    return dout * s * (1 - s) * (2 if allow_neg_eigval else 1)


def preprocess(q, k, g, beta, A_log=None, dt_bias=None, lower_bound=None,
               use_qk_l2norm=False, use_gate=False, use_beta_sigmoid=False,
               allow_neg_eigval=False):
    """Applies the optional in-op pre-processing; returns (q, k, g, beta) as the recurrence uses them."""
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if use_gate:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid:
        beta = beta_activation(beta, allow_neg_eigval)
    return q, k, g, beta


def check_cu_seqlens(cu_seqlens: Tensor, T: int) -> None:
    """Raises ValueError unless cu_seqlens starts at 0, never decreases and ends at T. Reads the values
    on the host: the CPU path calls it always, the CUDA path only when asked (it synchronises)."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {cu[0]}")
    for n in range(1, len(cu)):
        if cu[n] < cu[n - 1]:
            raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{n}] = {cu[n]} < "
                             f"cu_seqlens[{n - 1}] = {cu[n - 1]}")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T} (the packed length), got cu_seqlens[{len(cu) - 1}] "
                         f"= {cu[-1]}")


# ----------------------------------------------------------------------------------------------
# The definition.
# ----------------------------------------------------------------------------------------------
def naive_recurrent_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
):
    """The KDA recurrence, one token at a time (docs/algorithm.md). Differentiable through autograd.

    Computes in the dtype of ``v`` (upcast the inputs to float64 for a reference). Shapes:
    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
    initial_state [N, HV, K, V]. Returns (o [B, T, HV, V], final_state [N, HV, K, V] or None).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    dt = v.dtype
    scale = K ** -0.5 if scale is None else scale
    q, k, g, beta = preprocess(
        q.to(dt), k.to(dt), g.to(dt), beta.to(dt), A_log, dt_bias, lower_bound,
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    q = q.repeat_interleave(HV // H, dim=2)
    k = k.repeat_interleave(HV // H, dim=2)
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        check_cu_seqlens(cu_seqlens, T)
        cu = cu_seqlens.tolist()
        bounds = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    outs = torch.zeros(B, T, HV, V, dtype=dt, device=v.device)
    finals = []
    for n, (b, bos, eos) in enumerate(bounds):
        S = (torch.zeros(HV, K, V, dtype=dt, device=v.device) if initial_state is None
             else initial_state[n].to(dt))
        rows = []
        for t in range(bos, eos):
            S = S * g[b, t].exp()[..., None]                                   # decay each key row
            k_t, v_t = k[b, t], v[b, t]                                        # [HV, K], [HV, V]
            v_new = v_t - torch.einsum('hk,hkv->hv', k_t, S)
            S = S + beta[b, t][:, None, None] * k_t[..., None] * v_new[:, None, :]
            rows.append(scale * torch.einsum('hk,hkv->hv', q[b, t], S))   # read the updated state
        if rows:
            outs[b, bos:eos] = torch.stack(rows)
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    return outs, final


# ----------------------------------------------------------------------------------------------
# The chunked implementation (CPU path of the ops).
# ----------------------------------------------------------------------------------------------
def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gate_floor(dtype: torch.dtype) -> float:
    """The most negative log decay the chunked form takes: it differences in-chunk cumulative sums, so a
    gate of -inf (a full reset, which the recurrence takes as exp(-inf) = 0) would give -inf - -inf. At this
    floor exp() is zero or below 1e-43, and the cumulative sums of a chunk stay exact to ~1e-5 (fp32)."""
    return -1000.0 if dtype == torch.float64 else -100.0


def _chunk_layout(B: int, T: int, cu_seqlens: Optional[Tensor], C: int, device):
    """Index that scatters tokens [B * T] into a padded chunk layout [N, NT * C].

    Returns (N, NT, index[N, NT * C] into B * T, valid[N, NT * C]). Reads cu_seqlens on the host:
    this code runs behind an opaque op on CPU tensors only.
    """
    if cu_seqlens is None:
        NT = max(1, math.ceil(T / C))
        pos = torch.arange(NT * C, device=device)
        valid = (pos < T).expand(B, -1)
        index = (torch.arange(B, device=device)[:, None] * T + pos.clamp(max=T - 1 if T else 0))
        return B, NT, index, valid
    check_cu_seqlens(cu_seqlens, T)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    N = lens.numel()
    NT = max(1, math.ceil(int(lens.max()) / C)) if N else 1
    pos = torch.arange(NT * C, device=device)
    valid = pos[None, :] < lens[:, None]
    index = (cu[:-1, None] + pos[None, :]).clamp(max=max(B * T - 1, 0))
    return N, NT, index, valid


def _pack(x: Tensor, index: Tensor, valid: Tensor, NT: int, C: int) -> Tensor:
    """[B, T, *rest] -> [N, *heads, NT, C, *feature] with zeros on padding; heads first for batching.

    Padding is selected, never multiplied by 0: a padding row reads a token of another sequence, which may
    hold inf or NaN."""
    flat = x.reshape(-1, *x.shape[2:])
    mask = valid.view(*valid.shape, *([1] * (x.dim() - 2)))
    out = torch.where(mask, flat[index], torch.zeros((), dtype=x.dtype))
    out = out.view(index.shape[0], NT, C, *x.shape[2:])          # [N, NT, C, HV, (K)]
    return out.movedim(3, 1)                                     # [N, HV, NT, C, (K)]


def _unpack(x: Tensor, index: Tensor, valid: Tensor, B: int, T: int) -> Tensor:
    """Inverse of :func:`_pack`: [N, HV, NT, C, *f] -> [B, T, HV, *f] (sum over duplicates is exact)."""
    x = x.movedim(1, 3)                                          # [N, NT, C, HV, *f]
    x = x.reshape(index.numel(), *x.shape[3:])
    out = x.new_zeros(B * T, *x.shape[1:])
    out.index_add_(0, index.reshape(-1)[valid.reshape(-1)], x[valid.reshape(-1)])
    return out.view(B, T, *x.shape[1:])


def _causal_mm(a: Tensor, x: Tensor, causal: Tensor) -> Tensor:
    """a @ x for a lower-triangular a [.., C, C], summing only j <= i: a row never reads a later token,
    so a non-finite value at token j stays out of rows i < j (a dense matmul would give 0 * inf = NaN)."""
    prod = a.unsqueeze(-1) * x.unsqueeze(-3)                     # [.., C(i), C(j), F]
    return torch.where(causal[:, :, None], prod, torch.zeros((), dtype=prod.dtype)).sum(-2)


class _Intra:
    """Everything inside one chunk that does not depend on the state (docs/algorithm.md, chunked form).

    All tensors are [N, HV, NT, C, ...]. decay[i, j, d] = exp(Gam_i[d] - Gam_j[d]) for j <= i, else 0,
    computed per pair (no factorisation, so no overflow whatever the gate).
    """

    def __init__(self, q, k, v, g, beta, scale):
        C = g.shape[-2]
        self.q, self.k, self.v, self.beta, self.scale = q, k, v, beta, scale
        self.gam = g.cumsum(-2)                                            # [.., C, K]
        causal = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
        diff = self.gam.unsqueeze(-2) - self.gam.unsqueeze(-3)             # [.., C(i), C(j), K]
        self.decay = diff.masked_fill(~causal[:, :, None], -math.inf).exp()
        self.strict = causal.tril(-1)
        self.causal = causal
        # Akk[i, j] = sum_d k_i k_j decay_ij (j < i);  Aqk[i, j] = scale sum_d q_i k_j decay_ij (j <= i)
        self.akk = ((k.unsqueeze(-2) * k.unsqueeze(-3)) * self.decay).sum(-1).masked_fill(~self.strict, 0)
        self.aqk = (scale * ((q.unsqueeze(-2) * k.unsqueeze(-3)) * self.decay).sum(-1)).masked_fill(~causal, 0)
        eye = torch.eye(C, dtype=g.dtype, device=g.device)
        # Tm = (I + diag(beta) Akk)^-1, unit lower triangular
        self.tm = torch.linalg.solve_triangular(
            eye + beta[..., None] * self.akk, eye.expand_as(self.akk), upper=False, unitriangular=True)
        self.eg = self.gam.exp()
        self.eg_last = self.eg[..., -1, :]                                 # [.., K]
        self.kg = k * self.eg                                              # k exp(Gam)
        self.qg = q * self.eg                                              # q exp(Gam)
        self.ed = (self.gam[..., -1:, :] - self.gam).exp()                 # exp(Gam_last - Gam)
        self.kd = k * self.ed
        self.w = _causal_mm(self.tm, beta[..., None] * self.kg, causal)    # [.., C, K]
        self.u = _causal_mm(self.tm, beta[..., None] * v, causal)          # [.., C, V]


def _state_pass(intra: _Intra, h0: Tensor):
    """Sequential over chunks. Returns (states entering each chunk [.., NT, K, V], Vn, final state)."""
    NT = intra.gam.shape[2]
    S = h0
    states, vns = [], []
    for c in range(NT):
        states.append(S)
        vn = intra.u[:, :, c] - intra.w[:, :, c] @ S                        # [N, HV, C, V]
        vns.append(vn)
        S = intra.eg_last[:, :, c, :, None] * S + intra.kd[:, :, c].transpose(-1, -2) @ vn
    return torch.stack(states, 2), torch.stack(vns, 2), S


def _prepare(x: KDAInputs, opts: KDAOptions, chunk_size: int):
    q, k, v = x.q, x.k, x.v
    B, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    cd = _compute_dtype(q)
    qp, kp, gp, bp = preprocess(
        q.to(cd), k.to(cd), x.g.to(cd), x.beta.to(cd), x.A_log, x.dt_bias, opts.lower_bound,
        opts.use_qk_l2norm, opts.use_gate, opts.use_beta_sigmoid, opts.allow_neg_eigval)
    floor = _gate_floor(cd)
    unfloored = ~(gp < floor)                  # where the gradient of the floor is 1 (NaN stays NaN)
    gp = torch.where(unfloored, gp, floor)
    N, NT, index, valid = _chunk_layout(B, T, x.cu_seqlens, chunk_size, q.device)
    G = HV // H
    pk = lambda t: _pack(t, index, valid, NT, chunk_size)  # noqa: E731
    packed = dict(
        q=pk(qp.repeat_interleave(G, dim=2)), k=pk(kp.repeat_interleave(G, dim=2)),
        v=pk(v.to(cd)), g=pk(gp), beta=pk(bp))
    h0 = (torch.zeros(N, HV, K, V, dtype=cd, device=q.device) if x.initial_state is None
          else x.initial_state.to(cd))
    return packed, h0, index, valid, cd, unfloored


def chunk_kda_fwd_torch(x: KDAInputs, opts: KDAOptions, output_final_state: bool, chunk_size: int = 64):
    """Chunked KDA forward. Returns (o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] or None).

    The final state is float32 (float64 when the inputs are float64).
    """
    B, T = x.q.shape[:2]
    p, h0, index, valid, cd, _ = _prepare(x, opts, chunk_size)
    intra = _Intra(p['q'], p['k'], p['v'], p['g'], p['beta'], opts.scale)
    states, vn, ht = _state_pass(intra, h0)
    # O = scale (q exp(Gam)) S + Aqk Vn
    o = opts.scale * intra.qg @ states + _causal_mm(intra.aqk, vn, intra.causal)
    o = _unpack(o, index, valid, B, T).to(x.v.dtype)
    return o, (ht if output_final_state else None)


def chunk_kda_bwd_torch(do: Tensor, dht: Optional[Tensor], x: KDAInputs, opts: KDAOptions,
                        chunk_size: int = 64):
    """Hand-derived backward of :func:`chunk_kda_fwd_torch`.

    Returns (dq, dk, dv, dg, dbeta, dA_log or None, ddt_bias or None, dh0 or None); dg/dbeta are the
    gradients of the op's inputs (the raw gate / beta logits when the pre-processing is in the op).
    """
    q, k, v, g, beta = x.q, x.k, x.v, x.g, x.beta
    B, T, H, K = q.shape
    HV = v.shape[-2]
    G = HV // H
    scale = opts.scale
    p, h0, index, valid, cd, unfloored = _prepare(x, opts, chunk_size)
    C = chunk_size
    x_ = _Intra(p['q'], p['k'], p['v'], p['g'], p['beta'], scale)
    states, vn, _ = _state_pass(x_, h0)                               # S entering each chunk, Vn
    do_c = _pack(do.to(cd), index, valid, x_.gam.shape[2], C)         # [N, HV, NT, C, V]
    tr = lambda a: a.transpose(-1, -2)  # noqa: E731

    # Reverse state pass. dS_next: gradient of the state leaving chunk c.
    NT = x_.gam.shape[2]
    dS = torch.zeros_like(h0) if dht is None else dht.to(cd)
    aqk_do = tr(x_.aqk) @ do_c                                        # [.., C, V]
    qg_do = scale * tr(x_.qg) @ do_c                                  # [.., K, V]
    dS_next, dvn = [None] * NT, [None] * NT
    for c in reversed(range(NT)):
        dS_next[c] = dS
        dvn[c] = aqk_do[:, :, c] + x_.kd[:, :, c] @ dS                # dVn = Aqk^T dO + kd dS'
        dS = qg_do[:, :, c] + x_.eg_last[:, :, c, :, None] * dS - tr(x_.w[:, :, c]) @ dvn[c]
    dh0 = dS
    dSn, dvn = torch.stack(dS_next, 2), torch.stack(dvn, 2)

    # Per chunk, in parallel.
    daqk = (do_c @ tr(vn)).masked_fill(~x_.causal, 0)                 # [.., C, C]
    dqg = scale * do_c @ tr(states)                                   # [.., C, K]
    dkd = vn @ tr(dSn)                                                # [.., C, K]
    dgam_last = x_.eg_last * (dSn * states).sum(-1)                   # from diag(exp(Gam_last)) S
    dw = -dvn @ tr(states)
    # U = Tm xu, W = Tm xw with xu = beta v, xw = beta kg
    dxu, dxw = tr(x_.tm) @ dvn, tr(x_.tm) @ dw
    dv = p['beta'][..., None] * dxu
    dkg = p['beta'][..., None] * dxw
    dbeta = (dxu * p['v']).sum(-1) + (dxw * x_.kg).sum(-1)
    # Tm = M^-1, M = I + diag(beta) Akk  =>  dM = -Tm^T dTm Tm^T, dTm = dVn xu^T + dW xw^T; with U = Tm xu,
    # W = Tm xw and dW = -dVn S^T: dTm Tm^T = dVn (U - W S)^T = dVn Vn^T
    dm = (-dxu @ tr(vn)).masked_fill(~x_.strict, 0)
    dbeta = dbeta + (dm * x_.akk).sum(-1)
    dakk = p['beta'][..., None] * dm

    # Through the pairwise decays: P[i, j, d] = dA[i, j] decay[i, j, d] for Aqk and Akk.
    pq = (scale * daqk).unsqueeze(-1) * x_.decay
    pk = dakk.unsqueeze(-1) * x_.decay
    dq_a = (pq * p['k'].unsqueeze(-3)).sum(-2)                        # sum over j
    dk_aq = (pq * p['q'].unsqueeze(-2)).sum(-3)                       # sum over i
    dk_ai = (pk * p['k'].unsqueeze(-3)).sum(-2)                       # k_i side
    dk_aj = (pk * p['k'].unsqueeze(-2)).sum(-3)                       # k_j side
    dgam = p['q'] * dq_a - p['k'] * dk_aq + p['k'] * (dk_ai - dk_aj)
    dq = dq_a + dqg * x_.eg
    dgam = dgam + dqg * x_.qg + dkg * x_.kg - dkd * x_.kd
    dk = dk_aq + dk_ai + dk_aj + dkg * x_.eg + dkd * x_.ed
    dgam_last = dgam_last + (dkd * x_.kd).sum(-2)
    dgam[..., -1, :] += dgam_last
    dg = dgam.flip(-2).cumsum(-2).flip(-2)                            # reverse cumsum in the chunk

    unpack = lambda t: _unpack(t, index, valid, B, T)  # noqa: E731
    dq, dk = unpack(dq), unpack(dk)                                   # [B, T, HV, K]
    dq = dq.view(B, T, H, G, K).sum(3)
    dk = dk.view(B, T, H, G, K).sum(3)
    dv, dg, dbeta = unpack(dv), unpack(dg), unpack(dbeta)
    dg = torch.where(unfloored, dg, torch.zeros((), dtype=dg.dtype))

    # Chain rule through the in-op pre-processing.
    dA_log = ddt_bias = None
    if opts.use_qk_l2norm:
        dq, dk = l2norm_bwd(q.to(cd), dq), l2norm_bwd(k.to(cd), dk)
    if opts.use_gate:
        dg, dA_log, ddt_bias = kda_gate_bwd(g.to(cd), x.A_log, x.dt_bias, opts.lower_bound, dg)
    if opts.use_beta_sigmoid:
        dbeta = beta_activation_bwd(beta.to(cd), opts.allow_neg_eigval, dbeta)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
            dA_log, ddt_bias, None if x.initial_state is None else dh0)
