"""The public functions on CPU (kda_ops.chunk_kda: the torch implementation at the op's chunk size;
kda_ops.recurrent_kda) against tests/handwritten.py, in float64: outputs, final states and the gradients of
every input. K != V everywhere, so a scale taken from V shows; scales other than the default are passed;
both gate forms, the beta sigmoid with and without allow_neg_eigval; packed sequences of lengths around the
chunk size, against each sequence run alone."""
import pytest
import torch

import kda_ops
from handwritten import hw_kda
from kda_case import Case, gen, rel_rms

VAL_TOL, GRAD_TOL = 1e-11, 1e-10        # float64; the errors reached are ~1e-15

# (case, scale, drop A_log / dt_bias): scale None is the default, K ** -0.5
CHUNK_CASES = [
    (Case(B=2, T=37, H=1, HV=2, K=12, V=20), 0.37, False),
    (Case(B=1, T=33, H=2, HV=2, K=8, V=12, in_op=True), None, False),
    (Case(B=1, T=20, H=1, HV=2, K=12, V=6, in_op=True, lower_bound=-2.0, allow_neg_eigval=True), 1.3, False),
    (Case(B=2, T=17, H=1, HV=1, K=6, V=10, in_op=True, lower_bound=-5.0, initial_state=False), None, True),
]
VARLEN = Case(B=1, T=149, H=1, HV=2, K=8, V=12, seqlens=[0, 15, 16, 17, 50, 51], in_op=True)


def _id(p):
    case, scale, drop = p
    return case.id + f"-scale{scale}" + ("-noparams" if drop else "")


def _leaves(case, drop=False):
    """Float64 leaves: (q, k, v, g, beta) and a dict of the keyword tensors (A_log, dt_bias, initial_state)."""
    inputs, kw = case.make(seed=case.seed)
    if drop:
        kw.pop("A_log")
        kw.pop("dt_bias")
    inputs = [x.double().requires_grad_() for x in inputs]
    for name in ("A_log", "dt_bias", "initial_state"):
        if kw.get(name) is not None:
            kw[name] = kw[name].double().requires_grad_()
    return inputs, kw


def _grads(o, ht, leaves, seed):
    g = gen(seed)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=g, dtype=torch.float64)
    loss = (o * do).sum() + (ht * dht).sum()
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def _all_leaves(inputs, kw):
    names = ["q", "k", "v", "g", "beta"] + [n for n in ("A_log", "dt_bias", "initial_state") if kw.get(n) is not None]
    return names, list(inputs) + [kw[n] for n in names[5:]]


def _compare(got, want, names):
    for name, a, b in zip(names, got, want):
        assert a is not None and b is not None, name
        assert a.dtype == b.dtype, name
        err = rel_rms(a, b)
        assert err < GRAD_TOL, f"d{name}: {err:.2e}"


@pytest.mark.parametrize("p", CHUNK_CASES, ids=_id)
def test_chunk_kda_matches_handwritten(p):
    case, scale, drop = p
    inputs, kw = _leaves(case, drop)
    names, leaves = _all_leaves(inputs, kw)
    o, ht = kda_ops.chunk_kda(*inputs, scale=scale, **kw)
    o_ref, ht_ref = hw_kda(*inputs, scale=scale, **kw)
    assert rel_rms(o, o_ref) < VAL_TOL
    assert rel_rms(ht, ht_ref) < VAL_TOL
    _compare(_grads(o, ht, leaves, case.seed + 1), _grads(o_ref, ht_ref, leaves, case.seed + 1), names)


def test_default_scale_is_k_to_the_minus_half():
    case = CHUNK_CASES[1][0]
    inputs, kw = case.make(seed=case.seed)
    assert case.K != case.V
    o_default, _ = kda_ops.chunk_kda(*inputs, **kw)
    o_k, _ = kda_ops.chunk_kda(*inputs, scale=case.K ** -0.5, **kw)
    torch.testing.assert_close(o_default, o_k, rtol=0, atol=0)
    kw.pop("output_final_state")
    r_default, _ = kda_ops.recurrent_kda(*inputs, **kw)
    r_k, _ = kda_ops.recurrent_kda(*inputs, scale=case.K ** -0.5, **kw)
    torch.testing.assert_close(r_default, r_k, rtol=0, atol=0)


@pytest.mark.parametrize("scale", [None, 0.6], ids=["scale_default", "scale0.6"])
def test_varlen_chunk_kda_equals_each_sequence_alone(scale):
    """Packed sequences of lengths 0, 15, 16, 17, 50, 51 (the op's CPU chunk size is 16) through the public
    op == the recurrence run on each sequence alone: outputs, final states and all gradients."""
    inputs, kw = _leaves(VARLEN)
    names, leaves = _all_leaves(inputs, kw)
    o, ht = kda_ops.chunk_kda(*inputs, scale=scale, **kw)
    cu = kw["cu_seqlens"].tolist()
    o_parts, ht_parts = [], []
    for n in range(len(cu) - 1):
        sl = slice(cu[n], cu[n + 1])
        seq_kw = dict(kw, cu_seqlens=None, initial_state=kw["initial_state"][n:n + 1])
        o_n, ht_n = hw_kda(*[x[:, sl] for x in inputs], scale=scale, **seq_kw)
        assert rel_rms(o[:, sl], o_n) < VAL_TOL if o_n.numel() else True
        assert rel_rms(ht[n:n + 1], ht_n) < VAL_TOL, f"final state of sequence {n}"
        o_parts.append(o_n)
        ht_parts.append(ht_n)
    o_ref, ht_ref = torch.cat(o_parts, 1), torch.cat(ht_parts, 0)
    assert rel_rms(o, o_ref) < VAL_TOL
    _compare(_grads(o, ht, leaves, 7), _grads(o_ref, ht_ref, leaves, 7), names)

# ----------------------------------------------------------------------------------------------
# recurrent_kda: on CPU it runs reference.naive_recurrent_kda, so it is checked against handwritten.py
# (inference only: the op has no backward).
# ----------------------------------------------------------------------------------------------
RECURRENT_CASES = [
    (Case(B=2, T=3, H=1, HV=2, K=12, V=20), 0.37),
    (Case(B=2, T=2, H=2, HV=4, K=8, V=12, in_op=True), None),
    (Case(B=1, T=4, H=1, HV=2, K=12, V=6, in_op=True, lower_bound=-2.0, allow_neg_eigval=True), 1.3),
    (Case(B=1, T=6, H=1, HV=2, K=6, V=10, seqlens=[0, 1, 3, 2], in_op=True), 0.8),
    (Case(B=2, T=1, H=1, HV=1, K=10, V=4, in_op=True, initial_state=False, dtype=torch.float32), None),
]


@pytest.mark.parametrize("case,scale", RECURRENT_CASES, ids=[c.id + f"-scale{s}" for c, s in RECURRENT_CASES])
def test_recurrent_kda_matches_handwritten(case, scale):
    inputs, kw = case.make(seed=case.seed)
    kw.pop("output_final_state")
    o, ht = kda_ops.recurrent_kda(*inputs, scale=scale, **kw)
    o_ref, ht_ref = hw_kda(*inputs, scale=scale, **kw)
    tol = VAL_TOL if case.dtype == torch.float64 else 1e-5
    assert o.dtype == inputs[2].dtype
    assert rel_rms(o, o_ref) < tol
    assert rel_rms(ht, ht_ref) < tol


def test_op_choice_training_vs_inference():
    """A call that needs gradients runs the private training op (it keeps the forward's intermediates for the
    backward); one that does not runs the stable op that exported graphs hold."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "kda_ops":
                self.seen.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    q, k, v, gg = (torch.randn(1, 20, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    beta = torch.rand(1, 20, 2, generator=g, dtype=torch.float64)
    gg = -gg.abs()
    with Ops() as m:
        kda_ops.chunk_kda(q, k, v, gg, beta)
    assert "chunk_kda_v1" in m.seen and "_chunk_kda_fwd" not in m.seen, m.seen
    with Ops() as m:
        kda_ops.chunk_kda(q.requires_grad_(), k, v, gg, beta)
    assert "_chunk_kda_fwd" in m.seen and "chunk_kda_v1" not in m.seen, m.seen
    with torch.no_grad(), Ops() as m:
        kda_ops.chunk_kda(q, k, v, gg, beta)
    assert "chunk_kda_v1" in m.seen, m.seen


# ---- which eager calls may skip the dispatcher (ops._plain_eager; on CUDA, ops._plain_eager_cuda) -----------
def _eager_inputs(param_requires_grad=True):
    from kda_ops.options import KDAInputs
    (q, k, v, g, beta), kw = Case(B=1, T=5, H=1, HV=1, K=4, V=4, in_op=True).make(seed=0)
    A_log = torch.nn.Parameter(kw["A_log"].float(), requires_grad=param_requires_grad)   # as a model passes it
    return KDAInputs(q, k, v, g, beta, A_log, kw["dt_bias"], kw["initial_state"], None)


def _flag_in(trace, x):
    """ops._plain_eager(x) as seen from inside a traced function: the traced function returns t + flag."""
    from kda_ops import ops
    out = trace(lambda t: t + float(ops._plain_eager(x)))
    return bool(out.item())


class _Sub(torch.Tensor):
    pass


def test_plain_eager_conditions():
    """Plain tensors (nn.Parameter included) in eager mode without a gradient: True. A gradient to compute, a
    tensor subclass, a dispatch or function mode, a functorch transform, torch.compile, torch.export,
    make_fx or a TorchScript trace: False (those must see the op)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from kda_ops import ops

    x = _eager_inputs()
    t = torch.zeros(())
    with torch.no_grad():
        assert ops._plain_eager(x)                                    # a model's A_log Parameter under no_grad
        assert not ops._plain_eager(x._replace(q=torch.Tensor._make_subclass(_Sub, x.q)))
        with TorchDispatchMode():
            assert not ops._plain_eager(x)
        with TorchFunctionMode():
            assert not ops._plain_eager(x)
        assert not _flag_in(lambda f: torch.func.vmap(f)(t[None])[0], x)
        assert not _flag_in(lambda f: torch.compile(f, fullgraph=True, backend="eager")(t), x)
        assert not _flag_in(lambda f: make_fx(f)(t)(t), x)
        assert not _flag_in(lambda f: torch.jit.trace(f, t)(t), x)

        class M(torch.nn.Module):
            def forward(self, t):
                return t + float(ops._plain_eager(x))
        assert not torch.export.export(M(), (t,), strict=False).module()(t).item()
        assert _flag_in(lambda f: f(t), x)                             # the probe itself, untraced
    assert not ops._plain_eager(x)                                     # grad enabled, A_log requires grad
    assert ops._plain_eager(_eager_inputs(param_requires_grad=False))
    assert not ops._plain_eager_cuda(x)                                # CPU tensors
