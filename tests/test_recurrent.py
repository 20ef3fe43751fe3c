"""The decode step, kda_ops::recurrent_kda_v1: the CPU op, the Triton kernel (interpreter on CPU, and GPU),
and the hand-off from a chunked prefill to recurrent steps."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.library import opcheck

import kda_ops
from handwritten import hw_kda
from kda_case import Case, kda_op, op_args, rel_rms

# Case.extra holds the scale passed (none: the default K ** -0.5); most cases have K != V
CASES = [
    Case(B=2, T=1, H=2, HV=2, K=16, V=16, dtype=torch.float32, extra=dict(scale=0.7)),
    Case(B=3, T=4, H=1, HV=4, K=100, V=100, in_op=True, dtype=torch.float32),
    Case(B=2, T=2, H=2, HV=4, K=20, V=36, in_op=True, lower_bound=-3.0, allow_neg_eigval=True,
         dtype=torch.float32),
    Case(B=2, T=1, H=1, HV=2, K=16, V=8, in_op=True, initial_state=False, dtype=torch.float32),
    Case(B=1, T=6, H=1, HV=2, K=16, V=12, seqlens=[1, 0, 2, 3], in_op=True, dtype=torch.float32,
         extra=dict(scale=1.25)),
    Case(B=2, T=3, H=2, HV=2, K=64, V=32, in_op=True, dtype=torch.bfloat16),
    Case(B=2, T=3, H=1, HV=2, K=24, V=40, in_op=True, lower_bound=-1.0, dtype=torch.float64, extra=dict(scale=0.3)),
]
INTERPRETER_CASES = [c for c in CASES if c.dtype != torch.float64]
GPU_CASES = INTERPRETER_CASES + [
    Case(B=2, T=1, H=2, HV=4, K=256, V=256, in_op=True, dtype=torch.bfloat16),
    Case(B=64, T=1, H=8, HV=8, K=128, V=128, in_op=True, lower_bound=-5.0, dtype=torch.bfloat16),
]


def _inputs(case: Case, device="cpu"):
    inputs, kw = case.make(device, seed=case.seed)
    kw.pop("output_final_state")
    kw.update(case.extra)
    return inputs, kw


def _reference(inputs, kw):
    """tests/handwritten.py in float64 (zero initial state when absent). Not reference.naive_recurrent_kda:
    on CPU that is what the op runs."""
    return hw_kda(*[x.cpu() for x in inputs], **{n: (x.cpu() if isinstance(x, torch.Tensor) else x)
                                                 for n, x in kw.items()})


def _tolerance(dtype):
    # o is stored in the input dtype (bf16 rounding ~ 4e-3); the state stays fp32
    if dtype == torch.float64:
        return 1e-12, 1e-12
    return (1e-2, 1e-5) if dtype == torch.bfloat16 else (1e-5, 1e-5)


def _check(case, o, ht, inputs, kw):
    ro, rht = _reference(inputs, kw)
    o_tol, h_tol = _tolerance(case.dtype)
    state_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    assert o.dtype == inputs[2].dtype and ht.dtype == state_dtype
    assert rel_rms(o.cpu(), ro) <= o_tol
    assert rel_rms(ht.cpu(), rht) <= h_tol


# ----------------------------------------------------------------------------------------------
# (a) the CPU op
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cpu_op_matches_recurrence(case):
    inputs, kw = _inputs(case)
    o, ht = kda_ops.recurrent_kda(*inputs, **kw)
    _check(case, o, ht, inputs, kw)


@pytest.mark.parametrize("case", CASES[1:5], ids=lambda c: c.id)
def test_opcheck(case):
    inputs, kw = _inputs(case)
    N = len(case.seqlens) if case.seqlens else case.B
    h0 = kw.get("initial_state", torch.zeros(N, case.HV, case.K, case.V))
    op = kda_op("recurrent_kda_v1")
    opcheck(op, op_args(op, inputs, kw, initial_state=h0, output_final_state=True))


def test_state_is_functional():
    inputs, kw = _inputs(CASES[1])
    h0 = kw["initial_state"].clone()
    kda_ops.recurrent_kda(*inputs, **kw)
    assert torch.equal(kw["initial_state"], h0)


@pytest.mark.parametrize("case", [Case(B=2, T=70, H=1, HV=2, K=16, V=20, in_op=True, dtype=torch.float32),
                                  Case(B=1, T=66, H=2, HV=2, K=32, V=16, in_op=True, lower_bound=-2.0)],
                         ids=lambda c: c.id)
def test_prefill_then_steps_equals_full_chunk(case):
    """chunk_kda over a prefix, then recurrent_kda token by token == chunk_kda over everything."""
    inputs, kw = _inputs(case)
    kw.pop("initial_state")
    o_all, ht_all = kda_ops.chunk_kda(*inputs, output_final_state=True, **kw)
    P = 61
    o_pre, state = kda_ops.chunk_kda(*[x[:, :P] for x in inputs], output_final_state=True, **kw)
    outs = [o_pre]
    for t in range(P, case.T):
        o_t, state = kda_ops.recurrent_kda(*[x[:, t:t + 1] for x in inputs], initial_state=state, **kw)
        outs.append(o_t)
    tol = 1e-12 if case.dtype == torch.float64 else 1e-5
    assert rel_rms(torch.cat(outs, 1), o_all) <= tol
    assert rel_rms(state, ht_all) <= tol


# ----------------------------------------------------------------------------------------------
# (b) the Triton kernel under the interpreter, on CPU tensors (in a child process: TRITON_INTERPRET
#     must be set before triton is imported)
# ----------------------------------------------------------------------------------------------
def _interpreter_main():
    from kda_ops.kernels.recurrent import recurrent_kda_triton
    from kernel_inputs import bundles
    for case in INTERPRETER_CASES:
        inputs, kw = _inputs(case)
        N = len(case.seqlens) if case.seqlens else case.B
        h0 = kw.get("initial_state", torch.zeros(N, case.HV, case.K, case.V))
        x, opts = bundles(inputs, kw, scale=kw.get("scale"), initial_state=h0)
        o, ht = recurrent_kda_triton(x, opts)
        _check(case, o, ht, inputs, kw)
        print("ok", case.id)


def test_triton_kernel_under_interpreter():
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == len(INTERPRETER_CASES)


# ----------------------------------------------------------------------------------------------
# (c) the kernel on the GPU, through the op (eager and compiled)
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_op_matches_recurrence(case):
    inputs, kw = _inputs(case, "cuda")
    o, ht = kda_ops.recurrent_kda(*inputs, **kw)
    _check(case, o, ht, inputs, kw)


@pytest.mark.gpu
def test_gpu_compiled_decode_step():
    case = GPU_CASES[-2]
    inputs, kw = _inputs(case, "cuda")
    step = torch.compile(lambda *xs: kda_ops.recurrent_kda(*xs, **kw), fullgraph=True)
    o, ht = step(*inputs)
    _check(case, o, ht, inputs, kw)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _interpreter_main()
