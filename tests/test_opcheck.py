"""torch.library.opcheck on kda_ops::chunk_kda_fwd / chunk_kda_bwd across the feature matrix."""
import pytest
import torch
from torch.library import opcheck

from kda_case import Case

CASES = [
    Case(B=2, T=9, H=1, HV=2, K=8, V=4, dtype=torch.float32),
    Case(B=2, T=70, H=1, HV=1, K=8, V=8, in_op=True, dtype=torch.float32, initial_state=False),
    Case(B=1, T=9, H=1, HV=2, K=8, V=4, in_op=True, lower_bound=-3.0, allow_neg_eigval=True),
    Case(B=1, T=12, H=1, HV=1, K=8, V=4, seqlens=[5, 7], in_op=True, dtype=torch.bfloat16),
]


def _args(case, requires_grad):
    inputs, kw = case.make()
    tensors = dict(A_log=kw.get("A_log"), dt_bias=kw.get("dt_bias"), initial_state=kw.get("initial_state"))
    if requires_grad:
        inputs = [x.requires_grad_() for x in inputs]
        tensors = {n: (None if x is None else x.requires_grad_()) for n, x in tensors.items()}
    flags = (inputs[0].shape[-1] ** -0.5, kw.get("lower_bound"), kw.get("use_qk_l2norm_in_kernel", False),
             kw.get("use_gate_in_kernel", False), kw.get("use_beta_sigmoid_in_kernel", False),
             kw.get("allow_neg_eigval", False))
    return inputs, tensors, kw.get("cu_seqlens"), flags


@pytest.mark.parametrize("requires_grad", [False, True], ids=["nograd", "grad"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("output_final_state", [True, False], ids=["ht", "noht"])
def test_opcheck_fwd(case, requires_grad, output_final_state):
    inputs, t, cu, flags = _args(case, requires_grad)
    args = (*inputs, t["A_log"], t["dt_bias"], t["initial_state"], cu, *flags, output_final_state)
    opcheck(torch.ops.kda_ops.chunk_kda_fwd.default, args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "nodht"])
def test_opcheck_bwd(case, with_dht):
    inputs, t, cu, flags = _args(case, False)
    B, T, HV, V = inputs[2].shape
    N = B if cu is None else cu.numel() - 1
    do = torch.randn(B, T, HV, V, dtype=inputs[2].dtype)
    dht = torch.randn(N, HV, inputs[0].shape[-1], V, dtype=torch.float32) if with_dht else None
    if inputs[0].dtype == torch.float64 and dht is not None:
        dht = dht.double()
    args = (do, dht, *inputs, t["A_log"], t["dt_bias"], t["initial_state"], cu, *flags)
    opcheck(torch.ops.kda_ops.chunk_kda_bwd.default, args)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.id)
def test_opcheck_torch_impl_ops(case):
    """The opaque ops holding the CPU implementation pass opcheck on their own too."""
    inputs, t, cu, flags = _args(case, False)
    args = (*inputs, t["A_log"], t["dt_bias"], t["initial_state"], cu, *flags, True)
    opcheck(torch.ops.kda_ops.chunk_kda_fwd_torch.default, args)
