"""fp64 emulation of the kda_ops Triton backward (kernels/bwd.py) with bf16 / tf32 / fp32 roundings switchable
by name at the points where the kernels round (bf16 inputs, gate + l2norm + beta sigmoid in the op).

Rounding names (set R):
  gam32  gate activation + in-chunk cumsum in fp32 (log2 units), as prepare.load_gam_block
  A      recompute of Aqk / Akk with bf16 dot operands (fast / exact path per 32-wide K-block, intra.py)
  tf32f  tf32 operands of the recompute's W, U dots (intra.py) and state-pass dots (state.py)
  s3     stage-3 tf32 dots (intra_bwd.py), faithful: fast / exact path per K-block, factored operands rounded
         (the exact path's diagonal 16x16 blocks are per-pair fp32: not rounded)
  s3P / s3v  only the [C, C] operands (dAqk, dM) / only the factored q, k operands of the stage-3 dots in tf32
  s3x3   (a candidate fix, not in ALL) stage-3 dots with tf32x3 operands (hi + lo split, ~fp32)
  h      per-chunk states stored in bf16 (state.py store_h) -> read by stage 2
  vn     Vn stored in bf16 -> read by stage 2
  dh     dS (gradient of the state leaving a chunk) rounded to bf16: stage-1 dot operand and stored for stage 2
  dvn    dVn rounded to bf16: stage-1 W^T dVn dot operand and stored for stage 2
  s1op   stage-1 bf16 dot operands qg, kd, W, Aqk
  s2op   stage-2 bf16 dot operands Tm, U, W and the intermediates dXu, dW, dXw
  acc32  dA_log / ddt_bias partial sums in fp32 (per chunk program, then summed in fp32)
"""
import math
import torch
from kda_ops import reference as R

ALL = ("gam32", "A", "tf32f", "s3", "h", "vn", "dh", "dvn", "s1op", "s2op", "acc32")
LN2 = math.log(2.0)
SPAN = 60.0 * LN2          # intra.py SPAN (log2) in natural-log units
BC, BKA = 16, 32           # sub-chunk, K-block of the Aqk/Akk recompute (first autotune config)
BK3 = 32                   # K-block of stage 3 (intra_bwd first autotune config)
SPAN3 = SPAN               # stage-3 fast-path threshold (set < 0 to force the exact path: a candidate fix)
FAST_LOG = []              # fraction of stage-3 (chunk, K-block) programs on the fast path, per call
TF32_MODE = "rn"           # "rn": round to nearest, "rz": truncate (mma ignoring the low 13 bits)
DIAG_SPLIT = False         # candidate fix: stage 3's factored operands as tf32 hi + lo on the rows of the own
                           # (diagonal) 16-row block only, single tf32 on the earlier / later blocks
PAIR_REF = False           # candidate fix (no extra precision), a cancellation-aware correction of dA_log / ddt_bias.
                           # dA_log = sum_s dGam_s W_s, W = in-chunk inclusive cumsum of dg_t/dA_log (= Gam without
                           # lower_bound), likewise ddt_bias[k] with W = cumsum of dg_t/d(dt_bias). Each stage-3 pair
                           # block (row block r >= column block c) adds D_rc = (column sums over block r's rows of
                           # q dq_a + beta k X from block c) - (column sums over block c's rows of k dk_a from block
                           # r) to sum_s dGam_s, which is exactly zero in exact arithmetic. The correction subtracts
                           # sum_rc a_rc[k] D_rc[k] with a per pair block and channel reference a_rc = W at:
                           #   "mid": (W_start(c) + W_end(r)) / 2, W_start(c) = W at row 16 c - 1 (0 for c = 0),
                           #          W_end(r) = W at row 16 r + 15 (for r = c: the middle of block r)
                           #   "row": row min(16 r + 8, Tc - 1) (block r's middle row, the fast path's reference)
                           #   "first": row 16 r (block r's first row)
                           # False: no correction (the kernels as they are).
PAIR_DIAG_ONLY = False     # (diagnostic) apply the PAIR_REF correction to the diagonal pair blocks (r = c) only


def bf(t):
    return t.to(torch.bfloat16).double()


def tf(t):
    i = t.float().view(torch.int32)
    if TF32_MODE == "rn":
        i = i + 0x1000                             # round to nearest (ties away) at 10 mantissa bits
    i = i & ~0x1FFF
    return i.view(torch.float32).double()


def A_recompute(q, k, gam, Tc, rnd):
    """sum_d q_i k_j exp(gam_i - gam_j) for all (i, j) with the kernel's factorisation and operand rounding.
    q, k, gam [.., NT, C, K]; Tc [NT] valid rows per chunk. Returns [.., NT, C, C] (unmasked)."""
    C, K = gam.shape[-2:]
    NB = C // BC
    i = torch.arange(C)
    blk = i // BC
    out = 0
    diff = gam.unsqueeze(-2) - gam.unsqueeze(-3)                                     # [.., i, j, K]
    causal = (i[:, None] >= i[None, :])
    exact_pair = (q.unsqueeze(-2) * k.unsqueeze(-3) * diff.masked_fill(~causal[:, :, None], -math.inf).exp())
    same_blk = blk[:, None] == blk[None, :]
    for k0 in range(0, K, BKA):
        sl = slice(k0, min(K, k0 + BKA))
        qb, kb, gb = q[..., sl], k[..., sl], gam[..., sl]
        # fast test: max |gam_i - gam_m(i)| over valid rows, m(i) = min(16 blk + 8, Tc - 1)
        m_i = torch.minimum(blk[None, :] * BC + BC // 2, Tc[:, None] - 1)            # [NT, C]
        valid = i[None, :] < Tc[:, None]                                              # [NT, C]
        gm_i = torch.gather(gb, -2, m_i.view(*([1] * (gb.dim() - 3)), *m_i.shape, 1).expand(gb.shape))
        span = ((gb - gm_i).abs() * valid[..., None]).amax((-1, -2))                  # [.., NT]
        fast = span <= SPAN
        # fast: reference row m_r of block r for rows and columns
        rq = rnd(qb * (gb - gm_i).exp())                                             # [.., NT, C, Kb]
        rk = rnd(kb * (gb - gm_i).exp())
        part_f = []
        part_e = []
        for r in range(NB):
            rows = slice(r * BC, (r + 1) * BC)
            # fast: columns j < 16 (r + 1), factor exp(gam_m - gam_j)
            gm = gm_i[..., r * BC:r * BC + 1, :]
            kc = rnd(kb * (gm - gb).exp()) * (i < (r + 1) * BC)[:, None]
            part_f.append(torch.stack([rq[..., rows, :] @ kc.transpose(-1, -2),
                                       rk[..., rows, :] @ kc.transpose(-1, -2)]))
            # exact: off-diagonal columns j < 16 r, reference row 16 r (both factors <= 1); diagonal exact
            g0 = gb[..., r * BC:r * BC + 1, :]
            ei = (gb[..., rows, :] - g0).clamp(max=0).exp()
            kc = rnd(kb * (g0 - gb).clamp(max=0).exp()) * (i < r * BC)[:, None]
            part_e.append(torch.stack([rnd(qb[..., rows, :] * ei) @ kc.transpose(-1, -2),
                                       rnd(kb[..., rows, :] * ei) @ kc.transpose(-1, -2)]))
        pf = torch.cat(part_f, -2)                                                    # [2, .., NT, C, C]
        pe = torch.cat(part_e, -2)
        ex = exact_pair[..., sl]
        dq_ex = ex.sum(-1) * same_blk
        dk_ex = (k.unsqueeze(-2) * k.unsqueeze(-3) *
                 diff.masked_fill(~causal[:, :, None], -math.inf).exp())[..., sl].sum(-1) * same_blk
        pe = pe + torch.stack([dq_ex, dk_ex])
        out = out + torch.where(fast[..., None, None], pf, pe)
    return out[0], out[1]


def run(inputs, kw, do, Rset=(), C=64):
    """Emulated kernel backward. Returns dict of dq, dk, dv, dg (raw gate), dbeta, dA_log, ddt_bias (fp64) plus
    dgam_act (dg w.r.t. the activated gate, [B,T,HV,K]) and g_act."""
    Rset = set(Rset)
    r = lambda name, t: bf(t) if name in Rset else t            # noqa: E731
    t32 = lambda t: tf(t) if "tf32f" in Rset else t             # noqa: E731
    q, k, v, g, beta = (x.double() for x in inputs)
    A_log, dt_bias = kw["A_log"].double(), kw["dt_bias"].double()
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    scale = K ** -0.5
    p, h0, index, valid, _ = R._prepare(q, k, v, g, beta, A_log, dt_bias, None, None, None,
                                        True, True, True, kw.get("allow_neg_eigval", False), C)
    qn, kn, vv, ga, bt = p["q"], p["k"], p["v"], p["g"], p["beta"]        # [N, HV, NT, C, (K)]
    NT = ga.shape[2]
    Tc = torch.tensor([min(C, T - c * C) for c in range(NT)])
    if "gam32" in Rset:
        g32 = R._pack(R.kda_gate(g.float(), A_log.float(), dt_bias.float(), None), index, valid, NT, C)
        gam = ((g32.cumsum(-2) * 1.4426950408889634).double() * LN2)
    else:
        gam = ga.cumsum(-2)
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    strict = causal.tril(-1)
    ident = lambda t: t  # noqa: E731
    if "A" in Rset:
        aq, ak = A_recompute(qn, kn, gam, Tc, bf)
    else:
        aq, ak = A_recompute(qn, kn, gam, Tc, ident)
    aqk = (scale * aq).masked_fill(~causal, 0)
    akk = ak.masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=torch.float64)
    tm = torch.linalg.solve_triangular(eye + bt[..., None] * akk, eye.expand_as(akk), upper=False,
                                       unitriangular=True)
    eg = gam.exp()
    eg_last = eg[..., -1, :]
    kg, qg = kn * eg, scale * qn * eg
    ed = (gam[..., -1:, :] - gam).exp()
    kd = kn * ed
    xw, xu = bt[..., None] * kg, bt[..., None] * vv
    w, u = t32(tm) @ t32(xw), t32(tm) @ t32(xu)
    tr = lambda a: a.transpose(-1, -2)  # noqa: E731

    # recompute state pass (tf32 dots), per-chunk states and Vn stored
    S = h0
    hs, vns = [], []
    for c in range(NT):
        hs.append(S)
        vn = u[:, :, c] - t32(w[:, :, c]) @ t32(S)
        vns.append(vn)
        S = eg_last[:, :, c, :, None] * S + tr(t32(kd[:, :, c])) @ t32(vn)
    h_st, vn_st = r("h", torch.stack(hs, 2)), r("vn", torch.stack(vns, 2))

    do_c = R._pack(do.double(), index, valid, NT, C)
    # stage 1: reverse state pass
    o1 = lambda t: r("s1op", t)  # noqa: E731
    dS = torch.zeros_like(h0)
    dh_l, dvn_l = [None] * NT, [None] * NT
    for c in reversed(range(NT)):
        dSr = r("dh", dS)
        dh_l[c] = dSr
        dvn = tr(o1(aqk[:, :, c])) @ do_c[:, :, c] + o1(kd[:, :, c]) @ dSr
        dvn = r("dvn", dvn)
        dvn_l[c] = dvn
        dS = dS * eg_last[:, :, c, :, None] + tr(o1(qg[:, :, c])) @ do_c[:, :, c] - tr(o1(w[:, :, c])) @ dvn
    dh_st, dvn_st = torch.stack(dh_l, 2), torch.stack(dvn_l, 2)

    # stage 2
    o2 = lambda t: r("s2op", t)  # noqa: E731
    daqk = scale * (do_c @ tr(vn_st)).masked_fill(~causal, 0)
    dxu = tr(o2(tm)) @ dvn_st
    dv = bt[..., None] * dxu
    dbeta = (dxu * vv).sum(-1)
    dm = o2(dxu) @ tr(o2(u))
    dqg = do_c @ tr(h_st)
    dkd = vn_st @ tr(dh_st)
    dw = -dvn_st @ tr(h_st)
    dgl = (h_st * dh_st).sum(-1)
    dxw = tr(o2(tm)) @ o2(dw)
    dm = dm + o2(dxw) @ tr(o2(w))
    dbeta = dbeta + (dxw * kg).sum(-1)
    dkg = dxw * bt[..., None]
    dq = scale * dqg * eg
    dk = dkg * eg + dkd * ed
    dgam = dq * qn + dkg * kg - dkd * kd
    dlast = dgl * eg_last + (dkd * kd).sum(-2)
    dM = (-dm).masked_fill(~strict, 0)

    # stage 3 (tf32 dots, intra_bwd.py)
    idf = lambda t: t  # noqa: E731
    tf3 = lambda t: tf(t) + tf(t - tf(t))          # tf32x3 operand (hi + lo): ~2^-22 relative  # noqa: E731
    rm = tf3 if "s3x3" in Rset else tf if ("s3" in Rset or "s3P" in Rset) else idf
    rv = tf3 if "s3x3" in Rset else tf if ("s3" in Rset or "s3v" in Rset) else idf
    dqa_p, x_p, dka_p = stage3(daqk, dM, qn, kn, bt, gam, Tc, rm, rv)     # [.., NT, C, NB, K] per block
    dq_a, X, dk_a = dqa_p.sum(-2), x_p.sum(-2), dka_p.sum(-2)
    NB = C // BC
    # D[.., NT, r, c, K]: row-side column sums of pair block (r, c) minus its column-side column sums (exact: 0)
    rs = (qn.unsqueeze(-2) * dqa_p + (bt[..., None] * kn).unsqueeze(-2) * x_p)
    rs = rs.reshape(*rs.shape[:-4], NT, NB, BC, NB, K).sum(-3)                # [.., NT, r, c, K]
    cs = (kn.unsqueeze(-2) * dka_p)
    cs = cs.reshape(*cs.shape[:-4], NT, NB, BC, NB, K).sum(-3).transpose(-2, -3)   # [.., NT, r, c, K]
    Dpair = rs - cs
    dkai = bt[..., None] * X
    dq = dq + dq_a
    dk = dk + dk_a + dkai
    dgam = dgam + qn * dq_a + kn * (dkai - dk_a)
    dbeta = dbeta + (kn * X).sum(-1)
    # the chunk's last valid row gets the state-decay terms
    for c in range(NT):
        dgam[:, :, c, Tc[c] - 1, :] += dlast[:, :, c]
    dgact = dgam.flip(-2).cumsum(-2).flip(-2)

    un = lambda t: R._unpack(t, index, valid, B, T)  # noqa: E731
    G = HV // H
    dq = R.l2norm_bwd(q, un(dq).view(B, T, H, G, K).sum(3))
    dk = R.l2norm_bwd(k, un(dk).view(B, T, H, G, K).sum(3))
    dgact_u = un(dgact)
    dg, dA_log, ddt_bias = R.kda_gate_bwd(g, A_log, dt_bias, None, dgact_u)
    if PAIR_REF:
        # per-token derivatives of the activated gate w.r.t. A_log and dt_bias (no lower_bound: dg/dA_log = g)
        a_ = A_log.exp().view(HV, 1)
        x_ = g + dt_bias.view(HV, K)
        wA = R._pack(-a_ * torch.nn.functional.softplus(x_), index, valid, NT, C).cumsum(-2)   # [N, HV, NT, C, K]
        wB = R._pack(-a_ * torch.sigmoid(x_), index, valid, NT, C).cumsum(-2)
        rr = torch.arange(NB)
        if PAIR_REF == "mid":
            def ref(W):
                end = W[..., rr * BC + BC - 1, :]                                     # [.., NT, NB, K]
                start = torch.cat([torch.zeros_like(end[..., :1, :]), end[..., :-1, :]], -2)
                return 0.5 * (start.unsqueeze(-3) + end.unsqueeze(-2))               # [.., NT, r, c, K]
        else:
            def ref(W):
                off = BC // 2 if PAIR_REF == "row" else 0
                ri = torch.minimum(rr[None, :] * BC + off, Tc[:, None] - 1)           # [NT, NB]
                Wr = torch.gather(W, -2, ri.view(1, 1, NT, NB, 1).expand(*W.shape[:3], NB, K))
                return Wr.unsqueeze(-2).expand(*Wr.shape[:-1], NB, K)                # [.., NT, r, c, K]
    if "acc32" in Rset:
        a = A_log.exp().view(HV, 1)
        x = g + dt_bias.view(HV, K)
        term = (-a * torch.nn.functional.softplus(x) * dgact_u).float()          # [B, T, HV, K]
        term = R._pack(term, index, valid, NT, C)                                 # [N, HV, NT, C, K]
        dA_log = term.sum((-1, -2)).sum((0,)).sum(-1).double()  # per program fp32, then fp32 sum
        dx = R._pack(dg.float(), index, valid, NT, C)
        ddt_bias = dx.sum(-2).sum(0).sum(1).reshape(-1).double()
    if PAIR_REF:
        Dp = Dpair.float().double() if "acc32" in Rset else Dpair
        if PAIR_DIAG_ONLY:
            Dp = Dp * torch.eye(NB, dtype=Dp.dtype)[:, :, None]
        dA_log = dA_log - (ref(wA) * Dp).sum((0, 2, 3, 4, 5))
        ddt_bias = ddt_bias - (ref(wB) * Dp).sum((0, 2, 3, 4)).reshape(-1)
    dbeta = R.beta_activation_bwd(beta, kw.get("allow_neg_eigval", False), un(dbeta))
    g_act = R.kda_gate(g, A_log, dt_bias, None)
    return dict(dq=dq, dk=dk, dv=un(dv), dg=dg, dbeta=dbeta, dA_log=dA_log, ddt_bias=ddt_bias,
                dgact=dgact_u, g_act=g_act, dgam=un(dgam), Dpair=Dpair)


def _rows(x, idx):
    """x [.., NT, C, Kb] gathered at per-chunk row indices idx [NT, C]."""
    return torch.gather(x, -2, idx.view(*([1] * (x.dim() - 3)), *idx.shape, 1).expand(x.shape))


def stage3(P, M, q, k, bt, gam, Tc, rnd_m, rnd):
    """dq_a = sum_j P_ij k_j e_ij, X = sum_j M_ij k_j e_ij, dk_a = sum_i (P_ij q_i + beta_i M_ij k_i) e_ij with
    intra_bwd.py's factorisation, path choice per K-block and operand rounding (tf32): rnd_m for the
    [C, C] operands P, dM, rnd for the factored q / k operands.
    Returns dq_a, X, dk_a split by the 16-row block of the other side of the pair: [.., NT, C, NB, K]
    (sum over NB = the kernel's results; the parts are the per-block-pair terms the PAIR_REF correction uses)."""
    C, K = gam.shape[-2:]
    i = torch.arange(C)
    blk = i // BC
    f_i = (blk * BC)[None, :].expand(len(Tc), C)
    m_i = torch.minimum(f_i + BC // 2, Tc[:, None] - 1)
    l_i = torch.minimum(f_i + BC - 1, Tc[:, None] - 1)
    valid = i[None, :] < Tc[:, None]
    same = blk[:, None] == blk[None, :]
    causal = i[:, None] >= i[None, :]
    Pt, Mt = P.transpose(-1, -2), M.transpose(-1, -2)
    kbeta = k * bt[..., None]
    rP, rM, rPt, rMt = rnd_m(P), rnd_m(M), rnd_m(Pt), rnd_m(Mt)
    NB = C // BC
    onehot = (blk[:, None] == torch.arange(NB)[None, :]).double()                    # [C, NB]
    outs = []
    for k0 in range(0, K, BK3):
        sl = slice(k0, min(K, k0 + BK3))
        g, qb, kb, kbb = gam[..., sl], q[..., sl], k[..., sl], kbeta[..., sl]
        gm, gf, gl = _rows(g, m_i), _rows(g, f_i.clamp(max=C - 1)), _rows(g, l_i)
        fast = ((g - gm).abs() * valid[..., None]).amax((-1, -2)) <= SPAN3          # [.., NT]
        FAST_LOG.append(fast.double().mean().item())
        res = {}
        for path in ("fast", "exact"):
            pz = lambda: torch.zeros(*g.shape[:-1], NB, g.shape[-1], dtype=g.dtype)  # noqa: E731
            dqa, x, dka = pz(), pz(), pz()                                            # [.., NT, C, NB, Kb]
            for r in range(C // BC):
                r0 = r * BC
                rows = slice(r0, r0 + BC)
                if path == "fast":
                    ga = _rows(g, torch.minimum(torch.full_like(Tc, r0 + BC // 2), Tc - 1)[:, None].expand(-1, C))[..., :1, :]
                    xa = (ga - g)
                    xa = torch.where((i < r0)[:, None], xa.clamp(max=0), xa.clamp(max=SPAN))
                    kc = torch.where((i < r0 + BC)[:, None], kb * xa.exp(), 0.0)
                    gb_ = ga
                    yb = g - gb_
                    er = torch.where((i >= r0 + BC)[:, None], yb.clamp(max=0), yb.clamp(max=SPAN)).exp()
                    er = torch.where((i >= r0)[:, None], er, 0.0)
                else:
                    ga = _rows(g, torch.full_like(m_i, r0).clamp(max=C - 1))[..., :1, :]
                    kc = torch.where((i < r0)[:, None], kb * (ga - g).clamp(max=0).exp(), 0.0)
                    gb_ = _rows(g, torch.minimum(torch.full_like(Tc, r0 + BC - 1), Tc - 1)[:, None].expand(-1, C))[..., :1, :]
                    er = torch.where((i >= r0 + BC)[:, None], (g - gb_).clamp(max=0).exp(), 0.0)
                rd = rnd
                if DIAG_SPLIT and rnd is tf:       # (only where stage 3 rounds at all)
                    own = ((i >= r0) & (i < r0 + BC))[:, None]
                    rd = lambda t: torch.where(own, tf(t) + tf(t - tf(t)), rnd(t))  # noqa: E731
                rkc, rqe, rke = rd(kc), rd(qb * er), rd(kbb * er)
                for c in range(NB):              # the other side's 16-row block (same sums, split by block)
                    cb = slice(c * BC, (c + 1) * BC)
                    dqa[..., rows, c, :] = rP[..., rows, cb] @ rkc[..., cb, :]
                    x[..., rows, c, :] = rM[..., rows, cb] @ rkc[..., cb, :]
                    dka[..., rows, c, :] = rPt[..., rows, cb] @ rqe[..., cb, :] + rMt[..., rows, cb] @ rke[..., cb, :]
            if path == "fast":
                ea = (g - gm).clamp(max=SPAN).exp()
                eb = (gm - g).clamp(max=SPAN).exp()
                dqa, x, dka = dqa * ea.unsqueeze(-2), x * ea.unsqueeze(-2), dka * eb.unsqueeze(-2)
            else:
                ea = (g - gf).clamp(max=SPAN).exp()
                eb = (gl - g).clamp(max=SPAN).exp()
                dqa, x, dka = dqa * ea.unsqueeze(-2), x * ea.unsqueeze(-2), dka * eb.unsqueeze(-2)
                # exact diagonal blocks, per pair
                d = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(~(causal & same)[:, :, None], -math.inf).exp()
                Pd, Md = P * same, M * same
                oh = onehot[:, :, None]          # the diagonal pairs belong to the own block
                dqa = dqa + ((Pd.unsqueeze(-1) * d) * kb.unsqueeze(-3)).sum(-2).unsqueeze(-2) * oh
                x = x + ((Md.unsqueeze(-1) * d) * kb.unsqueeze(-3)).sum(-2).unsqueeze(-2) * oh
                dka = dka + (((Pd.unsqueeze(-1) * d) * qb.unsqueeze(-2)).sum(-3)
                             + ((Md.unsqueeze(-1) * d) * kbb.unsqueeze(-2)).sum(-3)).unsqueeze(-2) * oh
            res[path] = (dqa, x, dka)
        f = fast[..., None, None, None]
        outs.append([torch.where(f, a, b) for a, b in zip(res["fast"], res["exact"])])
    return [torch.cat([o[n] for o in outs], -1) for n in range(3)]
