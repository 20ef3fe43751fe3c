"""Shared test inputs and error metric: one place that draws KDA inputs for every test file."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from kda_ops.reference import l2norm


# The issues' bf16 bounds on the GPU, relative RMS vs the fp64 recurrence: outputs and the final state, then
# the gradients (tests/test_gpu_bwd.py, test_gpu_configs.py).
BF16_TOL = dict(o=5e-3, ht=5e-3, dq=8e-3, dk=8e-3, dv=8e-3, dh0=8e-3,
                dg=2e-2, dbeta=2e-2, dA_log=2e-2, ddt_bias=2e-2)


def stable_seed(text: str) -> int:
    """A seed derived from a string that is the same in every process (hash() is not: PYTHONHASHSEED)."""
    return zlib.crc32(text.encode()) % 100_003


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


@dataclass
class Case:
    """One KDA problem. `flags` turns on the in-op pre-processing (gate, l2norm, beta sigmoid)."""
    B: int = 2
    T: int = 63
    H: int = 2
    HV: int = 2
    K: int = 16
    V: int = 16
    in_op: bool = False
    lower_bound: Optional[float] = None
    allow_neg_eigval: bool = False
    initial_state: bool = True
    seqlens: Optional[list] = None           # varlen: B must be 1 and T == sum(seqlens)
    a_log_range: tuple = (0.0, 2.7)          # in-op gate: A_log ~ U(a_log_range) per value head
    l2norm: bool = True                      # in_op: the q/k l2norm in the op too (else q, k come normalised)
    dtype: torch.dtype = torch.float64
    extra: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        s = f"B{self.B}-T{self.T}-H{self.H}-HV{self.HV}-K{self.K}-V{self.V}"
        if self.seqlens:
            s += "-varlen" + "_".join(map(str, self.seqlens))
        if self.in_op:
            s += "-inop" + ("" if self.lower_bound is None else f"-lb{self.lower_bound:g}")
        if self.a_log_range != (0.0, 2.7):
            s += "-alog{:g}_{:g}".format(*self.a_log_range)
        if self.in_op and not self.l2norm:
            s += "-nol2"
        if self.allow_neg_eigval:
            s += "-neg"
        if not self.initial_state:
            s += "-noh0"
        return s + "-" + str(self.dtype).replace("torch.", "")

    @property
    def seed(self) -> int:
        """A per-case seed that reproduces in every process: ``case.make(seed=case.seed)``."""
        return stable_seed(self.id)

    def make(self, device="cpu", seed=0):
        """Returns (inputs, kwargs) for kda_ops.chunk_kda / naive_recurrent_kda. q, k, v, g and beta are all
        ``dtype`` (a bf16 case is bf16 throughout, as a bf16 model calls the op)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
        B, T, H, HV, K, V = self.B, self.T, self.H, self.HV, self.K, self.V
        q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
        N = len(self.seqlens) if self.seqlens else B
        kw = dict(output_final_state=True)
        if not (self.in_op and self.l2norm):
            q, k = l2norm(q), l2norm(k)
        if self.in_op:
            g, beta = rnd(B, T, HV, K), rnd(B, T, HV)
            kw.update(use_qk_l2norm_in_kernel=self.l2norm, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      allow_neg_eigval=self.allow_neg_eigval, lower_bound=self.lower_bound,
                      A_log=torch.empty(HV, dtype=torch.float64).uniform_(*self.a_log_range, generator=gen),
                      dt_bias=0.5 * rnd(HV * K))
        else:
            g = -torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) * 0.7
            beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
        if self.initial_state:
            kw["initial_state"] = 0.5 * rnd(N, HV, K, V)
        if self.seqlens:
            assert B == 1 and sum(self.seqlens) == T
            kw["cu_seqlens"] = torch.tensor([0] + list(torch.tensor(self.seqlens).cumsum(0)), dtype=torch.int32)
        inputs = [x.to(self.dtype) for x in (q, k, v, g, beta)]
        inputs = [x.to(device) for x in inputs]
        for name in ("initial_state", "A_log", "dt_bias"):
            if kw.get(name) is not None:
                kw[name] = kw[name].to(device=device, dtype=torch.float64 if self.dtype == torch.float64
                                       else torch.float32)
        if "cu_seqlens" in kw:
            kw["cu_seqlens"] = kw["cu_seqlens"].to(device)
        return inputs, kw


def op_grads(fn, inputs, kw, do, dht, cast=lambda x: x.clone()):
    """Outputs and gradients of fn (naive_recurrent_kda, kda_ops.chunk_kda, ...) for the loss
    <o, do> + <ht, dht>, with every float input cast (a copy) and made a leaf: dict of o, ht, dq, dk, dv, dg,
    dbeta and, when given, dh0, dA_log, ddt_bias."""
    ins = [cast(x.detach()).requires_grad_() for x in inputs]
    kw2 = {n: (cast(x.detach()).requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point()
               else x) for n, x in kw.items()}
    o, ht = fn(*ins, **kw2)
    dt = torch.float64 if o.dtype == torch.float64 else torch.float32      # the loss's accumulation dtype
    loss = (o.to(dt) * do.to(dt)).sum() + (ht.to(dt) * dht.to(dt)).sum()
    loss.backward()
    out = dict(o=o.detach(), ht=ht.detach(), dq=ins[0].grad, dk=ins[1].grad, dv=ins[2].grad, dg=ins[3].grad,
               dbeta=ins[4].grad)
    for name, key in (("initial_state", "dh0"), ("A_log", "dA_log"), ("dt_bias", "ddt_bias")):
        if kw2.get(name) is not None:
            out[key] = kw2[name].grad
    return out


def reference_grads(inputs, kw, do, dht):
    """Autograd through the float64 recurrence: returns dict of output and gradient tensors."""
    from kda_ops.reference import naive_recurrent_kda
    return op_grads(naive_recurrent_kda, inputs, kw, do, dht, cast=lambda x: x.double())


# ----------------------------------------------------------------------------------------------
# The registered ops by the names of the op schema (torch.ops.kda_ops.*), and their flat arguments.
# ----------------------------------------------------------------------------------------------
PUBLIC_OPS = ("chunk_kda_v1", "recurrent_kda_v1")
PRIVATE_OPS = ("_chunk_kda_fwd", "_chunk_kda_bwd", "_chunk_kda_fwd_torch", "_chunk_kda_bwd_torch",
               "_recurrent_kda_torch")


def kda_op(name: str):
    """The OpOverload ``torch.ops.kda_ops.<name>.default``."""
    import kda_ops  # noqa: F401  (registers the ops)
    return getattr(torch.ops.kda_ops, name).default


def op_args(op, inputs, kw, **values) -> tuple:
    """The positional arguments of ``op`` in its schema's order, by argument name, from a Case's
    (inputs, kwargs) and the extra ``values`` (do, dht, output_final_state, scale, ...). Arguments with a
    schema default that nothing names take the default."""
    q, k, v, g, beta = inputs
    named = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=kw.get("A_log"), dt_bias=kw.get("dt_bias"),
                 initial_state=kw.get("initial_state"), cu_seqlens=kw.get("cu_seqlens"),
                 scale=kw.get("scale") if kw.get("scale") is not None else q.shape[-1] ** -0.5,
                 lower_bound=kw.get("lower_bound"),
                 use_qk_l2norm=kw.get("use_qk_l2norm_in_kernel", False),
                 use_gate=kw.get("use_gate_in_kernel", False),
                 use_beta_sigmoid=kw.get("use_beta_sigmoid_in_kernel", False),
                 allow_neg_eigval=kw.get("allow_neg_eigval", False),
                 output_final_state=kw.get("output_final_state", True))
    named.update(values)
    args = []
    for arg in op._schema.arguments:
        if arg.name in named:
            args.append(named[arg.name])
        elif arg.has_default_value():
            args.append(arg.default_value)
        elif isinstance(arg.type, torch.OptionalType):      # e.g. chunk_indices: the op builds it when None
            args.append(None)
        else:
            raise KeyError(f"{op}: no value for argument {arg.name!r}")
    return tuple(args)
