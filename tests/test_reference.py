"""The chunked torch implementation (CPU path of the ops) against the recurrence, in float64."""
import pytest
import torch

from handwritten import hw_beta, hw_gate, hw_kda, hw_l2norm
from kda_case import Case, gen, reference_grads, rel_rms
from kda_ops.options import KDAInputs, KDAOptions
from kda_ops.reference import chunk_kda_bwd_torch, chunk_kda_fwd_torch, naive_recurrent_kda, preprocess

CASES = [
    Case(B=2, T=1, K=16, V=16),
    Case(B=2, T=63, K=20, V=16),
    Case(B=1, T=64, K=64, V=64),
    Case(B=2, T=65, K=16, V=20),
    Case(B=1, T=130, H=2, HV=4, K=20, V=20),
    Case(B=2, T=130, H=1, HV=2, K=16, V=16, initial_state=False),
    Case(B=2, T=65, K=20, V=16, in_op=True),
    Case(B=1, T=130, H=1, HV=2, K=16, V=20, in_op=True, lower_bound=-5.0),
    Case(B=2, T=63, K=16, V=16, in_op=True, lower_bound=-1.0, allow_neg_eigval=True),
    Case(B=1, T=1 + 63 + 64 + 65 + 3, K=16, V=16, seqlens=[1, 63, 64, 65, 3]),
    Case(B=1, T=200, H=1, HV=2, K=20, V=16, seqlens=[130, 5, 65], in_op=True),
]


def _op_args(inputs, kw, scale=None):
    """(KDAInputs, KDAOptions) of a case, as ops.py builds them."""
    k = inputs[0].shape[-1]
    x = KDAInputs(*inputs, kw.get("A_log"), kw.get("dt_bias"), kw.get("initial_state"), kw.get("cu_seqlens"))
    opts = KDAOptions(k ** -0.5 if scale is None else scale, kw.get("lower_bound"),
                      kw.get("use_qk_l2norm_in_kernel", False), kw.get("use_gate_in_kernel", False),
                      kw.get("use_beta_sigmoid_in_kernel", False), kw.get("allow_neg_eigval", False))
    return x, opts


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_chunked_forward_matches_recurrence(case):
    inputs, kw = case.make()
    o_ref, ht_ref = naive_recurrent_kda(*inputs, **kw)
    o, ht = chunk_kda_fwd_torch(*_op_args(inputs, kw), True)
    assert rel_rms(o, o_ref) < 1e-12
    assert rel_rms(ht, ht_ref) < 1e-12


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_hand_derived_backward_matches_autograd(case):
    inputs, kw = case.make()
    o, ht = naive_recurrent_kda(*inputs, **kw)
    g = gen(1)
    do, dht = torch.randn(o.shape, generator=g, dtype=o.dtype), torch.randn(ht.shape, generator=g, dtype=ht.dtype)
    ref = reference_grads(inputs, kw, do, dht)
    dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = chunk_kda_bwd_torch(do, dht, *_op_args(inputs, kw))
    got = dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dA_log=dA_log, ddt_bias=ddt_bias, dh0=dh0)
    for name, want in ref.items():
        if name in ("o", "ht"):
            continue
        assert got[name] is not None, name
        assert rel_rms(got[name], want) < 1e-10, name
    assert (dh0 is None) == ("initial_state" not in kw)


def test_varlen_equals_per_sequence_loop():
    case = Case(B=1, T=140, H=1, HV=2, K=16, V=16, seqlens=[70, 1, 64, 5], in_op=True)
    inputs, kw = case.make()
    o, ht = chunk_kda_fwd_torch(*_op_args(inputs, kw), True)
    cu = kw["cu_seqlens"].tolist()
    for n in range(len(cu) - 1):
        sl = slice(cu[n], cu[n + 1])
        seq_kw = dict(kw, cu_seqlens=None, initial_state=kw["initial_state"][n:n + 1])
        o_n, ht_n = chunk_kda_fwd_torch(*_op_args([x[:, sl] for x in inputs], seq_kw), True)
        torch.testing.assert_close(o[:, sl], o_n, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ht[n:n + 1], ht_n, rtol=1e-12, atol=1e-12)


def test_state_carries_across_calls():
    """Two halves with the state handed over == one call on the whole sequence."""
    inputs, kw = Case(B=2, T=100, K=16, V=20, in_op=True).make()
    o, ht = naive_recurrent_kda(*inputs, **kw)
    first = [x[:, :37] for x in inputs]
    second = [x[:, 37:] for x in inputs]
    o1, h1 = chunk_kda_fwd_torch(*_op_args(first, kw), True)
    o2, h2 = chunk_kda_fwd_torch(*_op_args(second, dict(kw, initial_state=h1)), True)
    assert rel_rms(torch.cat([o1, o2], 1), o) < 1e-12
    assert rel_rms(h2, ht) < 1e-12


def test_fp32_chunked_close_to_fp64_recurrence():
    inputs, kw = Case(B=2, T=130, H=2, HV=4, K=64, V=64, in_op=True, dtype=torch.float32).make()
    kw32 = {n: (x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in kw.items()}
    o, ht = chunk_kda_fwd_torch(*_op_args([x.float() for x in inputs], kw32), True)
    o_ref, ht_ref = naive_recurrent_kda(*[x.double() for x in inputs], **kw)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    assert rel_rms(o, o_ref) < 1e-5
    assert rel_rms(ht, ht_ref) < 1e-5


# ----------------------------------------------------------------------------------------------
# The reference's own pieces against tests/handwritten.py (written from the docstrings' formulas), so that
# a bug in preprocess or naive_recurrent_kda is not hidden by the chunked path sharing it.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lower_bound", [None, -5.0, -0.5], ids=["softplus", "lb-5", "lb-0.5"])
@pytest.mark.parametrize("allow_neg_eigval", [False, True], ids=["pos", "neg"])
def test_preprocess_matches_handwritten(lower_bound, allow_neg_eigval):
    g = gen(11)
    q, k = torch.randn(2, 5, 2, 8, generator=g, dtype=torch.float64).unbind(0)
    graw = 2 * torch.randn(1, 5, 4, 8, generator=g, dtype=torch.float64)
    beta = 3 * torch.randn(1, 5, 4, generator=g, dtype=torch.float64)
    A_log = torch.randn(4, generator=g, dtype=torch.float64)
    dt_bias = torch.randn(32, generator=g, dtype=torch.float64)
    q = q[None] * torch.tensor([1e-4, 1.0, 30.0, 1.0, 1.0], dtype=torch.float64)[None, :, None, None]
    got = preprocess(q, k[None], graw, beta, A_log, dt_bias, lower_bound, True, True, True, allow_neg_eigval)
    want = (hw_l2norm(q), hw_l2norm(k[None]), hw_gate(graw, A_log, dt_bias, lower_bound),
            hw_beta(beta, allow_neg_eigval))
    for name, a, b in zip(("q", "k", "g", "beta"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0, msg=name)
    # without dt_bias, and the bounded gate without A_log
    torch.testing.assert_close(preprocess(q, q, graw, beta, A_log, None, lower_bound, False, True)[2],
                               hw_gate(graw, A_log, None, lower_bound), rtol=1e-13, atol=0)
    if lower_bound is not None:
        torch.testing.assert_close(preprocess(q, q, graw, beta, None, dt_bias, lower_bound, False, True)[2],
                                   hw_gate(graw, None, dt_bias, lower_bound), rtol=1e-13, atol=0)


NAIVE_CASES = [
    (Case(B=2, T=9, H=1, HV=2, K=6, V=10), 0.37),
    (Case(B=1, T=9, H=2, HV=4, K=8, V=5, in_op=True, lower_bound=-3.0, allow_neg_eigval=True), None),
    (Case(B=1, T=12, H=1, HV=2, K=5, V=7, seqlens=[0, 4, 1, 7], in_op=True), 1.7),
]


@pytest.mark.parametrize("case,scale", NAIVE_CASES, ids=[c.id + f"-scale{s}" for c, s in NAIVE_CASES])
def test_naive_recurrence_matches_handwritten(case, scale):
    inputs, kw = case.make(seed=case.seed)
    o, ht = naive_recurrent_kda(*inputs, scale=scale, **kw)
    o_ref, ht_ref = hw_kda(*inputs, scale=scale, **kw)
    assert rel_rms(o, o_ref) < 1e-12
    assert rel_rms(ht, ht_ref) < 1e-12


@pytest.mark.parametrize("case", [CASES[3], Case(B=1, T=70, H=1, HV=2, K=12, V=8, seqlens=[5, 65], in_op=True)],
                         ids=lambda c: c.id)
def test_chunked_with_a_scale_of_its_own(case):
    """The chunked forward and backward at a non-default scale, against the recurrence at the same scale."""
    inputs, kw = case.make(seed=case.seed)
    o_ref, ht_ref = naive_recurrent_kda(*inputs, scale=0.3, **kw)
    o, ht = chunk_kda_fwd_torch(*_op_args(inputs, kw, 0.3), True)
    assert rel_rms(o, o_ref) < 1e-12 and rel_rms(ht, ht_ref) < 1e-12
    g = gen(2)
    do, dht = torch.randn(o.shape, generator=g, dtype=o.dtype), torch.randn(ht.shape, generator=g, dtype=ht.dtype)
    ref = reference_grads(inputs, dict(kw, scale=0.3), do, dht)
    got = dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"),
                   chunk_kda_bwd_torch(do, dht, *_op_args(inputs, kw, 0.3))))
    for name, want in ref.items():
        if name not in ("o", "ht"):
            assert rel_rms(got[name], want) < 1e-10, name
