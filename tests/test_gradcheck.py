"""torch.autograd.gradcheck through the public op (float64, tiny): every differentiable input."""
import pytest
import torch

import kda_ops
from kda_case import Case

CASES = [
    Case(B=1, T=9, H=1, HV=2, K=4, V=3),
    Case(B=1, T=9, H=1, HV=2, K=4, V=3, in_op=True, extra=dict(scale=0.8)),    # a scale of its own
    Case(B=1, T=9, H=1, HV=1, K=4, V=3, in_op=True, lower_bound=-2.0, allow_neg_eigval=True),
    Case(B=1, T=11, H=1, HV=1, K=3, V=4, seqlens=[4, 7], in_op=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gradcheck_chunk_kda(case, monkeypatch):
    # Small chunks make the tiny problem span several chunks and a partial one.
    monkeypatch.setattr(kda_ops.ops, "TORCH_CHUNK_SIZE", 4)
    inputs, kw = case.make(seed=case.seed)
    kw.update(case.extra)
    names = [n for n in ("initial_state", "A_log", "dt_bias") if kw.get(n) is not None]
    leaves = [x.clone().requires_grad_() for x in inputs] + [kw[n].clone().requires_grad_() for n in names]

    def f(*xs):
        extra = dict(zip(names, xs[5:]))
        o, ht = kda_ops.chunk_kda(*xs[:5], **{**kw, **extra})
        return o, ht   # both outputs: the final-state gradient is checked too

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6, rtol=1e-5)
