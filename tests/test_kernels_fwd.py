"""Triton forward kernels on CPU through the Triton interpreter, against the fp64 recurrence.

The interpreter must be switched on (TRITON_INTERPRET=1) before triton is first imported, which one
pytest process shared with other test files cannot promise. So the cases below run only when the variable
is set, and `test_interpreter_suite` (part of every normal `pytest tests` run) runs this file again in a
subprocess with the variable set and asserts that it passed. Tiny shapes; one autotune config.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from kda_case import Case, rel_rms
from kernel_inputs import bundles
from kda_ops.reference import _Intra, _chunk_layout, _pack, naive_recurrent_kda, preprocess

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="runs inside test_interpreter_suite (TRITON_INTERPRET=1)")

# relative RMS error vs the fp64 recurrence. bf16 is loose because the interpreter truncates fp32 -> bf16
# (a bias of ~-2.7e-3 per rounding; the GPU rounds to nearest) and the bf16 forward rounds U, Aqk, kd, W, qg
# and the dot operands S, Vn: 0.9e-2 - 1.1e-2 on o here, 2.9e-3 - 3.2e-3 with the cast patched to round to
# nearest (on the bf16 cases below)
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

CASES = [
    (Case(B=1, T=1, H=1, HV=1, K=16, V=16, in_op=True, dtype=torch.float32), {}),
    (Case(B=2, T=37, H=1, HV=2, K=16, V=16, dtype=torch.float32), {}),
    (Case(B=1, T=70, H=1, HV=2, K=20, V=20, in_op=True, lower_bound=-5.0, allow_neg_eigval=True,
          initial_state=False, dtype=torch.float32), {}),
    (Case(B=2, T=70, H=1, HV=1, K=20, V=16, in_op=True, dtype=torch.bfloat16), {}),
    (Case(B=1, T=70, H=1, HV=2, K=16, V=16, in_op=True, dtype=torch.float16), {}),
    (Case(B=1, T=105, H=1, HV=2, K=16, V=16, in_op=True, seqlens=[5, 70, 30], dtype=torch.float32), {}),
    (Case(B=1, T=105, H=1, HV=1, K=20, V=20, initial_state=False, seqlens=[64, 1, 40],
          dtype=torch.bfloat16), {}),
    # bf16 forward (kd^T stored per chunk): K = 100 (padded to 128), GVA, T not a multiple of 64, a sequence
    # shorter than a chunk, one spanning a partial second chunk
    (Case(B=1, T=150, H=1, HV=2, K=100, V=36, in_op=True, seqlens=[3, 100, 47], dtype=torch.bfloat16), {}),
    # gate with lower_bound and neither A_log nor dt_bias
    (Case(B=1, T=37, H=1, HV=2, K=16, V=16, in_op=True, lower_bound=-3.0, dtype=torch.float32),
     dict(A_log=None, dt_bias=None)),
    # strong unsafe gate (A = 10 .. 16: several nats per step): the intra stage's exact path on every K-block
    (Case(B=1, T=83, H=1, HV=2, K=20, V=12, in_op=True, a_log_range=(2.3, 2.8), dtype=torch.float32), {}),
    (Case(B=1, T=83, H=1, HV=1, K=20, V=20, in_op=True, a_log_range=(2.3, 2.8), dtype=torch.bfloat16), {}),
    # unsafe gate without dt_bias
    (Case(B=1, T=70, H=1, HV=1, K=16, V=16, in_op=True, dtype=torch.float32), dict(dt_bias=None)),
]


def case_id(case):
    c, over = case
    return c.id + "".join(f"-no_{k}" for k in over)


_empty = torch.empty


def nan_empty(*args, **kwargs):
    """torch.empty that poisons float memory with NaN: a kernel that reads what nothing wrote shows it."""
    x = _empty(*args, **kwargs)
    return x.fill_(float("nan")) if x.is_floating_point() else x


def run_case(c: Case, over: dict, seed: int = 0, g=None):
    """Returns (o, final_state) of the Triton forward (scratch and outputs poisoned) and of the fp64 recurrence.
    g: a gate to take in place of the case's."""
    from kda_ops.kernels import chunk_index, chunk_kda_fwd_triton
    (q, k, v, g_case, beta), kw = c.make(seed=seed)
    g = g_case if g is None else g
    kw.update(over)
    g, beta = g.to(c.dtype), beta.to(c.dtype)
    x, opts = bundles([q, k, v, g, beta], kw)
    with mock.patch("torch.empty", nan_empty):
        o, ht, _, _ = chunk_kda_fwd_triton(x, opts, chunk_index(c.B, c.T, x.cu_seqlens), True)
    d = lambda x: None if x is None else x.double()  # noqa: E731
    ref_kw = {n: d(x) if isinstance(x, torch.Tensor) and n != "cu_seqlens" else x for n, x in kw.items()}
    ro, rht = naive_recurrent_kda(d(q), d(k), d(v), d(g), d(beta), scale=c.K ** -0.5, **ref_kw)
    return (o, ht), (ro, rht)


@interpreter_only
@pytest.mark.parametrize("i", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_fwd_vs_recurrence(i):
    c, over = CASES[i]
    (o, ht), (ro, rht) = run_case(c, over, seed=i)
    assert o.dtype == c.dtype and ht.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_rms(o, ro) <= TOL[c.dtype], rel_rms(o, ro)
    assert rel_rms(ht, rht) <= TOL[c.dtype], rel_rms(ht, rht)


def widest_blocks(g, seqlens, span, levels=(16, 8, 4, 2, 1)):
    """{K-block: set of R}: for each 64-token chunk of each sequence, value head and 32-channel K-block of the log
    decay g [1, T, HV, K] (natural log units), the widest R of `levels` whose R-row blocks of the chunk all span at
    most 2 span in log2 units (gam of the first row less gam of the last): the intra kernel's test for taking a
    block's pairs by one dot per operand (1, single rows, always passes)."""
    out, t0 = {}, 0
    for n in seqlens:
        for c0 in range(t0, t0 + n, 64):
            gam = torch.cumsum(g[0, c0:min(c0 + 64, t0 + n)].double(), 0) / math.log(2)       # [rows, HV, K]
            for kb in range(0, g.shape[-1], 32):
                blk = gam[..., kb:kb + 32]
                out.setdefault(kb // 32, set()).add(next(R for R in levels if all(
                    (blk[i] - blk[min(i + R, len(blk)) - 1]).max() <= 2 * span for i in range(0, len(blk), R))))
        t0 += n
    return out


@interpreter_only
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm_in_op", "normalised"])
@pytest.mark.parametrize("decay", [7.0, 14.0, 21.0, 45.0, 100.0], ids=["d10", "d20", "d30", "d65", "d144"])
def test_fwd_wide_span(l2norm, decay):
    """A log decay of d .. d + 0.5 nats per token (10.1 - 10.8, 20.2 - 20.9, 30.3 - 31.0, 64.9 - 65.6 or
    144.3 - 145.0 in log2): every path of the intra kernel's diagonal blocks. A block passes the test when its first
    and last rows' gam differ by at most 2 span, span being common.SPAN_UNIT (112) with the in-op l2norm and
    common.SPAN (60) without, so the diagonal pairs go by one dot per 16-row block at d10 with l2norm (factors up to
    2^87; entries outside the blocks overflow and are discarded), per 8-row block at d10 without and at d20 and d30
    with, per 4-row block at d20 and d30 without and d65 with, per 2-row block at d65 without and d144 with, and by
    single rows at d144 without (widest_blocks checks these levels on the inputs)."""
    c = Case(B=1, T=150, H=1, HV=2, K=32, V=16, in_op=True, l2norm=l2norm, seqlens=[64, 86],
             dtype=torch.float32)
    g = -(decay + 0.5 * torch.rand(c.B, c.T, c.HV, c.K, generator=torch.Generator().manual_seed(5),
                                   dtype=torch.float64))
    level = {7.0: (16, 8), 14.0: (8, 4), 21.0: (8, 4), 45.0: (4, 2), 100.0: (2, 1)}[decay][0 if l2norm else 1]
    assert widest_blocks(g, c.seqlens, 112.0 if l2norm else 60.0) == {0: {level}}
    over = dict(use_gate_in_kernel=False, A_log=None, dt_bias=None)
    (o, ht), (ro, rht) = run_case(c, over, seed=7, g=g)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_rms(o, ro) <= TOL[c.dtype], rel_rms(o, ro)
    assert rel_rms(ht, rht) <= TOL[c.dtype], rel_rms(ht, rht)


@interpreter_only
@pytest.mark.parametrize("decays", [(45.0, 14.0, 7.0, 0.3), (0.3, 7.0, 14.0, 45.0), (7.0, 0.3, 45.0, 14.0)],
                         ids=["strong_first", "weak_first", "mixed"])
def test_fwd_kblocks_on_different_paths(decays):
    """K = 128 in four K-blocks of 32 channels, each with its own log decay per token (d .. d + 0.5 nats), whose
    widest passing blocks differ (45: 4-row blocks, 14: 8-row blocks, 7: 16-row blocks, 0.3: 32-row blocks), in
    three orders, against the fp64 recurrence. A level that failed for a K-block is not tried for the chunk's later
    ones, so the paths depend on the order: strong_first takes the exact path in every K-block (4-row, then 8-row
    diagonal blocks), weak_first the halves, the 16-row blocks, then the exact path's 8- and 4-row blocks, mixed
    the 16-row blocks twice, then 4- and 8-row blocks."""
    c = Case(B=1, T=150, H=1, HV=2, K=128, V=16, in_op=True, seqlens=[64, 86], dtype=torch.float32)
    d = torch.tensor(decays, dtype=torch.float64).repeat_interleave(32)
    g = -(d + 0.5 * torch.rand(c.B, c.T, c.HV, c.K, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    level = {45.0: 4, 14.0: 8, 7.0: 16, 0.3: 16}
    assert widest_blocks(g, c.seqlens, 112.0) == {kb: {level[dk]} for kb, dk in enumerate(decays)}
    assert widest_blocks(g, c.seqlens, 112.0, (32, 1))[decays.index(0.3)] == {32}
    over = dict(use_gate_in_kernel=False, A_log=None, dt_bias=None)
    (o, ht), (ro, rht) = run_case(c, over, seed=11, g=g)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_rms(o, ro) <= TOL[c.dtype], rel_rms(o, ro)
    assert rel_rms(ht, rht) <= TOL[c.dtype], rel_rms(ht, rht)


@interpreter_only
def test_stage_outputs_vs_chunked_reference():
    """gam, beta, Aqk, Tm, W, U of the intra stage and h, Vn of the state stage (what the backward reuses)
    against the chunked torch implementation in fp64, on full chunks (T = 128)."""
    from kda_ops.kernels import chunk_index
    from kda_ops.kernels.fwd_intra import chunk_kda_fwd_intra
    from kda_ops.kernels.fwd_state import chunk_kda_fwd_state
    from kda_ops.kernels.fwd_wu import chunk_kda_fwd_wu
    from kda_ops.reference import _state_pass
    c = Case(B=1, T=128, H=1, HV=2, K=16, V=20, in_op=True, dtype=torch.float32)
    (q, k, v, g, beta), kw = c.make(seed=3)
    g, beta, scale = g.float(), beta.float(), c.K ** -0.5
    x, opts = bundles([q, k, v, g, beta], kw)
    idx = chunk_index(c.B, c.T, None)
    out, kbg = chunk_kda_fwd_intra(x, opts, idx)
    W, U = chunk_kda_fwd_wu(x, opts, out, kbg, idx)
    st = chunk_kda_fwd_state(W, U, out.kd, out.kd_t, out.qg, out.Aqk, out.gam, kw["initial_state"], idx, False,
                             v.dtype, store_o=False, store_h=True, store_vn=True)
    d = lambda x: x.double()  # noqa: E731
    qp, kp, gp, bp = preprocess(d(q), d(k), d(g), d(beta), d(kw["A_log"]), d(kw["dt_bias"]), None,
                                True, True, True, False)
    N, NT, index, valid = _chunk_layout(c.B, c.T, None, 64, "cpu")
    pk = lambda x: _pack(x, index, valid, NT, 64)  # noqa: E731
    ref = _Intra(pk(qp), pk(kp), pk(d(v)), pk(gp), pk(bp), scale)
    states, vn, _ = _state_pass(ref, d(kw["initial_state"]))
    mine = lambda x: x.view(c.B, NT, 64, c.HV, *x.shape[3:]).movedim(3, 1)  # noqa: E731  -> [B, HV, NT, C, ..]
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    assert rel_rms(mine(out.gam), ref.gam / math.log(2)) < 1e-5
    assert rel_rms(mine(out.beta), pk(bp)) < 1e-6
    assert rel_rms(mine(out.Aqk).masked_fill(~causal, 0), ref.aqk.masked_fill(~causal, 0)) < 1e-5
    assert rel_rms(mine(out.Tm).masked_fill(~causal, 0), ref.tm) < 1e-5
    assert rel_rms(mine(W), ref.w) < 1e-5
    assert rel_rms(mine(U), ref.u) < 1e-5
    assert rel_rms(st.h.view(c.B, NT, c.HV, c.K, c.V).transpose(1, 2), states) < 1e-5
    assert rel_rms(mine(st.vn), vn) < 1e-5


@interpreter_only
def test_lowp_stage_layout():
    """The forward's bf16 storage (lowp): W, qg, U, Aqk rounded copies of the fp32 ones, kd^T per chunk
    [NT_total, HV, K, 64] == the token-major fp32 kd blocks transposed, zeros past each sequence's end;
    varlen with a sequence shorter than a chunk."""
    from kda_ops.kernels import chunk_index
    from kda_ops.kernels.fwd_intra import chunk_kda_fwd_intra
    from kda_ops.kernels.fwd_wu import chunk_kda_fwd_wu
    c = Case(B=1, T=105, H=1, HV=2, K=20, V=16, in_op=True, seqlens=[5, 70, 30], dtype=torch.bfloat16)
    (q, k, v, g, beta), kw = c.make(seed=5)
    x, opts = bundles([q, k, v, g.to(c.dtype), beta.to(c.dtype)], kw)
    idx = chunk_index(c.B, c.T, x.cu_seqlens)
    with mock.patch("torch.empty", nan_empty):
        ref, ref_kbg = chunk_kda_fwd_intra(x, opts, idx)
        low, low_kbg = chunk_kda_fwd_intra(x, opts, idx, lowp=True)
        ref_w, ref_u = chunk_kda_fwd_wu(x, opts, ref, ref_kbg, idx)
        low_w, low_u = chunk_kda_fwd_wu(x, opts, low, low_kbg, idx)
    assert not ref.kd_t and low.kd_t
    # bf16 copies of the fp32 values: the interpreter truncates (relative error < 2^-7, RMS ~3.3e-3)
    tol = 6e-3
    for name, xl, xr in (("W", low_w, ref_w), ("qg", low.qg, ref.qg), ("U", low_u, ref_u), ("Aqk", low.Aqk, ref.Aqk)):
        assert xl.dtype == torch.bfloat16 and xr.dtype == torch.float32, name
        assert rel_rms(xl, xr) < tol, (name, rel_rms(xl, xr))
    assert low.kd.shape == (idx.NT_total, c.HV, c.K, 64) and low.kd.dtype == torch.bfloat16
    assert ref.kd.shape == (c.B, c.T, c.HV, c.K) and ref.kd.dtype == torch.float32
    N, NT, index, valid = _chunk_layout(c.B, c.T, kw["cu_seqlens"], 64, "cpu")
    blocks = _pack(ref.kd, index, valid, NT, 64)                      # [N, HV, NT, 64, K], zero padded
    for n, L in enumerate(c.seqlens):
        for i_c in range(math.ceil(L / 64)):
            mine = low.kd[idx.chunk_offsets[n] + i_c].transpose(-1, -2)       # [HV, 64, K]
            assert torch.isfinite(mine).all()
            assert rel_rms(mine, blocks[n, :, i_c]) < tol, (n, i_c)
            assert (mine[:, L - 64 * i_c:] == 0).all(), (n, i_c)             # past the sequence's end


@interpreter_only
def test_varlen_chunk_layout():
    """Static chunk bound and device-built index: every real chunk once, padding programs marked N; the index
    rebuilt from its tensors is the same."""
    from kda_ops.kernels import ChunkIndex, chunk_index
    cu = torch.tensor([0, 5, 5, 133, 197, 198], dtype=torch.int32)   # lengths 5, 0, 128, 64, 1
    lay = chunk_index(1, 198, cu)
    assert torch.equal(lay.cu_seqlens, cu) and lay.cu_seqlens.dtype == torch.int32
    assert ChunkIndex.from_tensors(1, 198, lay.cu_seqlens, lay.chunk_indices, lay.chunk_offsets) == lay
    assert ChunkIndex.from_tensors(2, 198, None, None, None) == chunk_index(2, 198, None) == (2, 8, None, None, None)
    assert lay.NT_total == math.ceil(198 / 64) + 5 - 1
    real = [(n, c) for n, L in enumerate([5, 0, 128, 64, 1]) for c in range(math.ceil(L / 64))]
    got = [tuple(r) for r in lay.chunk_indices.tolist()]
    assert got[:len(real)] == real and all(n == 5 for n, _ in got[len(real):])
    assert lay.chunk_offsets.tolist() == [0, 1, 1, 3, 4]


# ---- robustness: state strides, bad cu_seqlens, non-finite values (forward, backward, decode) ----------------

def run_all(x, opts, do, dht):
    """(o, ht) of the chunked forward, the backward's gradients (GRADS order) and (o, ht) of the decode
    kernel, all with torch.empty poisoned (NaN)."""
    from kda_ops.kernels import chunk_index, chunk_kda_bwd_triton, chunk_kda_fwd_triton, recurrent_kda_triton
    B, T = x.q.shape[:2]
    with mock.patch("torch.empty", nan_empty):
        idx = chunk_index(B, T, x.cu_seqlens)
        o, ht, Aqk, Tm = chunk_kda_fwd_triton(x, opts, idx, True)
        grads = chunk_kda_bwd_triton(do, dht, x, opts, idx, (Aqk, Tm))
        ro, rht = recurrent_kda_triton(x if x.initial_state is not None
                                       else x._replace(initial_state=torch.zeros_like(ht)), opts)
    return (o, ht), grads, (ro, rht)


GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")


def robust_case(seqlens=None, B=1, T=40, seed=0):
    """fp32, K = 16 != V = 32 (a K / V mix-up cannot pass), GVA, gate in the op; inputs, kwargs, do, dht."""
    c = Case(B=B, T=T, H=1, HV=2, K=16, V=32, in_op=True, dtype=torch.float32, seqlens=seqlens)
    inputs, kw = c.make(seed=seed)
    inputs = [t.float() for t in inputs]
    gen = torch.Generator().manual_seed(seed + 1)
    N = len(seqlens) if seqlens else B
    do = torch.randn(B, T, 2, 32, generator=gen)
    dht = torch.randn(N, 2, 16, 32, generator=gen)
    return inputs, kw, do, dht


def check_vs_recurrence(inputs, kw, do, dht, x, opts, tol=2e-4):
    """Everything run_all computes for (x, opts) against autograd through the fp64 recurrence on (inputs, kw)."""
    from kda_case import reference_grads
    ref = reference_grads(inputs, kw, do, dht)
    (o, ht), grads, (ro, rht) = run_all(x, opts, do, dht)
    got = dict(o=o, ht=ht, rec_o=ro, rec_ht=rht, **{n: t for n, t in zip(GRADS, grads) if t is not None})
    for n, t in got.items():
        assert t.is_contiguous(), n
        r = ref[n.replace("rec_", "")]
        assert rel_rms(t, r) <= tol, (n, rel_rms(t, r))
    assert set(n for n in GRADS if n in ref) <= set(got)


@interpreter_only
@pytest.mark.parametrize("layout", ["v_first", "expanded", "contiguous"])
def test_state_strides(layout):
    """initial_state and dht are read through their strides: a V-first state passed as a transposed view, a
    batch-expanded h0 (stride 0); forward, backward (its recompute) and the decode kernel vs the fp64
    recurrence."""
    inputs, kw, do, dht = robust_case(B=2, T=40)
    h0 = kw["initial_state"]
    if layout == "v_first":       # [N, HV, V, K] storage, passed as its [N, HV, K, V] view
        h0_arg = h0.transpose(-1, -2).contiguous().transpose(-1, -2)
        dht_arg = dht.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert h0_arg.stride()[-2:] == (1, 16)
    elif layout == "expanded":    # one state for the whole batch, stride 0 on N
        h0 = h0[:1].expand(2, -1, -1, -1)
        kw["initial_state"] = h0.contiguous()
        h0_arg, dht_arg = h0, dht[:1].expand(2, -1, -1, -1)
        dht = dht_arg.contiguous()
    else:
        h0_arg, dht_arg = h0, dht
    x, opts = bundles(inputs, kw, initial_state=h0_arg)
    check_vs_recurrence(inputs, kw, do, dht, x, opts)
    # and dht in the same layout
    from kda_case import reference_grads
    from kda_ops.kernels import chunk_index, chunk_kda_bwd_triton
    ref = reference_grads(inputs, kw, do, dht)
    grads = chunk_kda_bwd_triton(do, dht_arg, x, opts, chunk_index(2, 40, None))
    for n, t in zip(GRADS, grads):
        assert rel_rms(t, ref[n]) <= 2e-4, (n, rel_rms(t, ref[n]))


def sanitised(cu, T):
    """What chunk_index makes of cu_seqlens values: clamped to [0, T], running maximum."""
    out, m = [], 0
    for c in cu:
        m = max(m, min(max(c, 0), T))
        out.append(m)
    return out


@interpreter_only
@pytest.mark.parametrize("cu", [[0, 20, 4000], [3, 10, 20], [0, 7, 5, 30], [-9, 25, 12, 40], [0, 40, 40]])
def test_bad_cu_seqlens(cu):
    """cu_seqlens values that do not describe a packing of T = 40 tokens: no read or write outside the tensors
    (poisoned scratch shows any read of unwritten memory), finite results, and the same answer as the recurrence
    on the sequences the sanitised values describe; tokens no sequence covers get o = 0 and zero gradients."""
    T = 40
    cs = sanitised(cu, T)
    lo, hi = cs[0], cs[-1]
    inputs, kw, do, dht = robust_case(seqlens=[T], T=T)
    N = len(cu) - 1
    gen = torch.Generator().manual_seed(7)
    kw["initial_state"] = torch.randn(N, 2, 16, 32, generator=gen)
    dht = torch.randn(N, 2, 16, 32, generator=gen)
    x, opts = bundles(inputs, kw, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    (o, ht), grads, (ro, rht) = run_all(x, opts, do, dht)
    # the reference: the covered tokens [lo, hi) as a valid packing
    from kda_case import reference_grads
    sub = [t[:, lo:hi] for t in inputs]
    ref = reference_grads(sub, dict(kw, cu_seqlens=torch.tensor([c - lo for c in cs], dtype=torch.int32)),
                          do[:, lo:hi], dht)
    def full(r, t):   # reference on [lo, hi), zero elsewhere  # noqa: E306
        z = torch.zeros_like(t, dtype=torch.float64)
        z[:, lo:hi] = r
        return z
    got = dict(o=o, ht=ht, rec_o=ro, rec_ht=rht, **dict(zip(GRADS, grads)))
    for n, t in got.items():
        assert torch.isfinite(t).all(), n
        r = ref[n.replace("rec_", "")]
        if n in ("o", "rec_o", "dq", "dk", "dv", "dg", "dbeta"):
            r = full(r, t)
            assert (t[:, :lo] == 0).all() and (t[:, hi:] == 0).all(), n
        assert rel_rms(t, r) <= 2e-4, (n, rel_rms(t, r))


TOKEN_OUTS = ("o", "rec_o", "dq", "dk", "dv", "dg", "dbeta")     # [B, T, ...]; the rest are per sequence


def results(x, opts, do, dht):
    (o, ht), grads, (ro, rht) = run_all(x, opts, do, dht)
    return dict(o=o, ht=ht, rec_o=ro, rec_ht=rht, **{n: t for n, t in zip(GRADS, grads) if t is not None})


@interpreter_only
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
@pytest.mark.parametrize("packed", [True, False], ids=["varlen", "batch"])
def test_nan_stays_in_its_sequence(name, packed):
    """A NaN in one sequence (packed, or a batch row) leaves every output, state and gradient of the other
    sequence bitwise as in the clean run (dA_log / ddt_bias are sums over all sequences: not compared)."""
    if packed:
        inputs, kw, do, dht = robust_case(seqlens=[40, 30], T=70)
        rows, t_bad = (slice(None), slice(0, 40)), (0, 50)       # sequence 0 = tokens [0, 40)
    else:
        inputs, kw, do, dht = robust_case(B=2, T=40)
        rows, t_bad = (0, slice(None)), (1, 10)
    x, opts = bundles(inputs, kw)
    clean = results(x, opts, do, dht)
    bad = [t.clone() for t in inputs]
    bad["q k v g beta".split().index(name)][t_bad] = float("nan")
    got = results(bundles(bad, kw)[0], opts, do, dht)
    for n, t in got.items():
        if n in TOKEN_OUTS:
            assert torch.equal(t[rows], clean[n][rows]), n
        elif n not in ("dA_log", "ddt_bias"):
            assert torch.equal(t[0], clean[n][0]), n                 # sequence 0's state / dh0
    assert torch.isnan(got["o"]).any()                               # the NaN did reach its own sequence


@interpreter_only
@pytest.mark.parametrize("seqlens", [None, [40, 30]])
def test_full_decay_g_minus_inf(seqlens):
    """g = -inf (a full reset, gate not in the op) on some key channels and on every channel of one head:
    the recurrence's answer (forward, backward, decode), not NaN."""
    c = Case(B=1, T=70, H=1, HV=2, K=16, V=32, dtype=torch.float32, seqlens=seqlens)
    inputs, kw = c.make(seed=2)
    inputs = [t.float() for t in inputs]
    for t in (5, 30, 45, 64):
        inputs[3][0, t, :, :5] = float("-inf")
    inputs[3][0, 20, 1, :] = float("-inf")
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(1, 70, 2, 32, generator=gen)
    dht = torch.randn(len(seqlens) if seqlens else 1, 2, 16, 32, generator=gen)
    x, opts = bundles(inputs, kw)
    check_vs_recurrence(inputs, kw, do, dht, x, opts, tol=5e-5)


@interpreter_only
def test_safe_gate_at_its_bound():
    """lower_bound = -5 with the in-op l2norm: the forward intra kernel takes each 32-row half of a chunk in one
    factored dot per operand (fwd_intra.diagonal_rows), its factors up to 2^111.8 when every step sits at the bound.
    Raw g = 1e4 (each step exactly lower_bound) on half the channels of every token, and on every channel of a
    40-token run; forward and backward against the fp64 recurrence, varlen with a partial chunk."""
    from kda_ops.kernels.fwd_intra import diagonal_rows
    c = Case(B=1, T=150, H=1, HV=2, K=32, V=16, in_op=True, lower_bound=-5.0, dtype=torch.float32,
             seqlens=[100, 50])
    inputs, kw = c.make(seed=8)
    inputs = [t.float() for t in inputs]
    inputs[3][0, :, :, :16] = 1e4
    inputs[3][0, 10:50] = 1e4
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(1, 150, 2, 16, generator=gen)
    dht = torch.randn(2, 2, 32, 16, generator=gen)
    x, opts = bundles(inputs, kw)
    assert diagonal_rows(opts) == 32
    check_vs_recurrence(inputs, kw, do, dht, x, opts, tol=5e-5)


@interpreter_only
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lb"])
def test_raw_gate_plus_inf(lower_bound):
    """Raw g = +inf through the in-op gate: with softplus a full reset (the activated gate is -inf, floored),
    with lower_bound a saturated step (lower_bound sigmoid(inf) = lower_bound). Forward, backward and decode
    give the recurrence's answer, taken (autograd would form 0 * inf in dA_log) on the same inputs with 1e4 in
    place of inf: the same forward in float64, and exactly zero gradient through those steps."""
    c = Case(B=1, T=70, H=1, HV=2, K=16, V=32, in_op=True, lower_bound=lower_bound, dtype=torch.float32,
             seqlens=[40, 30])
    inputs, kw = c.make(seed=5)
    inputs = [t.float() for t in inputs]
    finite = [t.clone() for t in inputs]
    for ins, big in ((inputs, float("inf")), (finite, 1e4)):
        for t in (5, 30, 45, 64):
            ins[3][0, t, :, :5] = big
        ins[3][0, 20, 1, :] = big
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(1, 70, 2, 32, generator=gen)
    dht = torch.randn(2, 2, 16, 32, generator=gen)
    x, opts = bundles(inputs, kw)
    check_vs_recurrence(finite, kw, do, dht, x, opts, tol=5e-5)


@interpreter_only
def test_gate_floor_16bit():
    """bf16 with the in-op gate and l2norm: each step's activated log decay is floored at common.G_MIN_16BIT (a
    decay factor of 2^-14.9), which keeps every 16-row block within twice SPAN_UNIT, so the forward intra kernel is
    built without its test of the 16-row blocks and without the exact path. A = 15 - 16 with raw g = 10 (about 160
    nats per step) on half the channels and raw g ~ N(0, 1) (about 0 - 50 nats) on the rest, varlen: forward,
    backward and decode against the fp64 recurrence of the unfloored gate, and dg exactly zero where the floor
    applied (the gradient of the floored forward)."""
    import torch.nn.functional as F
    from kda_case import reference_grads
    from kda_ops.kernels.common import G_MIN_16BIT, SPAN_UNIT, bounded_gate, gate_floor
    c = Case(B=1, T=150, H=1, HV=2, K=32, V=16, in_op=True, a_log_range=(2.7, 2.8), dtype=torch.bfloat16,
             seqlens=[100, 50])
    inputs, kw = c.make(seed=12)
    inputs[3][0, :, :, :16] = 10.0
    gen = torch.Generator().manual_seed(13)
    do = torch.randn(1, 150, 2, 16, generator=gen).to(torch.bfloat16)
    dht = torch.randn(2, 2, 32, 16, generator=gen)
    x, opts = bundles(inputs, kw)
    floor = gate_floor(opts, torch.bfloat16)
    assert floor == G_MIN_16BIT.value and bounded_gate(opts, SPAN_UNIT, 7.5, floor)
    assert gate_floor(opts, torch.float32) < floor
    ref = reference_grads(inputs, kw, do, dht)
    (o, ht), grads, (ro, rht) = run_all(x, opts, do, dht)
    got = dict(o=o, ht=ht, rec_o=ro, rec_ht=rht, **{n: t for n, t in zip(GRADS, grads) if t is not None})
    for n, t in got.items():
        assert torch.isfinite(t).all(), n
        assert rel_rms(t, ref[n.replace("rec_", "")]) <= 3e-2, (n, rel_rms(t, ref[n.replace("rec_", "")]))
    g_act = -kw["A_log"].double().exp()[:, None] * F.softplus(inputs[3].double() + kw["dt_bias"].double().view(2, 32))
    floored = g_act < floor
    assert 0.5 < floored.double().mean() < 0.9
    assert (grads[GRADS.index("dg")][floored] == 0).all() and (grads[GRADS.index("dg")][~floored] != 0).any()


# ---- causality of non-finite values inside a chunk ---------------------------------------------------------
# H = 1, HV = 2 (GVA: key head 0 feeds both value heads). Two sequences; the bad token sits in the second one:
# "chunk0": T = 40, cu_seqlens [0, 17, 40], token 30 = row 13 of the sequence's only chunk;
# "chunk1": T = 110, cu_seqlens [0, 10, 110], token 103 = row 29 of the sequence's second chunk.
# The intra stage factors the products of a block's rows around a reference taken from the block's last row (its
# 32-row half where both halves of the chunk pass the wide test, as these small gates do; else its 16-row block),
# so a bad gate (a zero log decay) changes the rounding of the rows of its block before it: those are
# compared within rounding, every earlier row bitwise. BLOCK_START: the first token of the bad token's 32-row half.
CAUSAL_LAYOUTS = {"chunk0": ([17, 23], 30), "chunk1": ([10, 100], 103)}
BLOCK_START = {"chunk0": 17 + 0, "chunk1": 10 + 64}
# (input, value, [batch, token, head, channel] index without the token, value heads it reaches)
NONFINITE = [("q", "nan", (0, 0, 3), (0, 1)), ("k", "nan", (0, 0, 5), (0, 1)), ("k", "inf", (0, 0, 2), (0, 1)),
             ("v", "nan", (0, 1, 7), (1,)), ("v", "inf", (0, 1, 0), (1,)), ("g", "nan", (0, 1, 4), (1,)),
             ("beta", "nan", (0, 1), (1,))]


def causal_case(layout, in_op, seed=4):
    seqlens, t_bad = CAUSAL_LAYOUTS[layout]
    c = Case(B=1, T=sum(seqlens), H=1, HV=2, K=16, V=32, in_op=in_op, dtype=torch.float32, seqlens=seqlens)
    inputs, kw = c.make(seed=seed)
    return [t.float() for t in inputs], kw, seqlens, t_bad


def plant(inputs, name, index, t, value):
    """A copy of inputs with inputs[name][index with token t] = value."""
    out = [x.clone() for x in inputs]
    b, *rest = index
    out["q k v g beta".split().index(name)][(b, t, *rest)] = value
    return out


def fwd(inputs, kw):
    from kda_ops.kernels import chunk_index, chunk_kda_fwd_triton
    x, opts = bundles(inputs, kw)
    with mock.patch("torch.empty", nan_empty):
        o, ht, _, _ = chunk_kda_fwd_triton(x, opts, chunk_index(1, x.q.shape[1], x.cu_seqlens), True)
    return o, ht


@interpreter_only
@pytest.mark.parametrize("layout", list(CAUSAL_LAYOUTS))
@pytest.mark.parametrize("in_op", [True, False], ids=["inop", "plain"])
def test_nonfinite_causal_in_chunk(layout, in_op):
    """A NaN / inf at token t in k, v, g or beta of the second sequence (gate, l2norm, beta sigmoid in the op or
    not): o before t bitwise as in the clean run (a bad gate: before t's 32-row half; in the half, within
    rounding); o of the value heads it reaches NaN from t to the sequence's end; their final state of that
    sequence NaN; everything else (the other heads, the first sequence and its final state) bitwise clean.
    q (control): only o at t. g = -inf without the in-op gate: a full reset, finite."""
    inputs, kw, seqlens, t = causal_case(layout, in_op)
    end = sum(seqlens)
    o0, ht0 = fwd(inputs, kw)
    assert torch.isfinite(o0).all() and torch.isfinite(ht0).all()
    for name, value, index, heads in NONFINITE:
        o, ht = fwd(plant(inputs, name, index, t, float(value)), kw)
        what = f"{name}={value}"
        s = BLOCK_START[layout] if name == "g" else t
        assert torch.equal(o[:, :s], o0[:, :s]), what
        assert torch.allclose(o[:, s:t], o0[:, s:t], rtol=1e-5, atol=1e-6), what
        other = [h for h in range(2) if h not in heads]
        assert torch.equal(o[..., other, :], o0[..., other, :]), what
        assert torch.equal(ht[0], ht0[0]) and torch.equal(ht[1, other], ht0[1, other]), what
        if name == "q":
            assert torch.isnan(o[:, t, list(heads)]).all(), what
            assert torch.equal(o[:, t + 1:], o0[:, t + 1:]) and torch.equal(ht, ht0), what
        else:
            assert torch.isnan(o[:, t:end, list(heads)]).all(), what
            assert torch.isnan(ht[1, list(heads)]).all(), what
    if not in_op:   # -inf gate: valid (a full reset), not an invalid row
        o, ht = fwd(plant(inputs, "g", (0, 1, 4), t, float("-inf")), kw)
        assert torch.isfinite(o).all() and torch.isfinite(ht).all()
        # (not bitwise: the reset's span sends the intra stage's K-block down its exact path)
        assert torch.allclose(o[:, :t], o0[:, :t], rtol=0, atol=1e-5)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_negative_zeros_are_valid(dtype):
    """-0.0 and tiny negative keys are valid: W's operand kbg marks an invalid element -0.0 (fwd_intra.py), so a
    valid product beta k exp2(gam) that is -0.0, or rounds to it in bf16, must not read as a mark. A k row of
    -0.0 and keys of -1e-39 / -1e-44 (denormal products) give the recurrence's answer, finite (no NaN rows)."""
    c = Case(B=1, T=70, H=1, HV=2, K=16, V=16, dtype=dtype)
    (q, k, v, g, beta), kw = c.make(seed=7)
    k = k.clone()
    k[0, 10] = -0.0
    k[0, 40, :, :8] = -1e-39
    k[0, 66, :, 3] = -1e-44
    o, ht = fwd([q, k, v, g.to(dtype), beta.to(dtype)], kw)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    d = lambda x: x.double()  # noqa: E731
    ro, rht = naive_recurrent_kda(d(q), d(k), d(v), d(g), d(beta), scale=c.K ** -0.5,
                                  **{n: d(x) if isinstance(x, torch.Tensor) else x for n, x in kw.items()})
    assert rel_rms(o, ro) <= TOL[dtype] and rel_rms(ht, rht) <= TOL[dtype]


@interpreter_only
@pytest.mark.parametrize("in_op", [True, False], ids=["inop", "plain"])
def test_nan_gate_replaced_by_zero(in_op):
    """An invalid gate row counts as a zero log decay: without the in-op gate, o before the bad token is bitwise
    that of the run with g = 0 there, even with the bad row before the middle of its 16-row block (chunk row 3);
    with the gate in the op, a bad dt_bias channel makes the whole head's rows invalid from the start."""
    inputs, kw, seqlens, _ = causal_case("chunk0", in_op)
    t = 17 + 3
    if in_op:
        kw = dict(kw, dt_bias=kw["dt_bias"].clone())
        kw["dt_bias"][16 + 4] = float("nan")          # value head 1, channel 4
        o, ht = fwd(inputs, kw)
        assert torch.isnan(o[..., 1, :]).all() and torch.isnan(ht[:, 1]).all()
        assert torch.isfinite(o[..., 0, :]).all() and torch.isfinite(ht[:, 0]).all()
        return
    o0, ht0 = fwd(plant(inputs, "g", (0, 1, 4), t, 0.0), kw)
    o, ht = fwd(plant(inputs, "g", (0, 1, 4), t, float("nan")), kw)
    assert torch.equal(o[:, :t], o0[:, :t]) and torch.equal(o[..., 0, :], o0[..., 0, :])
    assert torch.isnan(o[:, t:, 1]).all() and torch.isnan(ht[1, 1]).all() and torch.equal(ht[0], ht0[0])


@interpreter_only
@pytest.mark.parametrize("lower_bound", [None, -3.0])
@pytest.mark.parametrize("a_log", [float("nan"), float("inf"), 100.0])
def test_gate_scale_not_finite(a_log, lower_bound):
    """An A_log whose exp is not a normal number on value head 1 (the W/U kernel then tests the activated gate,
    not g + dt_bias): the rows whose activated gate is NaN make that head's o NaN from the first of them on
    (with NaN, every row); head 0 and the first sequence stay bitwise as in the clean run."""
    inputs, kw, seqlens, _ = causal_case("chunk0", True)
    kw = dict(kw, lower_bound=lower_bound)
    o0, ht0 = fwd(inputs, kw)
    kw["A_log"] = kw["A_log"].clone()
    kw["A_log"][1] = a_log
    o, ht = fwd(inputs, kw)
    assert torch.equal(o[..., 0, :], o0[..., 0, :]) and torch.equal(ht[:, 0], ht0[:, 0])
    g = inputs[3][0, :, 1].double() + kw["dt_bias"].view(2, -1)[1].double()
    a = torch.tensor(a_log, dtype=torch.float64).exp()
    act = (lower_bound * torch.sigmoid(a * g) if lower_bound is not None
           else -a * torch.where(g > 20, g, torch.log1p(torch.exp(g))))
    for n, (s, e) in enumerate(zip([0, seqlens[0]], [seqlens[0], sum(seqlens)])):
        bad = act[s:e].isnan().any(-1).nonzero()
        f = s + int(bad[0]) if len(bad) else e
        assert torch.isnan(o[0, f:e, 1]).all() and torch.isfinite(o[0, s:f, 1]).all(), (n, f)
        assert torch.isnan(ht[n, 1]).all() == (f < e), n


@interpreter_only
@pytest.mark.parametrize("layout", list(CAUSAL_LAYOUTS))
@pytest.mark.parametrize("in_op", [True, False], ids=["inop", "plain"])
@pytest.mark.parametrize("name", ["k", "v", "g", "beta"])
def test_nan_backward_not_finite(name, in_op, layout):
    """Backward (recompute, and with the forward's saved Aqk, Tm) with a NaN at token t of the second sequence:
    every gradient entry that autograd through the fp64 recurrence makes NaN (for k, g, beta: dk, dv, dg, dbeta
    at tokens <= t, dh0 of the sequence; dq from t on) is not finite here either (more NaN entries than the
    recurrence's are allowed); the first sequence's gradients and dh0 stay bitwise those of the clean run."""
    from kda_case import reference_grads
    from kda_ops.kernels import chunk_index, chunk_kda_bwd_triton, chunk_kda_fwd_triton
    inputs, kw, seqlens, t = causal_case(layout, in_op)
    T = sum(seqlens)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(1, T, 2, 32, generator=gen)
    dht = torch.randn(2, 2, 16, 32, generator=gen)
    index = dict(k=(0, 0, 5), v=(0, 1, 7), g=(0, 1, 4), beta=(0, 1))[name]
    bad = plant(inputs, name, index, t, float("nan"))

    def grads(ins, saved):
        x, opts = bundles(ins, kw)
        idx = chunk_index(1, T, x.cu_seqlens)
        with mock.patch("torch.empty", nan_empty):
            fw = chunk_kda_fwd_triton(x, opts, idx, False)[2:] if saved else None
            return dict(zip(GRADS, chunk_kda_bwd_triton(do, dht, x, opts, idx, fw)))

    clean = grads(inputs, False)
    ref = reference_grads(bad, kw, do, dht)
    n0 = seqlens[0]
    for saved in (False, True):
        got = grads(bad, saved)
        for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
            r, x = ref[n], got[n]
            assert not torch.isfinite(x[~torch.isfinite(r)]).any(), (n, saved)
            first = (slice(None), slice(0, n0)) if n != "dh0" else (0,)
            assert torch.equal(x[first], clean[n][first]), (n, saved)
        # the recurrence's pattern (a sanity check of the test): for k, g, beta (the transition's coefficients)
        # NaN up to t in the second sequence and in its dh0; for v (not in the transition) from t on only
        if name == "v":
            assert torch.isnan(ref["dbeta"][0, t, 1]) and torch.isfinite(ref["dh0"]).all()
        else:
            assert not torch.isfinite(ref["dk"][0, n0:t + 1]).any() and torch.isnan(ref["dh0"][1]).any()


@pytest.mark.skipif(INTERPRET, reason="this is the launcher of the interpreter run")
def test_interpreter_suite():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    # every interpreter case ran (only this launcher is skipped there)
    count = len(CASES) + 10 + 3 + 3 + 3 + 5 + 10 + 2 + 1 + 2 + 4 + 2 + 2 + 6 + 16 + 1
    assert f"{count} passed" in r.stdout, r.stdout[-2000:]
