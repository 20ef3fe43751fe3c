"""kda_ops.fla_compat: FLA 0.6.0's signatures (read from the wheel's source with ast), and the results
against the float64 recurrence kda_ops.naive_recurrent_kda (K != V, both state layouts, safe_gate, varlen,
gradients), the NotImplementedError cases and fused_kda_gate against its formula. CPU only."""
import ast
import inspect
import itertools
import math
import os
import pathlib
import zipfile

import pytest
import torch
import torch.nn.functional as F

from kda_ops import fla_compat, naive_recurrent_kda

# ----------------------------------------------------------------------------------------------
# Signatures
# ----------------------------------------------------------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parents[1]
WHEEL = pathlib.Path(os.environ.get(
    "KDA_FLA_WHEEL", ROOT.parent / "shared" / "wheels" / "fla_core-0.6.0-py3-none-any.whl"))
FLA_SOURCES = {
    "chunk_kda": "fla/ops/kda/chunk.py",
    "fused_recurrent_kda": "fla/ops/kda/fused_recurrent.py",
    "fused_kda_gate": "fla/ops/kda/gate.py",
}
_P, _K = "POSITIONAL_OR_KEYWORD", "VAR_KEYWORD"
# (name, kind, default source) of FLA 0.6.0, as read by _signature_from_source below. Used when the wheel
# is not on disk (CI); test_recorded_signatures_are_the_wheels keeps it equal to the wheel when it is.
RECORDED = {
    "chunk_kda": [
        ("q", _P, None), ("k", _P, None), ("v", _P, None), ("g", _P, None), ("beta", _P, None),
        ("scale", _P, "None"), ("initial_state", _P, "None"), ("output_final_state", _P, "False"),
        ("use_qk_l2norm_in_kernel", _P, "False"), ("use_gate_in_kernel", _P, "False"),
        ("use_beta_sigmoid_in_kernel", _P, "False"), ("allow_neg_eigval", _P, "False"),
        ("safe_gate", _P, "False"), ("lower_bound", _P, "None"), ("disable_recompute", _P, "False"),
        ("return_intermediate_states", _P, "False"), ("state_v_first", _P, "False"),
        ("cu_seqlens", _P, "None"), ("cu_seqlens_cpu", _P, "None"), ("cp_context", _P, "None"),
        ("use_graph", _P, "False"), ("max_num_seqs", _P, "None"), ("kwargs", _K, None)],
    "fused_recurrent_kda": [
        ("q", _P, None), ("k", _P, None), ("v", _P, None), ("g", _P, None), ("beta", _P, None),
        ("A_log", _P, "None"), ("dt_bias", _P, "None"), ("scale", _P, "None"), ("initial_state", _P, "None"),
        ("output_final_state", _P, "False"), ("use_qk_l2norm_in_kernel", _P, "False"),
        ("use_gate_in_kernel", _P, "False"), ("use_beta_sigmoid_in_kernel", _P, "False"),
        ("allow_neg_eigval", _P, "False"), ("lower_bound", _P, "None"), ("state_v_first", _P, "False"),
        ("cu_seqlens", _P, "None"), ("kwargs", _K, None)],
    "fused_kda_gate": [
        ("g", _P, None), ("A_log", _P, "None"), ("dt_bias", _P, "None"), ("lower_bound", _P, "None"),
        ("output_dtype", _P, "torch.float32")],
}


def _signature_from_source(source: str, name: str):
    """[(name, kind, default source or None)] of the module-level function `name` in `source`."""
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out = [(p.arg, "POSITIONAL_ONLY" if i < len(a.posonlyargs) else _P, d)
           for i, (p, d) in enumerate(zip(positional, defaults))]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    out += [(p.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d))
            for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, _K, None))
    return out


def _signature_of(fn):
    out = []
    for p in inspect.signature(fn).parameters.values():
        d = None if p.default is inspect.Parameter.empty else p.default
        out.append((p.name, p.kind.name, None if p.default is inspect.Parameter.empty else
                    (str(d) if isinstance(d, torch.dtype) else repr(d))))
    return out


def _fla_signatures():
    if not WHEEL.exists():
        return None
    with zipfile.ZipFile(WHEEL) as z:
        return {n: _signature_from_source(z.read(path).decode(), n) for n, path in FLA_SOURCES.items()}


def test_recorded_signatures_are_the_wheels():
    fla = _fla_signatures()
    if fla is None:
        pytest.skip(f"FLA 0.6.0 wheel not found at {WHEEL} (set KDA_FLA_WHEEL)")
    assert fla == RECORDED


@pytest.mark.parametrize("name", sorted(FLA_SOURCES))
def test_signature_matches_fla(name):
    fla = _fla_signatures() or RECORDED
    assert _signature_of(getattr(fla_compat, name)) == fla[name]


def test_fla_kda_exports_are_provided():
    if not WHEEL.exists():
        pytest.skip(f"FLA 0.6.0 wheel not found at {WHEEL}")
    with zipfile.ZipFile(WHEEL) as z:
        tree = ast.parse(z.read("fla/ops/kda/__init__.py").decode())
    exported = next(ast.literal_eval(n.value) for n in tree.body
                    if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
    assert set(exported) <= set(fla_compat.__all__)


# ----------------------------------------------------------------------------------------------
# Results against the float64 recurrence
# ----------------------------------------------------------------------------------------------
B, T, H, HV, K, V = 2, 70, 2, 4, 8, 12          # T crosses a chunk; K != V; grouped values
CU = [0, 5, 69, 70, 100]                         # packed: short, across a chunk, length 1, tail
TOL = dict(rtol=1e-5, atol=1e-6)                 # the gate parameters are computed in float32


def _inputs(seed, varlen, gate, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    b, t = (1, CU[-1]) if varlen else (B, T)
    N = len(CU) - 1 if varlen else B
    x = dict(q=r(b, t, H, K), k=r(b, t, H, K), v=r(b, t, HV, V), beta=r(b, t, HV),
             initial_state=0.1 * r(N, HV, K, V))
    if gate == "none":                           # pre-computed log decay and beta
        x["g"] = F.logsigmoid(r(b, t, HV, K) + 2)
        x["beta"] = torch.sigmoid(x["beta"])
    elif gate == "bounded":                      # pre-computed, bounded to [-5, 0) (safe_gate without gate)
        x["g"] = -5 * torch.sigmoid(r(b, t, HV, K))
        x["beta"] = torch.sigmoid(x["beta"])
    else:                                        # raw gate; A_log shaped as Kimi / vLLM keep it
        x["g"] = r(b, t, HV, K)
        x["A_log"] = (0.5 * r(1, 1, HV, 1)).float()
        x["dt_bias"] = (0.5 * r(HV * K)).float()
    if requires_grad:
        for t_ in x.values():
            t_.requires_grad_(True)
    return x, (torch.tensor(CU) if varlen else None)


def _flags(gate):
    use_gate = gate in ("gate", "safe_gate")
    return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=use_gate,
                use_beta_sigmoid_in_kernel=use_gate, safe_gate=gate in ("safe_gate", "bounded"),
                lower_bound=-5.0 if gate == "safe_gate" else None)


def _reference(x, cu, gate):
    f = _flags(gate)
    A_log, dt_bias = x.get("A_log"), x.get("dt_bias")
    return naive_recurrent_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=f["use_gate_in_kernel"],
        use_beta_sigmoid_in_kernel=f["use_beta_sigmoid_in_kernel"], lower_bound=f["lower_bound"],
        cu_seqlens=cu, A_log=None if A_log is None else A_log.double().reshape(-1),
        dt_bias=None if dt_bias is None else dt_bias.double())


def _layout(state, v_first):
    return state.transpose(-1, -2).contiguous() if v_first else state


def _call_chunk(x, cu, gate, v_first):
    f = _flags(gate)
    extra = {n: x[n] for n in ("A_log", "dt_bias") if n in x}
    return fla_compat.chunk_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], None, _layout(x["initial_state"], v_first), True,
        f["use_qk_l2norm_in_kernel"], f["use_gate_in_kernel"], f["use_beta_sigmoid_in_kernel"], False,
        f["safe_gate"], f["lower_bound"], state_v_first=v_first, cu_seqlens=cu, cu_seqlens_cpu=cu, **extra)


def _call_recurrent(x, cu, gate, v_first):
    f = _flags(gate)
    return fla_compat.fused_recurrent_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("A_log"), x.get("dt_bias"), None,
        _layout(x["initial_state"], v_first), True, f["use_qk_l2norm_in_kernel"], f["use_gate_in_kernel"],
        f["use_beta_sigmoid_in_kernel"], False, f["lower_bound"], v_first, cu)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("gate", ["none", "gate", "safe_gate", "bounded"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("v_first", [False, True], ids=["KV", "VK"])
def test_forward_matches_recurrence(fn, gate, varlen, v_first):
    x, cu = _inputs(1, varlen, gate)
    o_ref, ht_ref = _reference(x, cu, gate)
    o, ht = (_call_chunk if fn == "chunk" else _call_recurrent)(x, cu, gate, v_first)
    N = len(CU) - 1 if varlen else B
    assert ht.shape == ((N, HV, V, K) if v_first else (N, HV, K, V))
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(_layout(ht, v_first), ht_ref, **TOL)


@pytest.mark.parametrize("gate", ["none", "safe_gate"])
@pytest.mark.parametrize("varlen,v_first", [(False, False), (True, True)], ids=["fixed-KV", "varlen-VK"])
def test_chunk_gradients_match_recurrence(gate, varlen, v_first):
    x, cu = _inputs(2, varlen, gate, requires_grad=True)
    gen = torch.Generator().manual_seed(3)
    o_ref, ht_ref = _reference(x, cu, gate)
    w_o = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    w_h = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64)
    names = list(x)
    ref = torch.autograd.grad((o_ref * w_o).sum() + (ht_ref * w_h).sum(), [x[n] for n in names])
    o, ht = _call_chunk(x, cu, gate, v_first)
    got = torch.autograd.grad((o * w_o).sum() + (_layout(ht, v_first) * w_h).sum(), [x[n] for n in names])
    for n, a, b in zip(names, got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"d{n}: {m}")
        assert a.dtype == x[n].dtype and a.shape == x[n].shape


def test_defaults_and_return_conventions():
    x, _ = _inputs(4, False, "gate")
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    o, ht = fla_compat.chunk_kda(q, k, v, torch.zeros_like(g), torch.sigmoid(beta))
    assert ht is None and o.dtype == q.dtype
    o_s, _ = fla_compat.chunk_kda(q, k, v, torch.zeros_like(g), torch.sigmoid(beta), scale=K ** -0.5)
    torch.testing.assert_close(o, o_s, rtol=0, atol=0)
    o_r, ht_r = fla_compat.fused_recurrent_kda(q, k, v, torch.zeros_like(g), torch.sigmoid(beta))
    assert ht_r is None
    torch.testing.assert_close(o_r, o, **TOL)
    h0 = x["initial_state"].detach().clone()
    before = h0.clone()
    _, ht_r = fla_compat.fused_recurrent_kda(q, k, v, -torch.rand_like(g), torch.sigmoid(beta),
                                             initial_state=h0, output_final_state=True)
    assert torch.equal(h0, before) and ht_r.dtype == h0.dtype
    # lower_bound is a gate option: without use_gate_in_kernel FLA ignores it, and so does fla_compat
    gl = F.logsigmoid(g)
    for fn in (fla_compat.chunk_kda, fla_compat.fused_recurrent_kda):
        torch.testing.assert_close(fn(q, k, v, gl, torch.sigmoid(beta), lower_bound=-7.0)[0],
                                   fn(q, k, v, gl, torch.sigmoid(beta))[0], rtol=0, atol=0)


def test_deprecated_transpose_state_layout():
    x, _ = _inputs(5, False, "none")
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    h0 = x["initial_state"].transpose(-1, -2).contiguous()
    want = fla_compat.chunk_kda(*args, initial_state=h0, output_final_state=True, state_v_first=True)
    for fn in (fla_compat.chunk_kda, fla_compat.fused_recurrent_kda):
        with pytest.warns(DeprecationWarning):
            got = fn(*args, initial_state=h0, output_final_state=True, transpose_state_layout=True)
        torch.testing.assert_close(got[1], want[1], **TOL)
        with pytest.raises(ValueError, match="transpose_state_layout"):
            fn(*args, state_v_first=True, transpose_state_layout=True)


def test_fused_recurrent_bf16_state_and_missing_A_log():
    x, _ = _inputs(6, False, "gate")
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    h0 = x["initial_state"].float()
    # any float state dtype is read in float32 (FLA's kernel loads it as float32)
    o_bf, ht_bf = fla_compat.fused_recurrent_kda(*args, initial_state=h0.bfloat16(), output_final_state=True)
    o_32, ht_32 = fla_compat.fused_recurrent_kda(*args, initial_state=h0.bfloat16().float(),
                                                 output_final_state=True)
    assert ht_bf.dtype == torch.float32
    torch.testing.assert_close(o_bf, o_32, rtol=0, atol=0)
    # no A_log without lower_bound: FLA's kernel uses A_log = 1 in -exp(A_log) * softplus(g + dt_bias)
    o, _ = fla_compat.fused_recurrent_kda(*args, None, x["dt_bias"], use_gate_in_kernel=True)
    o_one, _ = fla_compat.fused_recurrent_kda(*args, torch.ones(HV), x["dt_bias"], use_gate_in_kernel=True)
    torch.testing.assert_close(o, o_one, rtol=0, atol=0)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_bounded_gate_without_A_log(fn):
    """lower_bound with A_log None: g = lower_bound * sigmoid(g + dt_bias)."""
    x, _ = _inputs(12, False, "gate")
    x = {n: t.detach() for n, t in x.items()}
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=x["initial_state"], output_final_state=True, use_gate_in_kernel=True, lower_bound=-3.0)
    if fn == "chunk":
        o, ht = fla_compat.chunk_kda(*args, **kw, dt_bias=x["dt_bias"])
    else:
        o, ht = fla_compat.fused_recurrent_kda(*args, None, x["dt_bias"], **kw)
    o_ref, ht_ref = naive_recurrent_kda(*args, **kw, dt_bias=x["dt_bias"].double())
    torch.testing.assert_close((o, ht), (o_ref, ht_ref), **TOL)


@pytest.mark.parametrize("case,exc,match", [
    ("cp_context", NotImplementedError, "cp_context"),
    ("return_intermediate_states", NotImplementedError, "return_intermediate_states"),
    ("lower_bound_range", NotImplementedError, "lower_bound"),
    ("recurrent_lower_bound_range", NotImplementedError, "lower_bound"),
    ("headwise_beta", NotImplementedError, "beta"),
    ("safe_gate_without_bound", ValueError, "lower_bound"),
    ("gate_without_A_log", ValueError, "A_log"),
    ("neg_eigval_without_sigmoid", ValueError, "allow_neg_eigval"),
    ("recurrent_neg_eigval_without_sigmoid", ValueError, "allow_neg_eigval"),
    ("chunk_size", ValueError, "chunk_size"),
])
def test_unsupported_and_invalid_options(case, exc, match):
    x, _ = _inputs(7, False, "gate")
    args = [x[n].detach() for n in ("q", "k", "v", "g", "beta")]
    gate = dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    calls = {
        "cp_context": lambda: fla_compat.chunk_kda(*args, cp_context=object()),
        "return_intermediate_states": lambda: fla_compat.chunk_kda(*args, return_intermediate_states=True),
        "lower_bound_range": lambda: fla_compat.chunk_kda(*args, lower_bound=-6.0, **gate),
        "recurrent_lower_bound_range": lambda: fla_compat.fused_recurrent_kda(*args, lower_bound=-6.0, **gate),
        "headwise_beta": lambda: fla_compat.fused_recurrent_kda(*args[:4], args[2].sigmoid()),
        "safe_gate_without_bound": lambda: fla_compat.chunk_kda(*args, safe_gate=True, **gate),
        "gate_without_A_log": lambda: fla_compat.chunk_kda(*args, use_gate_in_kernel=True),
        "neg_eigval_without_sigmoid": lambda: fla_compat.chunk_kda(*args, allow_neg_eigval=True),
        "recurrent_neg_eigval_without_sigmoid":
            lambda: fla_compat.fused_recurrent_kda(*args, allow_neg_eigval=True),
        "chunk_size": lambda: fla_compat.chunk_kda(*args, chunk_size=16),
    }
    with pytest.raises(exc, match=match):
        calls[case]()


def test_accepted_options_leave_the_result_unchanged():
    x, cu = _inputs(8, True, "safe_gate")
    x = {n: t.detach() for n, t in x.items()}
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=x["initial_state"], output_final_state=True, use_gate_in_kernel=True,
              lower_bound=-5.0, A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=cu)
    o, ht = fla_compat.chunk_kda(*args, **kw)
    for extra in (dict(safe_gate=True), dict(disable_recompute=True), dict(cu_seqlens_cpu=cu),
                  dict(use_graph=True, max_num_seqs=len(CU) - 1), dict(chunk_size=32), dict(unknown_kw=1)):
        o2, ht2 = fla_compat.chunk_kda(*args, **kw, **extra)
        torch.testing.assert_close((o2, ht2), (o, ht), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# fused_kda_gate
# ----------------------------------------------------------------------------------------------
def _gate_formula(g, A_log, dt_bias, lower_bound):
    """The gate written out element by element in float64 (FLA's docstring formulas)."""
    Hh, Kk = g.shape[-2:]
    out = torch.empty(g.shape, dtype=torch.float64)
    gd = g.double()
    for idx in itertools.product(*(range(n) for n in g.shape)):
        h, kk = idx[-2], idx[-1]
        x = float(gd[idx]) + (float(dt_bias.reshape(-1)[h * Kk + kk]) if dt_bias is not None else 0.0)
        a = math.exp(float(A_log.reshape(-1)[h])) if A_log is not None else None
        if lower_bound is None:
            out[idx] = -(a if a is not None else math.e) * math.log1p(math.exp(x))
        else:
            out[idx] = lower_bound / (1 + math.exp(-(a * x if a is not None else x)))
    return out


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("with_A", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_kda_gate_formula(lower_bound, with_A, with_bias):
    gen = torch.Generator().manual_seed(9)
    g = torch.randn(2, 3, 4, 5, generator=gen).bfloat16()
    A_log = torch.randn(1, 1, 4, 1, generator=gen).bfloat16() if with_A else None
    dt_bias = torch.randn(20, generator=gen) if with_bias else None
    y = fla_compat.fused_kda_gate(g, A_log, dt_bias, lower_bound)
    assert y.dtype == torch.float32 and y.shape == g.shape
    torch.testing.assert_close(y.double(), _gate_formula(g, A_log, dt_bias, lower_bound), rtol=1e-6, atol=1e-6)
    assert fla_compat.fused_kda_gate(g, A_log, dt_bias, lower_bound, torch.bfloat16).dtype == torch.bfloat16


def test_fused_kda_gate_gradients_and_compile():
    gen = torch.Generator().manual_seed(10)
    g = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    A_log = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    dt_bias = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(g.shape, generator=gen, dtype=torch.float64)
    for lb in (None, -3.0):                      # computed in float32: against the float64 formula in torch
        x = g + dt_bias.view(2, 4)
        a = A_log.exp().view(2, 1)
        ref = -a * F.softplus(x) if lb is None else lb * torch.sigmoid(a * x)
        want = torch.autograd.grad((ref * w).sum(), (g, A_log, dt_bias))
        got = torch.autograd.grad((fla_compat.fused_kda_gate(g, A_log, dt_bias, lb) * w).sum(),
                                  (g, A_log, dt_bias))
        for a_, b_ in zip(got, want):
            assert a_.dtype == torch.float64
            torch.testing.assert_close(a_, b_, rtol=1e-5, atol=1e-5)
    A_bf = A_log.detach().bfloat16().requires_grad_(True)
    fla_compat.fused_kda_gate(g.detach(), A_bf, None).sum().backward()
    assert A_bf.grad.dtype == torch.bfloat16
    compiled = torch.compile(fla_compat.fused_kda_gate, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(g.detach(), A_log.detach(), dt_bias.detach(), -5.0),
                               fla_compat.fused_kda_gate(g.detach(), A_log.detach(), dt_bias.detach(), -5.0))


# ----------------------------------------------------------------------------------------------
# Compile and export of FLA-style code
# ----------------------------------------------------------------------------------------------
class _FLAStyle(torch.nn.Module):
    def forward(self, q, k, v, g, beta, A_log, dt_bias, h0):
        o, ht = fla_compat.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                     state_v_first=True, A_log=A_log, dt_bias=dt_bias)
        o2, ht2 = fla_compat.fused_recurrent_kda(q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:], beta[:, -1:],
                                                 A_log, dt_bias, initial_state=ht, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                                 use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
                                                 state_v_first=True)
        return o, o2, ht2


def _module_inputs():
    x, _ = _inputs(11, False, "safe_gate")
    x = {n: t.detach().float() for n, t in x.items()}
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
            x["initial_state"].transpose(-1, -2).contiguous())


def test_compile_fullgraph_and_export_keep_kda_ops():
    args = _module_inputs()
    eager = _FLAStyle()(*args)
    torch._dynamo.reset()
    compiled = torch.compile(_FLAStyle(), fullgraph=True, backend="eager")(*args)
    torch.testing.assert_close(compiled, eager)
    ep = torch.export.export(_FLAStyle(), args)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert any(t.startswith("kda_ops.") for t in targets), targets
    torch.testing.assert_close(ep.module()(*args), eager)
