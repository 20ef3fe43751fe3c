"""Bad or edge input through the public functions on CPU: strides, cu_seqlens values, non-finite values,
degenerate sizes and arguments the op would otherwise ignore. (The Triton kernels' strides, bounds and
containment are tested in tests/test_kernels_fwd.py under the interpreter.)"""
import math

import pytest
import torch

import kda_ops
from handwritten import hw_kda
from kda_case import rel_rms

B, T, H, HV, K, V = 2, 40, 1, 2, 8, 12          # K != V: a state-layout mix-up cannot pass


def inputs(seed=0, B=B, T=T, dtype=torch.float64, **over):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
             A_log=r(HV), dt_bias=r(HV * K), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True)
    x.update(over)
    return x


def h0(N=B, seed=1):
    return torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------------------------------------- strides
@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
def test_any_strides(fn):
    x = inputs()
    s = h0()
    kw = dict(output_final_state=True) if fn is kda_ops.chunk_kda else {}
    o_ref, ht_ref = fn(**x, initial_state=s, **kw)
    strided = dict(x, q=x["q"].transpose(0, 1).contiguous().transpose(0, 1),
                   v=torch.stack([x["v"], x["v"]], -1)[..., 0], A_log=x["A_log"].repeat_interleave(2)[::2],
                   dt_bias=x["dt_bias"].repeat_interleave(3)[1::3])
    for state in (s.transpose(-1, -2).contiguous().transpose(-1, -2), s[:1].expand(B, -1, -1, -1)):
        o, ht = fn(**strided, initial_state=state, **kw)
        o_b, ht_b = fn(**x, initial_state=state.contiguous(), **kw)
        assert torch.equal(o, o_b) and torch.equal(ht, ht_b)
    o, ht = fn(**strided, initial_state=s, **kw)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
def test_state_v_first(fn):
    x = inputs()
    s = h0()
    kw = dict(output_final_state=True) if fn is kda_ops.chunk_kda else {}
    o, ht = fn(**x, initial_state=s, **kw)
    o_v, ht_v = fn(**x, initial_state=s.transpose(-1, -2).contiguous(), state_v_first=True, **kw)
    assert ht_v.shape == (B, HV, V, K)
    assert torch.equal(o, o_v) and torch.equal(ht, ht_v.transpose(-1, -2))
    with pytest.raises(ValueError, match=r"state_v_first=True"):
        fn(**x, initial_state=s.transpose(-1, -2).contiguous(), **kw)


def test_gate_parameters_any_dtype_and_shape():
    x = inputs(dtype=torch.float32)
    A_log = x["A_log"].to(torch.bfloat16).view(1, 1, HV, 1).requires_grad_()
    dt_bias = x["dt_bias"].to(torch.float16).view(HV, K).requires_grad_()
    o, _ = kda_ops.chunk_kda(**dict(x, A_log=A_log, dt_bias=dt_bias))
    o_ref, _ = kda_ops.chunk_kda(**dict(x, A_log=A_log.detach().float().flatten(),
                                        dt_bias=dt_bias.detach().float().flatten()))
    assert torch.equal(o, o_ref)
    o.sum().backward()
    assert A_log.grad.shape == A_log.shape and A_log.grad.dtype == torch.bfloat16
    assert dt_bias.grad.shape == dt_bias.shape and dt_bias.grad.dtype == torch.float16


# ---------------------------------------------------------------------------------------------- cu_seqlens
@pytest.mark.parametrize("cu,entry", [([0, 7, 30], "cu_seqlens\\[2\\] = 30"), ([3, 10, 40], "cu_seqlens\\[0\\] = 3"),
                                      ([0, 5, 2, 40], "cu_seqlens\\[2\\] = 2"), ([0, 7, 10**6], "10000")])
@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
def test_bad_cu_seqlens_values(fn, cu, entry):
    x = inputs(B=1)
    with pytest.raises(ValueError, match=f"cu_seqlens.*{entry}"):
        fn(**x, cu_seqlens=torch.tensor(cu))


# ---------------------------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_nan_stays_in_its_sequence_and_never_reaches_the_past(name):
    cu = torch.tensor([0, 17, 40])
    x = inputs(B=1)
    o, ht = kda_ops.chunk_kda(**x, cu_seqlens=cu, output_final_state=True)
    bad = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    bad[name][0, 30] = math.nan                  # sequence 2, token 30
    o_n, ht_n = kda_ops.chunk_kda(**bad, cu_seqlens=cu, output_final_state=True)
    assert torch.equal(o_n[:, :30], o[:, :30])   # sequence 1, and sequence 2 before token 30
    assert torch.equal(ht_n[0], ht[0])
    assert o_n[:, 30].isnan().any()              # the NaN does reach its own token


def test_full_decay_is_a_reset():
    x = inputs(use_gate_in_kernel=False, A_log=None, dt_bias=None)
    x["g"] = -torch.nn.functional.softplus(x["g"])
    x["g"][:, 20] = -math.inf                    # token 20 forgets everything before it
    s = h0()
    o, ht = kda_ops.chunk_kda(**x, initial_state=s, output_final_state=True)
    ref_o, ref_ht = hw_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=s,
                           use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert torch.isfinite(o).all() and rel_rms(o, ref_o) < 1e-12 and rel_rms(ht, ref_ht) < 1e-12
    xg = dict(x, q=x["q"].requires_grad_(), v=x["v"].requires_grad_())
    o, _ = kda_ops.chunk_kda(**xg)
    o.sum().backward()
    assert torch.isfinite(xg["q"].grad).all() and torch.isfinite(xg["v"].grad).all()


def test_raw_gate_plus_inf_is_finite():
    x = inputs()
    x["g"][:, 12] = math.inf                     # softplus(inf) = inf: a full reset through the in-op gate
    x = {n: (t.requires_grad_() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    o, ht = kda_ops.chunk_kda(**x, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    (o.sum() + ht.sum()).backward()
    for n in ("q", "k", "v", "beta", "A_log", "dt_bias"):
        assert torch.isfinite(x[n].grad).all(), n


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("over,exc,msg", [
    (dict(scale=math.nan), ValueError, "scale must be finite"),
    (dict(scale="abc"), TypeError, "scale must be a real number"),
    (dict(scale=True), TypeError, "scale must be a real number"),
    (dict(lower_bound="x"), TypeError, "lower_bound must be a real number"),
    (dict(lower_bound=-1.0, use_gate_in_kernel=False, A_log=None, dt_bias=None), ValueError,
     "lower_bound is only used with use_gate_in_kernel"),
    (dict(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False), ValueError,
     "allow_neg_eigval is only used with use_beta_sigmoid_in_kernel"),
    (dict(use_gate_in_kernel=1), TypeError, "use_gate_in_kernel must be a bool"),
])
def test_argument_checks(over, exc, msg):
    with pytest.raises(exc, match=msg):
        kda_ops.chunk_kda(**inputs(**over))


def test_sparse_layout():
    x = inputs()
    with pytest.raises(TypeError, match="q must be a dense"):
        kda_ops.chunk_kda(**dict(x, q=x["q"].to_sparse()))


@pytest.mark.parametrize("dim,name", [(2, "H = q.shape\\[2\\] = 0"), (None, "HV = v.shape\\[2\\] = 0")])
def test_zero_heads(dim, name):
    x = inputs()
    if dim is None:
        x = dict(x, v=x["v"][:, :, :0], g=x["g"][:, :, :0], beta=x["beta"][:, :, :0])
    else:
        x = dict(x, q=x["q"][:, :, :0], k=x["k"][:, :, :0])
    with pytest.raises(ValueError, match=name):
        kda_ops.chunk_kda(**x)


@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("b,t", [(2, 0), (0, 5)])
def test_empty_batch_or_sequence(fn, b, t):
    x = inputs(B=b, T=t)
    s = h0(N=b)
    kw = dict(output_final_state=True) if fn is kda_ops.chunk_kda else {}
    o, ht = fn(**x, initial_state=s, **kw)
    assert o.shape == (b, t, HV, V) and torch.equal(ht, s)
