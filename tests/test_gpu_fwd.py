"""GPU forward of KDA (Triton) against the fp64 recurrence, computed on the GPU.

Every axis is covered without the full cross product: T in {1, 63, 64, 140, 500, 1000, 2048}, K = V in
{64, 100, 128, 256} and K != V at small sizes (K in {16, 32, 64}, V in {16, 32, 48}), (H, HV) in {(4, 4),
(2, 8), (2, 4)}, varlen with mixed lengths, every pre-processing flag, with and without an initial state,
bf16 / fp16 / fp32. Error: relative RMS ||a - b|| / ||b|| per tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch

from kda_ops.reference import naive_recurrent_kda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TOL = {torch.bfloat16: 5e-3, torch.float16: 2e-3, torch.float32: 1e-4}


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    HV: int
    D: int                             # K (and V unless V is given)
    dtype: torch.dtype = torch.bfloat16
    gate: bool = True                  # gate activation in the op (else g is a log decay already)
    lower_bound: Optional[float] = None
    a_log: bool = True
    dt_bias: bool = True
    l2norm: bool = True
    beta_sigmoid: bool = True
    neg_eigval: bool = False
    h0: bool = True
    seqlens: Optional[Tuple[int, ...]] = None   # varlen: B == 1, T == sum(seqlens)
    V: Optional[int] = None            # value size when it differs from K

    @property
    def Vd(self) -> int:
        return self.D if self.V is None else self.V

    @property
    def id(self) -> str:
        dt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        flags = [f for f, on in [("gate", self.gate), ("l2", self.l2norm), ("sig", self.beta_sigmoid),
                                 ("neg", self.neg_eigval), ("h0", self.h0)] if on]
        if self.gate and self.lower_bound is not None:
            flags.append(f"lb{self.lower_bound:g}")
        if self.gate and not self.a_log:
            flags.append("noAlog")
        if self.gate and not self.dt_bias:
            flags.append("nobias")
        size = f"D{self.D}" if self.V is None else f"K{self.D}-V{self.V}"
        head = f"B{self.B}-T{self.T}-H{self.H}-HV{self.HV}-{size}-{dt}"
        if self.seqlens:
            head = f"varlen{len(self.seqlens)}-" + head
        return head + "-" + "-".join(flags or ["plain"])


CASES = [
    Case(1, 1, 4, 4, 64),
    Case(2, 63, 2, 8, 100, h0=False),
    Case(2, 64, 4, 4, 128, lower_bound=-5.0),
    Case(1, 500, 2, 8, 256, lower_bound=-3.0, a_log=False, dt_bias=False),
    Case(2, 1000, 4, 4, 64, dtype=torch.float16, gate=False, l2norm=False, beta_sigmoid=False),
    Case(1, 2048, 4, 4, 128, neg_eigval=True),
    Case(2, 1000, 2, 8, 128, dtype=torch.float32),
    Case(1, 2048, 2, 8, 256, h0=False, dt_bias=False),
    Case(1, 1000, 4, 4, 100, dtype=torch.float32, gate=False, l2norm=False, beta_sigmoid=False, h0=False),
    Case(1, 782, 4, 4, 128, seqlens=(17, 200, 64, 1, 500)),
    Case(1, 1183, 2, 8, 100, lower_bound=-5.0, h0=False, seqlens=(63, 1000, 5, 115)),
    Case(1, 300, 4, 4, 64, dtype=torch.float32, neg_eigval=True, seqlens=(100, 64, 36, 100)),
    Case(1, 700, 2, 8, 128, dtype=torch.float16, seqlens=(300, 17, 383)),    # fp16 with the gate in the op
    # K != V and tiles smaller than the kernels' blocks
    Case(1, 140, 2, 4, 32, V=16, lower_bound=-5.0, seqlens=(64, 1, 75)),
    Case(2, 100, 1, 2, 16, V=48),
    Case(2, 200, 2, 2, 64, V=32, dtype=torch.float32, h0=False),
]


def make_inputs(c: Case, device="cuda", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    rn = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    B, T, H, HV, K = c.B, c.T, c.H, c.HV, c.D
    V = c.Vd
    q, k, v = rn(B, T, H, K), rn(B, T, H, K), rn(B, T, HV, V)
    if not c.l2norm:   # keep the recurrence well scaled: unit keys
        q, k = q / math.sqrt(K), torch.nn.functional.normalize(k, dim=-1)
    g = rn(B, T, HV, K) if c.gate else torch.nn.functional.logsigmoid(rn(B, T, HV, K) + 3.0)
    beta = rn(B, T, HV) if c.beta_sigmoid else torch.rand(B, T, HV, device=device, generator=gen)
    N = len(c.seqlens) if c.seqlens else B
    x = dict(
        q=q.to(c.dtype), k=k.to(c.dtype), v=v.to(c.dtype), g=g.to(c.dtype), beta=beta.to(c.dtype),
        A_log=(rn(HV) * 0.5) if c.gate and c.a_log else None,
        dt_bias=(rn(HV * K) * 0.5) if c.gate and c.dt_bias else None,
        initial_state=rn(N, HV, K, V) if c.h0 else None,
        cu_seqlens=(torch.tensor([0, *torch.tensor(c.seqlens).cumsum(0).tolist()], dtype=torch.int32,
                                 device=device) if c.seqlens else None),
    )
    return x


def reference(c: Case, x):
    d = lambda t: None if t is None else t.double()  # noqa: E731
    return naive_recurrent_kda(
        d(x["q"]), d(x["k"]), d(x["v"]), d(x["g"]), d(x["beta"]), scale=c.D ** -0.5,
        initial_state=d(x["initial_state"]), output_final_state=True,
        use_qk_l2norm_in_kernel=c.l2norm, use_gate_in_kernel=c.gate,
        use_beta_sigmoid_in_kernel=c.beta_sigmoid, allow_neg_eigval=c.neg_eigval,
        lower_bound=c.lower_bound if c.gate else None, cu_seqlens=x["cu_seqlens"],
        A_log=d(x["A_log"]), dt_bias=d(x["dt_bias"]))


def rel_rms(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_chunk_kda_fwd_triton(c: Case):
    from kda_ops.kernels import chunk_index, chunk_kda_fwd_triton
    from kda_ops.options import KDAInputs, KDAOptions
    x = make_inputs(c)
    opts = KDAOptions(scale=c.D ** -0.5, lower_bound=c.lower_bound if c.gate else None, use_qk_l2norm=c.l2norm,
                      use_gate=c.gate, use_beta_sigmoid=c.beta_sigmoid, allow_neg_eigval=c.neg_eigval)
    o, ht, _, _ = chunk_kda_fwd_triton(KDAInputs(**x), opts, chunk_index(c.B, c.T, x["cu_seqlens"]), True)
    torch.cuda.synchronize()
    ro, rht = reference(c, x)
    assert o.dtype == c.dtype and ht.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    eo, eh = rel_rms(o, ro), rel_rms(ht, rht)
    print(f"{c.id}: o {eo:.2e} ht {eh:.2e}")
    assert eo <= TOL[c.dtype], eo
    assert eh <= TOL[c.dtype], eh


@pytest.mark.parametrize("c", [CASES[1], CASES[9]], ids=lambda c: c.id)
def test_public_chunk_kda(c: Case):
    """The public op (CUDA branch -> chunk_kda_fwd_triton), once kda_ops.chunk_kda exists."""
    import kda_ops
    if not hasattr(kda_ops, "chunk_kda"):
        pytest.skip("kda_ops.chunk_kda not available yet")
    x = make_inputs(c, seed=1)
    o, ht = kda_ops.chunk_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=c.D ** -0.5,
        initial_state=x["initial_state"], output_final_state=True,
        use_qk_l2norm_in_kernel=c.l2norm, use_gate_in_kernel=c.gate,
        use_beta_sigmoid_in_kernel=c.beta_sigmoid, allow_neg_eigval=c.neg_eigval,
        lower_bound=c.lower_bound, cu_seqlens=x["cu_seqlens"], A_log=x["A_log"], dt_bias=x["dt_bias"])
    ro, rht = reference(c, x)
    assert rel_rms(o, ro) <= TOL[c.dtype]
    assert rel_rms(ht, rht) <= TOL[c.dtype]


def test_varlen_layout_compiled():
    """The varlen chunk index built by torch ops, compiled by Inductor == eager (torch 2.11's Inductor dropped
    the storage offset of a sliced searchsorted boundary tensor: the index searches a fresh tensor); also with
    values chunk_index has to sanitise."""
    from kda_ops.kernels import chunk_index
    for vals in ([0, 100, 137, 138, 331, 331, 1000], [3, 100, 90, 5000, 331, 331, 2000]):
        cu = torch.tensor(vals, dtype=torch.int32, device="cuda")
        eager = chunk_index(1, 1000, cu)
        got = torch.compile(lambda c: chunk_index(1, 1000, c)[2:], fullgraph=True)(cu)
        for a, b in zip(got, eager[2:]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["chunk_kda", "recurrent_kda"])
def test_eager_call_skips_the_dispatcher(name):
    """A plain eager call that needs no gradient runs the stable op's CUDA body without the dispatcher (the
    profiler sees no kda_ops op) and launches its kernels directly, as triton_op runs the body (every launch
    finds wrap_triton off: no higher-order-op dispatch); under a dispatch mode the same call goes through the
    op, with the same result bit for bit."""
    import contextlib
    from unittest import mock

    import kda_ops
    from kernel_inputs import launcher_modules
    from torch._library import triton as library_triton
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    c = CASES[9]                                            # varlen, with an initial state
    x = make_inputs(c, seed=2)
    if name == "recurrent_kda":                             # the decode step: one token per sequence
        x = {n: (t[:, :len(c.seqlens)] if n in "q k v g beta".split() else t) for n, t in x.items()}
        x["cu_seqlens"] = torch.arange(len(c.seqlens) + 1, dtype=torch.int32, device="cuda")
    kw = dict(use_qk_l2norm_in_kernel=c.l2norm, use_gate_in_kernel=c.gate, use_beta_sigmoid_in_kernel=c.beta_sigmoid,
              output_final_state=True)
    call = lambda: getattr(kda_ops, name)(**x, **kw)  # noqa: E731
    launches = []                                           # wrap_triton's state at each launch of the call
    wrap = torch.library.wrap_triton

    def spy(kernel):
        launches.append(library_triton.is_wrap_triton_enabled())
        return wrap(kernel)
    with contextlib.ExitStack() as stack:
        prof = stack.enter_context(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]))
        for module in launcher_modules():
            stack.enter_context(mock.patch.object(module, "wrap_triton", spy))
        o, ht = call()
    assert not [e.name for e in prof.events() if e.name.startswith("kda_ops::")]
    assert launches and not any(launches), launches
    with Seen():
        o2, ht2 = call()
    assert any(op.startswith(f"kda_ops.{name}_v1") for op in Seen.ops), Seen.ops
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
