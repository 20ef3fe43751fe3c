"""Bad input gets a clear error at the public boundary: one test per check in kda_ops/api.py."""
import pytest
import torch

import kda_ops

B, T, H, HV, K, V = 2, 10, 2, 4, 8, 6


def good(**over):
    args = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
                g=-torch.rand(B, T, HV, K), beta=torch.rand(B, T, HV))
    args.update(over)
    return args


def call(fn=kda_ops.chunk_kda, **over):
    args = good(**{n: over.pop(n) for n in list(over) if n in ("q", "k", "v", "g", "beta")})
    return fn(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"), **over)


def test_good_input_runs():
    o, ht = call()
    assert o.shape == (B, T, HV, V) and ht is None


@pytest.mark.parametrize("name,shape", [("q", (B, T, H * K)), ("v", (B, T, HV)), ("g", (B, T, HV)),
                                        ("beta", (B, T, HV, 1))])
def test_wrong_rank(name, shape):
    with pytest.raises(ValueError, match=f"{name} must have .* dims"):
        call(**{name: torch.randn(*shape)})


def test_not_a_tensor():
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        call(q=[[1.0]])


def test_q_k_mismatch():
    with pytest.raises(ValueError, match=r"k must have the shape of q"):
        call(k=torch.randn(B, T, H, K + 1))


def test_v_batch_time_mismatch():
    with pytest.raises(ValueError, match=r"v must have batch and time"):
        call(v=torch.randn(B, T + 1, HV, V))


def test_g_shape_mismatch():
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, HV, K\] = \(2, 10, 4, 8\), got \(2, 10, 2, 8\)"):
        call(g=torch.randn(B, T, H, K))


def test_beta_shape_mismatch():
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, HV\]"):
        call(beta=torch.rand(B, T, H))


def test_heads_not_divisible():
    with pytest.raises(ValueError, match=r"HV = 3 .* multiple of q/k heads H = 2"):
        call(v=torch.randn(B, T, 3, V), g=torch.randn(B, T, 3, K), beta=torch.rand(B, T, 3))


@pytest.mark.parametrize("which", ["K", "V"])
def test_unsupported_head_dim(which):
    big = 257
    over = (dict(q=torch.randn(B, T, H, big), k=torch.randn(B, T, H, big), g=torch.randn(B, T, HV, big))
            if which == "K" else dict(v=torch.randn(B, T, HV, big)))
    with pytest.raises(ValueError, match=rf"head dim {which} .* = 257 is unsupported"):
        call(**over)


def test_cu_seqlens_with_batch():
    with pytest.raises(ValueError, match=r"batch size must be 1"):
        call(cu_seqlens=torch.tensor([0, 4, 10]))


def test_cu_seqlens_dtype():
    one = good(**{n: x[:1] for n, x in good().items()})
    with pytest.raises(TypeError, match=r"cu_seqlens must have dtype int32 or int64, got float32"):
        kda_ops.chunk_kda(*one.values(), cu_seqlens=torch.tensor([0.0, 4.0, 10.0]))


def test_cu_seqlens_rank():
    one = good(**{n: x[:1] for n, x in good().items()})
    with pytest.raises(ValueError, match=r"cu_seqlens must have 1 dims \[N \+ 1\]"):
        kda_ops.chunk_kda(*one.values(), cu_seqlens=torch.tensor([[0, 10]]))


def test_initial_state_shape():
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, HV, K, V\] = \(2, 4, 8, 6\)"):
        call(initial_state=torch.zeros(B, H, K, V))


def test_initial_state_dtype():
    with pytest.raises(TypeError, match=r"initial_state must have dtype"):
        call(initial_state=torch.zeros(B, HV, K, V, dtype=torch.bfloat16))


def test_gate_in_op_without_A_log():
    with pytest.raises(ValueError, match=r"use_gate_in_kernel=True needs A_log"):
        call(use_gate_in_kernel=True)


def test_gate_in_op_lower_bound_allows_missing_A_log():
    o, _ = call(use_gate_in_kernel=True, lower_bound=-2.0)
    assert torch.isfinite(o).all()


def test_A_log_shape():
    with pytest.raises(ValueError, match=r"A_log must hold HV = 4 elements"):
        call(use_gate_in_kernel=True, A_log=torch.zeros(H))


def test_dt_bias_shape():
    with pytest.raises(ValueError, match=r"dt_bias must hold HV \* K = 32 elements"):
        call(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV))


def test_gate_params_without_gate():
    with pytest.raises(ValueError, match=r"only used with use_gate_in_kernel=True"):
        call(A_log=torch.zeros(HV))


@pytest.mark.parametrize("lb", [-5.5, 0.0, 1.0])
def test_lower_bound_range(lb):
    with pytest.raises(ValueError, match=r"lower_bound must lie in \[-5, 0\)"):
        call(use_gate_in_kernel=True, lower_bound=lb)


def test_different_devices():
    with pytest.raises(ValueError, match=r"v is on meta but q is on cpu"):
        call(v=torch.randn(B, T, HV, V, device="meta"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match=r"q must have dtype in"):
        call(q=torch.ones(B, T, H, K, dtype=dtype))


def test_mixed_qkv_dtype():
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype"):
        call(v=torch.randn(B, T, HV, V, dtype=torch.bfloat16))


def test_chunk_size():
    with pytest.raises(ValueError, match=r"chunk_size must be 64, got 32"):
        call(chunk_size=32)


def test_recurrent_validates_too():
    with pytest.raises(ValueError, match=r"k must have the shape of q"):
        call(kda_ops.recurrent_kda, k=torch.randn(B, T, H, K + 1))


def test_non_contiguous_inputs_work():
    args = good()
    qt = torch.randn(B, H, T, K).transpose(1, 2)            # [B, T, H, K], not contiguous
    assert not qt.is_contiguous()
    o1, _ = kda_ops.chunk_kda(qt, args["k"], args["v"], args["g"], args["beta"])
    o2, _ = kda_ops.chunk_kda(qt.contiguous(), args["k"], args["v"], args["g"], args["beta"])
    torch.testing.assert_close(o1, o2)
