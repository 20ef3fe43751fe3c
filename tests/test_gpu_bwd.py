"""GPU backward of KDA (Triton) against autograd through the fp64 recurrence, computed on the GPU.

Every axis is covered without the full cross product: T in {1, 63, 64, 500, 1000, 2048}, K = V in
{64, 100, 128, 256}, (H, HV) in {(4, 4), (2, 8)}, varlen (>= 4 sequences, one shorter than a chunk), every
pre-processing flag, with / without an initial state and a final-state gradient; bf16 inputs (one fp16 case).
Error: relative RMS ||a - b|| / ||b|| per gradient, through the launcher (kda_ops.kernels.chunk_kda_bwd_triton)
and, for a few cases, through the public op (kda_ops.chunk_kda + .backward()).

    python -m pytest -q -m gpu tests/test_gpu_bwd.py
"""
from __future__ import annotations

import pytest
import torch

from kda_case import BF16_TOL as TOL, Case, op_grads, reference_grads, rel_rms

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")
bf16 = torch.bfloat16


def case(B, T, H, HV, D, dht=True, dtype=bf16, **kw):
    c = Case(B=B, T=T, H=H, HV=HV, K=D, V=D, dtype=dtype, **kw)
    return pytest.param(c, dht, id=c.id.replace("-bfloat16", "") + ("" if dht else "-nodht"))


CASES = [
    case(1, 1, 4, 4, 64, in_op=True),
    case(1, 1, 4, 4, 128, in_op=True),   # T = 1 at K = V = 128: the bwd_state build that faulted when T was specialised
    case(2, 63, 4, 4, 64, in_op=True),
    case(2, 64, 2, 8, 100, in_op=True, lower_bound=-5.0, initial_state=False),
    case(1, 500, 4, 4, 128, in_op=True, allow_neg_eigval=True),
    case(2, 500, 4, 4, 256, dht=False),
    case(1, 1000, 2, 8, 256, in_op=True, lower_bound=-5.0),
    case(1, 1000, 2, 8, 64, in_op=True, allow_neg_eigval=True, initial_state=False, dht=False),
    case(1, 2048, 4, 4, 128, in_op=True),
    case(1, 2048, 2, 8, 100),
    case(1, 1031, 2, 8, 100, in_op=True, lower_bound=-5.0, seqlens=[17, 300, 64, 500, 150]),
    case(1, 700, 4, 4, 128, in_op=True, seqlens=[200, 63, 1, 436], initial_state=False),
    case(1, 500, 2, 8, 128, in_op=True, dtype=torch.float16),
]


def make(c: Case, seed: int = 0):
    inputs, kw = c.make("cuda", seed)
    q, k, v, g, beta = inputs
    inputs = [q, k, v, g.float(), beta.float()]
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    N = len(c.seqlens) if c.seqlens else B
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(B, T, HV, V, generator=gen, device="cuda").to(v.dtype)
    dht = torch.randn(N, HV, K, V, generator=gen, device="cuda")
    return inputs, kw, do, dht


def check(errs: dict, got_names, ref):
    assert set(got_names) == {n for n in GRADS if n in ref}, (got_names, sorted(ref))
    bad = {n: e for n, e in errs.items() if not e <= TOL[n]}
    assert not bad, f"relative RMS over tolerance: {bad} (all: {errs})"


@pytest.mark.parametrize("c, with_dht", CASES)
def test_bwd_launcher(c, with_dht):
    from kda_ops.kernels import chunk_index, chunk_kda_bwd_triton
    from kernel_inputs import bundles
    inputs, kw, do, dht = make(c)
    q, k, v, g, beta = inputs
    ref = reference_grads(inputs, kw, do, dht if with_dht else torch.zeros_like(dht))
    x, opts = bundles(inputs, kw)
    out = chunk_kda_bwd_triton(do, dht if with_dht else None, x, opts, chunk_index(q.shape[0], q.shape[1],
                                                                                    x.cu_seqlens))
    got = {n: x for n, x in zip(GRADS, out) if x is not None}
    for n, x in got.items():
        assert torch.isfinite(x).all(), n
    assert [got[n].dtype for n in ("dq", "dk", "dv", "dg", "dbeta")] == [x.dtype for x in inputs]
    check({n: rel_rms(x, ref[n]) for n, x in got.items() if n in ref}, got, ref)


@pytest.mark.parametrize("c, with_dht", [CASES[1], CASES[9]])
def test_bwd_public_op(c, with_dht):
    import kda_ops
    inputs, kw, do, dht = make(c, seed=5)
    dht = dht if with_dht else torch.zeros_like(dht)
    ref = reference_grads(inputs, kw, do, dht)
    got = {n: x for n, x in op_grads(kda_ops.chunk_kda, inputs, kw, do, dht).items() if n not in ("o", "ht")}
    check({n: rel_rms(x, ref[n]) for n, x in got.items()}, got, ref)


@pytest.mark.parametrize("c, with_dht", [
    case(2, 200, 2, 2, 64, in_op=True, initial_state=False, dht=False),
    case(1, 331, 2, 4, 128, in_op=True, lower_bound=-5.0, seqlens=[100, 37, 1, 193]),
])
def test_bwd_public_op_compiled(c, with_dht, monkeypatch):
    """The public op inside torch.compile(fullgraph=True): Inductor runs our kernels through wrap_triton's
    functional form, which replaces every argument a kernel may write by its output copy (this once turned one
    placeholder shared by several absent arguments into the chunk's gate cumsum)."""
    import kda_ops
    from kernel_inputs import kernel_objects
    # one config per kernel in both runs: Inductor autotunes a user kernel's configs itself
    # (triton_heuristics.user_autotune), so it may pick another config than the eager autotuner, and a config's
    # summation order changes the bf16 roundings (dA_log, a sum of terms that cancel, then moves by ~1e-2)
    for obj in kernel_objects().values():
        if hasattr(obj, "configs"):
            monkeypatch.setattr(obj, "configs", obj.configs[:1])
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    inputs, kw, do, dht = make(c, seed=7)
    kw = dict(kw, output_final_state=with_dht)

    def fn_eager(q, k, v, g, beta, **kw):
        o, ht = kda_ops.chunk_kda(q, k, v, g, beta, **kw)
        return o, (ht if ht is not None else o.new_zeros(()))
    fn = torch.compile(fn_eager, fullgraph=True)

    ref = reference_grads(inputs, dict(kw, output_final_state=True), do, dht if with_dht else torch.zeros_like(dht))
    dht_op = dht if with_dht else torch.zeros((), device="cuda")
    got = op_grads(fn, inputs, kw, do, dht_op)
    eager = op_grads(fn_eager, inputs, kw, do, dht_op)
    # the same kernels with the same configs: compiled == eager up to the order of atomic adds and torch-side sums,
    # and the bf16 roundings that order flips
    diff = {n: rel_rms(x, eager[n]) for n, x in got.items()}
    assert all(e <= 1e-3 for e in diff.values()), f"compiled vs eager: {diff}"
    # and against fp64 within TOL. dA_log / ddt_bias are compared with FLA in tests/test_gpu_regimes.py, pooled
    # over many inputs: on one input the ratio of the two errors swings too far for a bound (over 96 draws,
    # kda_ops' error was more than 1.5x FLA's on 15, FLA's more than 1.5x kda_ops' on 26; docs/precision.md)
    errs = {n: rel_rms(x, ref[n]) for n, x in got.items() if n in ref}
    if not with_dht:
        errs.pop("ht", None)
    bad = {n: (e, TOL[n]) for n, e in errs.items() if not e <= TOL[n]}
    print(f"{c.id}: {errs}")
    assert not bad, f"relative RMS over its bound (error, bound): {bad} (all: {errs})"
