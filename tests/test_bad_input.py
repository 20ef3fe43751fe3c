"""Bad or edge input through the public functions: strides, cu_seqlens values, non-finite values, degenerate
sizes and arguments the op would otherwise ignore. Each value test runs on CPU (float64) and, marked gpu, on
CUDA (float32, the Triton kernels); the Triton kernels' strides, bounds and containment are also tested under
the interpreter in tests/test_kernels_fwd.py."""
import math

import pytest
import torch

import kda_ops
from handwritten import hw_kda
from kda_case import rel_rms

B, T, H, HV, K, V = 2, 40, 1, 2, 8, 12          # K != V: a state-layout mix-up cannot pass


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
TOL = {"cpu": 1e-12, "cuda": 1e-5}             # vs the hand-written recurrence: float64 on CPU, float32 on CUDA


def dtype_of(device):
    return torch.float64 if device == "cpu" else torch.float32


def inputs(seed=0, B=B, T=T, dtype=torch.float64, device="cpu", **over):
    g = torch.Generator().manual_seed(seed)
    if device != "cpu":
        dtype = torch.float32
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype).to(device)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
             A_log=r(HV), dt_bias=r(HV * K), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True)
    x.update(over)
    return x


def same(a, b):
    """Bitwise on CPU. On CUDA a relative RMS of 1e-6 (float32): Triton compiles a kernel per stride pattern (it
    specialises unit strides), so a reduction's order may differ; on the H200 the recurrent kernel's outputs
    for a transposed or V-first state were close to, but not bitwise equal to, those for a contiguous one."""
    if a.device.type == "cpu":
        return torch.equal(a, b)
    return a.shape == b.shape and bool(torch.isfinite(a).all()) and rel_rms(a, b) <= 1e-6


def h0(N=B, seed=1, device="cpu"):
    s = torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return s.to(device=device, dtype=dtype_of(device))


# ---------------------------------------------------------------------------------------------- strides
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
def test_any_strides(fn, device):
    x = inputs(device=device)
    s = h0(device=device)
    kw = dict(output_final_state=True) if fn is kda_ops.chunk_kda else {}
    o_ref, ht_ref = fn(**x, initial_state=s, **kw)
    strided = dict(x, q=x["q"].transpose(0, 1).contiguous().transpose(0, 1),
                   v=torch.stack([x["v"], x["v"]], -1)[..., 0], A_log=x["A_log"].repeat_interleave(2)[::2],
                   dt_bias=x["dt_bias"].repeat_interleave(3)[1::3])
    for state in (s.transpose(-1, -2).contiguous().transpose(-1, -2), s[:1].expand(B, -1, -1, -1)):
        o, ht = fn(**strided, initial_state=state, **kw)
        o_b, ht_b = fn(**x, initial_state=state.contiguous(), **kw)
        assert same(o, o_b) and same(ht, ht_b)
    o, ht = fn(**strided, initial_state=s, **kw)
    assert same(o, o_ref) and same(ht, ht_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
def test_state_v_first(fn, device):
    x = inputs(device=device)
    s = h0(device=device)
    kw = dict(output_final_state=True) if fn is kda_ops.chunk_kda else {}
    o, ht = fn(**x, initial_state=s, **kw)
    o_v, ht_v = fn(**x, initial_state=s.transpose(-1, -2).contiguous(), state_v_first=True, **kw)
    assert ht_v.shape == (B, HV, V, K)
    assert same(o, o_v) and same(ht, ht_v.transpose(-1, -2))
    with pytest.raises(ValueError, match=r"state_v_first=True"):
        fn(**x, initial_state=s.transpose(-1, -2).contiguous(), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_gate_parameters_any_dtype_and_shape(device):
    x = inputs(dtype=torch.float32, device=device)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cu", [[0, 7, 30], [3, 10, 40], [0, 5, 2, 40], [0, 20, 4000], [0, 7, 10**6], [-5, 10, 40]])
@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
def test_bad_cu_seqlens_values_on_cuda(fn, cu):
    """CUDA does not read cu_seqlens on the host by default: any values run inside the tensors (each sequence
    clamped to [0, T] and made non-decreasing), with finite results and the untouched tokens zero; the opt-in
    check (kda_ops.set_cu_seqlens_check / KDA_OPS_CHECK_CU_SEQLENS=1) raises the CPU path's ValueError."""
    x = inputs(B=1, device="cuda")
    cu_t = torch.tensor(cu, device="cuda")
    kw = dict(output_final_state=True) if fn is kda_ops.chunk_kda else {}
    if fn is kda_ops.recurrent_kda:
        kw["initial_state"] = h0(N=len(cu) - 1, device="cuda")
    o, ht = fn(**x, cu_seqlens=cu_t, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    lo, hi = max(0, min(cu[0], T)), max(0, min(max(cu), T))
    assert not o[:, :lo].any() and not o[:, hi:].any()
    kda_ops.set_cu_seqlens_check(True)
    try:
        with pytest.raises(ValueError, match="cu_seqlens"):
            fn(**x, cu_seqlens=cu_t, **kw)
    finally:
        kda_ops.set_cu_seqlens_check(False)


# ---------------------------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_nan_stays_in_its_sequence_and_never_reaches_the_past(name, device):
    cu = torch.tensor([0, 17, 40], device=device)
    x = inputs(B=1, device=device)
    o, ht = kda_ops.chunk_kda(**x, cu_seqlens=cu, output_final_state=True)
    bad = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    bad[name][0, 30] = math.nan                  # sequence 2, token 30
    o_n, ht_n = kda_ops.chunk_kda(**bad, cu_seqlens=cu, output_final_state=True)
    assert torch.equal(o_n[:, :17], o[:, :17])   # sequence 1
    assert torch.equal(ht_n[0], ht[0])
    # sequence 2 before token 30: bitwise on CPU; on CUDA within the kernels' float32 tolerance (2.6e-6 on an
    # H100): a NaN gate counts as a zero log decay, which moves the references of the intra kernel's factored dots
    # in its chunk (their rows' rounding) and may change its path
    before_n, before = o_n[:, 17:30], o[:, 17:30]
    assert torch.isfinite(before_n).all()
    assert torch.equal(before_n, before) if device == "cpu" else rel_rms(before_n, before) <= TOL[device]
    assert o_n[:, 30].isnan().any()              # the NaN does reach its own token


@pytest.mark.parametrize("device", DEVICES)
def test_full_decay_is_a_reset(device):
    x = inputs(use_gate_in_kernel=False, A_log=None, dt_bias=None, device=device)
    x["g"] = -torch.nn.functional.softplus(x["g"])
    x["g"][:, 20] = -math.inf                    # token 20 forgets everything before it
    s = h0(device=device)
    o, ht = kda_ops.chunk_kda(**x, initial_state=s, output_final_state=True)
    up = lambda t: t.cpu().double()  # noqa: E731
    ref_o, ref_ht = hw_kda(up(x["q"]), up(x["k"]), up(x["v"]), up(x["g"]), up(x["beta"]), initial_state=up(s),
                           use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_rms(o.cpu().double(), ref_o) < TOL[device] and rel_rms(ht.cpu().double(), ref_ht) < TOL[device]
    xg = dict(x, q=x["q"].requires_grad_(), v=x["v"].requires_grad_())
    o, _ = kda_ops.chunk_kda(**xg)
    o.sum().backward()
    assert torch.isfinite(xg["q"].grad).all() and torch.isfinite(xg["v"].grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_raw_gate_plus_inf_is_finite(device):
    x = inputs(device=device)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [kda_ops.chunk_kda, kda_ops.recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("b,t", [(2, 0), (0, 5)])
def test_empty_batch_or_sequence(fn, b, t, device):
    x = inputs(B=b, T=t, device=device)
    s = h0(N=b, device=device)
    kw = dict(output_final_state=True) if fn is kda_ops.chunk_kda else {}
    o, ht = fn(**x, initial_state=s, **kw)
    assert o.shape == (b, t, HV, V) and torch.equal(ht, s)
