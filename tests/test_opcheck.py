"""torch.library.opcheck on every kda_ops op (the public versioned ops and the private training-path and
CPU-implementation ops), on CPU and, marked gpu, on CUDA: schema, fake (meta) outputs against the real ones
(on CUDA: the saved Aqk / Tm of the forward too), autograd registration, AOT dispatch."""
import pytest
import torch
from torch.library import opcheck

from kda_case import Case, gen, kda_op, op_args

f32, bf16 = torch.float32, torch.bfloat16
# K != V in all; Case.extra is passed as keyword arguments (a scale of its own).
CASES = [
    Case(B=2, T=9, H=1, HV=2, K=8, V=4, dtype=f32, extra=dict(scale=0.6)),
    Case(B=2, T=20, H=1, HV=1, K=8, V=6, in_op=True, dtype=f32, initial_state=False),     # CPU chunks: 16
    Case(B=1, T=9, H=1, HV=2, K=8, V=4, in_op=True, lower_bound=-3.0, allow_neg_eigval=True),   # float64
    Case(B=1, T=12, H=1, HV=1, K=8, V=4, seqlens=[5, 0, 7], in_op=True, dtype=bf16, extra=dict(scale=2.0)),
]
GPU_CASES = [c for c in CASES if c.dtype != torch.float64] + [     # CUDA chunks: 64
    Case(B=2, T=70, H=1, HV=1, K=8, V=6, in_op=True, dtype=f32, initial_state=False),
    Case(B=1, T=140, H=2, HV=4, K=32, V=16, seqlens=[64, 1, 75], in_op=True, lower_bound=-5.0, dtype=bf16),
]

# (op, requires_grad, output_final_state or, for a backward, with dht)
FWD = [("chunk_kda_v1", False, True), ("_chunk_kda_fwd", True, True), ("_chunk_kda_fwd", True, False),
       ("_chunk_kda_fwd_torch", False, False)]
BWD = [("_chunk_kda_bwd", False, True), ("_chunk_kda_bwd", False, False), ("_chunk_kda_bwd_torch", False, True)]
REC = [("recurrent_kda_v1", False, True), ("_recurrent_kda_torch", False, True)]
ALL = FWD + BWD + REC


def _inputs(case, device, requires_grad):
    inputs, kw = case.make(device, seed=case.seed)
    kw.update(case.extra)
    if requires_grad:
        inputs = [x.requires_grad_() for x in inputs]
        for name in ("A_log", "dt_bias", "initial_state"):
            if kw.get(name) is not None:
                kw[name].requires_grad_()
    return inputs, kw


def _args(name, case, device, requires_grad, flag):
    op = kda_op(name)
    inputs, kw = _inputs(case, device, requires_grad)
    q, v = inputs[0], inputs[2]
    B, T, HV, V = v.shape
    N = B if kw.get("cu_seqlens") is None else kw["cu_seqlens"].numel() - 1
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if name.startswith(("recurrent", "_recurrent")):
        if kw.get("initial_state") is None:
            kw["initial_state"] = torch.zeros(N, HV, q.shape[-1], V, dtype=state_dtype, device=device)
        return op, op_args(op, inputs, kw)
    if "bwd" not in name:
        return op, op_args(op, inputs, kw, output_final_state=flag)
    g = gen(case.seed + 1)
    do = torch.randn(B, T, HV, V, generator=g).to(device=device, dtype=v.dtype)
    dht = torch.randn(N, HV, q.shape[-1], V, generator=g).to(device=device, dtype=state_dtype) if flag else None
    saved = {}
    arg_names = [a.name for a in op._schema.arguments]
    if "Aqk" in arg_names:                                # the forward's saved tensors, as autograd passes them
        fwd = kda_op("_chunk_kda_fwd")
        out = fwd(*op_args(fwd, inputs, kw, output_final_state=flag))
        saved = {"Aqk": out[2], "Tm": out[3]}
    return op, op_args(op, inputs, kw, do=do, dht=dht, **saved)


def _id(p):
    name, requires_grad, flag = p
    return f"{name}-{'grad' if requires_grad else 'nograd'}-{'ht' if flag else 'noht'}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("p", ALL, ids=_id)
def test_opcheck_cpu(p, case):
    op, args = _args(*p[:1], case, "cpu", *p[1:])
    opcheck(op, args)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("p", ALL, ids=_id)
def test_opcheck_cuda(p, case):
    op, args = _args(*p[:1], case, "cuda", *p[1:])
    opcheck(op, args)


def test_every_op_is_checked():
    """Each op registered under kda_ops appears in the lists above (a new op needs its opcheck)."""
    import kda_ops  # noqa: F401
    names = {n for n, _, _ in ALL}
    registered = {str(op).split("::")[-1] for op in torch._C._dispatch_get_all_op_names() if op.startswith("kda_ops::")}
    checked = {str(kda_op(n)).split(".")[1] for n in names}
    assert registered <= checked, registered - checked
