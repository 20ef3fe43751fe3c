"""Every Triton launch gets pairwise distinct tensors (no two pointer arguments share memory).

Under torch.compile, wrap_triton's functional form replaces each argument a kernel may write by that
argument's output copy; an absent optional argument that reused another tensor as its placeholder was thereby
aliased into a real output (the gate cumsum) and compiled training computed garbage while eager was right.
This test records the launches of every launcher (interpreter, tiny shapes, with and without each optional
tensor) and checks that no two tensor arguments of one launch overlap in memory. The same launches show which
size each autotuned kernel puts in its key (TUNE_SIZE), which intra kernels are built for the bounded safe gate
(BOUNDED), and which gate floor and build the 16-bit inputs get (G_FLOOR, EXACT).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


# In the child, the launchers' size classes are replaced by these encodings of their arguments, so that the
# test sees what each kernel was given
SIZE_TAG, LANES_TAG = 1_000_000, 2_000_000


def record_launches():
    """In the child (TRITON_INTERPRET=1): run the launchers, return [(kernel, [overlapping argument pairs],
    TUNE_SIZE or None, BOUNDED or None, (tokens, sequences, value heads, lower_bound, dtype) of the call,
    SAVED_A or None, {EXACT, G_FLOOR: their values, where given})]; kernel: the name it has in its module (the
    backward's rerun of the forward intra kernel is chunk_kda_fwd_kernel_intra_rerun)."""
    import torch

    from kda_case import Case

    launches = []
    call = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                fn = self.kernel.fn if hasattr(self.kernel, "configs") else self.kernel
                named = dict(zip(fn.arg_names, args), **kwargs)
                tensors = [(n, t) for n, t in named.items() if isinstance(t, torch.Tensor)]
                spans = [(n, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for n, t in tensors]
                overlaps = [(a, b) for i, (a, pa, na) in enumerate(spans) for (b, pb, nb) in spans[i + 1:]
                            if pa < pb + max(nb, 1) and pb < pa + max(na, 1)]
                launches.append((names[id(self.kernel)], overlaps, named.get("TUNE_SIZE"), named.get("BOUNDED"),
                                 call[-1], named.get("SAVED_A"),
                                 {f: named[f] for f in ("EXACT", "G_FLOOR") if f in named}))
                return self.kernel[grid](*args, **kwargs)
            return launch

    from kda_ops.kernels import chunk_index, chunk_kda_bwd_triton, chunk_kda_fwd_triton
    from kda_ops.kernels.recurrent import recurrent_kda_triton
    from kernel_inputs import bundles, kernel_objects, launcher_modules

    kernels = kernel_objects()
    names = {id(obj): name for (_, name), obj in kernels.items()}
    for mod in launcher_modules():
        mod.wrap_triton = Recorder
        if hasattr(mod, "tune_size"):
            mod.tune_size = lambda tokens, heads: SIZE_TAG + 1000 * tokens + heads
        if hasattr(mod, "tune_lanes"):
            mod.tune_lanes = lambda sequences, heads: LANES_TAG + 1000 * sequences + heads

    f32, bf16 = torch.float32, torch.bfloat16
    for full, lower_bound, dtype in ((False, None, f32), (True, None, f32), (False, -5.0, f32), (False, None, bf16)):
        # grouped value heads (HV != H), so that a key given H instead of HV shows; bf16 with the in-op gate and
        # l2norm: the 16-bit gate floor
        c = Case(B=1 if full else 2, T=70, H=2, HV=4, K=16, V=16, dtype=dtype,
                 in_op=full or lower_bound is not None or dtype == bf16, initial_state=full,
                 seqlens=[30, 40] if full else None, lower_bound=lower_bound)
        (q, k, v, g, beta), kw = c.make()
        x, opts = bundles([q, k, v, g.float(), beta.float()], kw, scale=16 ** -0.5)
        idx = chunk_index(c.B, c.T, x.cu_seqlens)
        N = len(c.seqlens) if c.seqlens else c.B
        call.append((c.B * c.T, N, c.HV, lower_bound, str(dtype)))
        _, _, Aqk, Tm = chunk_kda_fwd_triton(x, opts, idx, full)
        dht = torch.randn(N, c.HV, 16, 16) if full else None
        chunk_kda_bwd_triton(torch.randn_like(v), dht, x, opts, idx)
        chunk_kda_bwd_triton(torch.randn_like(v), dht, x, opts, idx, (Aqk, Tm))   # with the forward's Aqk, Tm
        h0 = kw.get("initial_state")
        recurrent_kda_triton(x._replace(initial_state=h0 if h0 is not None else torch.zeros(N, c.HV, 16, 16)), opts)
    return launches


def test_launch_arguments_do_not_alias():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    launches = json.loads(r.stdout.strip().splitlines()[-1])
    # fwd: intra, wu, state; bwd: 8 stages; decode; varlen (the second case) adds the zeroing of uncovered tokens
    # of o (fwd) and of the 5 token gradients (bwd)
    assert len(launches) == 4 * (3 + 2 * 8 + 1) + 1 + 2 * 5, launches
    bad = [(name, pairs) for name, pairs, *_ in launches if pairs]
    assert not bad, f"launches with overlapping tensor arguments: {bad}"
    # the size in each autotune key: the state passes' lanes are sequences x heads (the length only sets how
    # long each lane runs), the chunk-parallel kernels' size is tokens x heads
    tuned = {}
    for name, _, tune, _, (tokens, sequences, heads, _, _), _, _ in launches:
        if tune is not None:
            want = LANES_TAG + 1000 * sequences + heads if "state" in name else SIZE_TAG + 1000 * tokens + heads
            assert tune == want, (name, tune, want)
            tuned[name] = tune
    assert len(tuned) == 7, sorted(tuned)
    # the in-op gate with lower_bound = -5 builds both intra kernels without their span test and exact path
    # (kernels.common.bounded_gate); without lower_bound they keep them. Only speed depends on it (either build
    # is correct for a bounded gate), so no accuracy test would see a launcher that lost the flag
    flags = {}
    for name, _, _, bounded, (*_, lb, _), _, _ in launches:
        if bounded is not None:
            flags.setdefault((name, lb), set()).add(bounded)
    assert flags == {(kernel, lb): {lb is not None} for kernel in ("chunk_kda_fwd_kernel_intra",
                     "chunk_kda_fwd_kernel_intra_rerun", "chunk_kda_bwd_kernel_intra") for lb in (None, -5.0)}, flags
    # the backward's rerun with the forward's Aqk and Tm runs on the rerun's own autotuner (its configs), the
    # forward and a backward without them on the forward's
    saved = {(name, s) for name, *_, s, _ in launches if name.startswith("chunk_kda_fwd_kernel_intra")}
    assert saved == {("chunk_kda_fwd_kernel_intra", False), ("chunk_kda_fwd_kernel_intra_rerun", True)}, saved
    # the gate's floor (kernels.common.gate_floor): 16-bit inputs with the in-op gate and l2norm floor at
    # G_MIN_16BIT in the forward, its rerun and the gate's gradient alike, and the intra kernels drop the exact path
    # (as with the safe gate); fp32 keeps G_MIN. Only speed and the size of an invisible term depend on it
    from kda_ops.kernels.common import G_MIN, G_MIN_16BIT
    builds = {}
    for name, _, _, _, (*_, lb, dt), _, consts in launches:
        if "G_FLOOR" in consts:
            builds.setdefault((name, lb, dt), set()).add((consts.get("EXACT"), consts["G_FLOOR"]))
    want = {}
    f32, bf16 = "torch.float32", "torch.bfloat16"
    for lb, dt, exact, floor in ((None, f32, True, G_MIN.value), (-5.0, f32, False, G_MIN.value),
                                 (None, bf16, False, G_MIN_16BIT.value)):
        for name in ("chunk_kda_fwd_kernel_intra", "chunk_kda_fwd_kernel_intra_rerun"):
            want[(name, lb, dt)] = {(exact, floor)}
        want[("chunk_kda_bwd_kernel_gate", lb, dt)] = {(None, floor)}
    assert builds == want, builds


def test_lengths_are_not_specialised():
    """Every kernel leaves its length-like integer arguments (kernels.common.LENGTH_ARGS) unspecialised, so a call
    at a new sequence length reuses the compiled kernels (Triton specialises an int on == 1 and % 16 == 0)."""
    from kernel_inputs import base_kernel, kernel_objects

    from kda_ops.kernels.common import LENGTH_ARGS

    kernels = {f"{module}.{name}": base_kernel(obj) for (module, name), obj in kernel_objects().items()}
    assert len(kernels) == 11, sorted(kernels)     # fwd_intra has two autotuners (the rerun) over one kernel
    for name, fn in kernels.items():
        lengths = [a for a in fn.arg_names if a in LENGTH_ARGS]
        assert lengths, name
        # under TRITON_INTERPRET=1 the kernel is an InterpretedFunction, which keeps the jit arguments it was given
        kept = fn.do_not_specialize if hasattr(fn, "do_not_specialize") else fn.kwargs.get("do_not_specialize", ())
        assert set(lengths) <= set(kept), (name, lengths, kept)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    print(json.dumps(record_launches()))
