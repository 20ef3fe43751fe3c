"""The Triton backward kernels on CPU, under the Triton interpreter, against autograd through the recurrence.

TRITON_INTERPRET=1 must be set before triton is imported, so the pytest test below runs this file as a
script in a subprocess with the variable set and checks the JSON it prints: for every case, the relative
RMS error ||a - b|| / ||b|| of each gradient of kda_ops.kernels.chunk_kda_bwd_triton (which recomputes the
forward with the forward stages) against autograd through kda_ops.reference.naive_recurrent_kda in float64,
and that the backward given the forward's (Aqk, Tm) (what the op keeps) returns exactly the same gradients.

    python -m pytest tests/test_kernels_bwd.py            # the CI test (about 1.5 min on 2 cores)
    TRITON_INTERPRET=1 python tests/test_kernels_bwd.py   # the same cases, one JSON line each
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")
# fp32 kernels vs the fp64 recurrence (errors seen: <= 5e-5; the gate reductions are sums over tokens)
TOL = dict(dq=1e-4, dk=1e-4, dv=1e-4, dg=2e-4, dbeta=1e-4, dA_log=5e-4, ddt_bias=5e-4, dh0=1e-4)
TOL_BF16 = 3e-2     # bf16 inputs and bf16 forward intermediates (W, U, h, Vn), fp32 dots


def cases():
    import torch
    from kda_case import Case
    f32 = torch.float32
    return [
        Case(B=1, T=1, H=1, HV=1, K=16, V=16, dtype=f32),
        Case(B=2, T=37, H=1, HV=2, K=20, V=20, dtype=f32),
        Case(B=1, T=70, H=1, HV=1, K=16, V=20, dtype=f32, initial_state=False),
        Case(B=2, T=70, H=1, HV=2, K=16, V=16, in_op=True, dtype=f32),
        Case(B=1, T=70, H=1, HV=2, K=20, V=16, in_op=True, lower_bound=-5.0, allow_neg_eigval=True, dtype=f32,
             initial_state=False),
        Case(B=1, T=37, H=1, HV=1, K=16, V=16, in_op=True, allow_neg_eigval=True, dtype=f32),
        Case(B=1, T=110, H=1, HV=2, K=16, V=16, in_op=True, seqlens=[20, 70, 20], dtype=f32),
        Case(B=1, T=150, H=1, HV=1, K=20, V=16, seqlens=[70, 5, 75], dtype=f32),
        Case(B=1, T=70, H=1, HV=2, K=16, V=16, in_op=True, dtype=torch.bfloat16),
        Case(B=1, T=70, H=1, HV=2, K=80, V=72, in_op=True, dtype=f32),     # several K- and V-blocks
        # intra_bwd's paths: lower_bound = -5 bounds a 16-row block's log2 span by 8 * 5 / ln 2 < SPAN, so the
        # kernel is built without its test and exact path (common.bounded_gate); without lower_bound the path is
        # chosen per K-block from the data, and A_log >= 3 exceeds the span (exact path)
        Case(B=1, T=100, H=1, HV=2, K=40, V=16, in_op=True, lower_bound=-5.0, dtype=torch.bfloat16),
        Case(B=1, T=100, H=1, HV=2, K=40, V=16, in_op=True, a_log_range=(3.0, 3.5), dtype=f32),
        Case(B=1, T=100, H=1, HV=2, K=40, V=16, in_op=True, a_log_range=(3.0, 3.5), dtype=torch.bfloat16),
        Case(B=1, T=100, H=1, HV=2, K=40, V=16, in_op=True, a_log_range=(3.0, 3.5), l2norm=False, dtype=f32),
        # A_log in [1.5, 2]: most 16-row blocks span between SPAN and SPAN_UNIT of their midpoint (the fast path
        # with the in-op l2norm), the rest more (benchmarks/gate_spans.py's spreads)
        Case(B=1, T=128, H=1, HV=2, K=40, V=16, in_op=True, a_log_range=(1.5, 2.0), dtype=f32),
        Case(B=1, T=128, H=1, HV=2, K=40, V=16, in_op=True, a_log_range=(1.5, 2.0), dtype=torch.bfloat16),
    ]


# (case index, seed, with dht, scale of do and dht): extra runs of cases() above. Gradients of 2^70 leave the
# wide-span blocks' fast path no room below fp32's range (bwd_intra's test of the pair weights): exact path
EXTRA = [(3, 3, False, 1.0), (-2, 0, True, 2.0 ** 70)]


def run_case(case, seed=0, with_dht=True, scale=1.0):
    """Returns ({grad name: relative RMS error} (names missing on either side -> 'missing'), whether the
    backward with the forward's saved (Aqk, Tm) gave bitwise the same gradients) for one case."""
    import torch
    from kda_case import reference_grads, rel_rms
    from kda_ops.kernels import chunk_kda_bwd_triton, chunk_kda_fwd_triton

    inputs, kw = case.make("cpu", seed)
    q, k, v, g, beta = inputs
    g, beta = g.float(), beta.float()
    inputs = [q, k, v, g, beta]
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    N = len(case.seqlens) if case.seqlens else B
    gen = torch.Generator().manual_seed(seed + 1)
    do = (scale * torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)).to(v.dtype)
    dht = (scale * torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)).float()
    ref = reference_grads(inputs, kw, do, dht if with_dht else torch.zeros_like(dht))
    from kda_ops.kernels import chunk_index
    from kernel_inputs import bundles
    x, opts = bundles(inputs, kw)
    idx = chunk_index(B, T, x.cu_seqlens)
    out = chunk_kda_bwd_triton(do, dht if with_dht else None, x, opts, idx)
    _, _, Aqk, Tm = chunk_kda_fwd_triton(x, opts, idx, False)
    out_saved = chunk_kda_bwd_triton(do, dht if with_dht else None, x, opts, idx, (Aqk, Tm))
    same = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(out, out_saved))
    errs = {}
    for name, x in zip(GRADS, out):
        if (name in ref) != (x is not None):
            errs[name] = "missing"
        elif x is not None:
            assert x.dtype == ref_dtype(name, inputs, kw), (name, x.dtype)
            errs[name] = rel_rms(x, ref[name])
    return errs, same


def ref_dtype(name, inputs, kw):
    import torch
    q, k, v, g, beta = inputs
    return dict(dq=q.dtype, dk=k.dtype, dv=v.dtype, dg=g.dtype, dbeta=beta.dtype).get(name, torch.float32)


def test_kernels_bwd_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases()) + len(EXTRA), proc.stdout
    bad = [f"{r['id']}: the backward with the saved (Aqk, Tm) differs" for r in results if not r["saved_equal"]]
    for r in results:
        tol = TOL if "float32" in r["id"] else {n: TOL_BF16 for n in GRADS}
        for name, e in r["errs"].items():
            if e == "missing" or not e <= tol[name]:
                bad.append(f"{r['id']} {name}: {e}")
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    sys.path[:0] = [os.path.dirname(HERE), HERE]
    import torch
    torch.set_num_threads(2)
    for c in cases():
        errs, same = run_case(c)
        print(json.dumps(dict(id=c.id, errs=errs, saved_equal=same)), flush=True)
    for i, seed, with_dht, scale in EXTRA:
        c = cases()[i]
        errs, same = run_case(c, seed, with_dht, scale)
        tag = ("" if with_dht else "-nodht") + ("" if scale == 1.0 else f"-x{scale:g}")
        print(json.dumps(dict(id=c.id + tag, errs=errs, saved_equal=same)), flush=True)
