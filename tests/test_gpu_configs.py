"""Every autotune config of every chunked kernel, one at a time, on the GPU, against the fp64 recurrence.

The other GPU tests run with whatever config the autotuner picks (or the first one with
KDA_OPS_AUTOTUNE=0), so a config that is never picked there is never checked; a benchmark run that picks it
would be the first to find out. Here each kernel runs in its own process (a faulting config kills the CUDA
context), which pins the kernel to one config after another and checks forward + backward of the public op
on a varlen case with GVA, in-op pre-processing and an initial state (K = 128), on K = 256 and K = 64, and on
a small varlen case with K != V (K = 32, V = 16: tiles wider than the data).
A config that does not fit in shared memory at a size is skipped there, as the autotuner skips it; the first
config (the one that runs without autotuning) must fit at every size, and every other config at one size at
least.

    python -m pytest -q -m gpu tests/test_gpu_configs.py
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

KERNELS = [
    "fwd_intra:chunk_kda_fwd_kernel_intra",
    "fwd_intra:chunk_kda_fwd_kernel_intra_rerun",
    "fwd_wu:chunk_kda_fwd_kernel_wu",
    "fwd_state:chunk_kda_fwd_kernel_state",
    "bwd_state:chunk_kda_bwd_kernel_state",
    "bwd_inter:chunk_kda_bwd_kernel_inter",
    "bwd_intra:chunk_kda_bwd_kernel_intra",
]


def run_all_configs(name: str) -> int:
    """In the child process: pin kda_ops.kernels.<module>.<kernel> to each config in turn and check."""
    import importlib

    from triton.runtime.errors import OutOfResources

    import kda_ops
    from kda_case import BF16_TOL as TOL, Case, op_grads, reference_grads, rel_rms

    def find(n):
        module, attr = n.split(":")
        return getattr(importlib.import_module(f"kda_ops.kernels.{module}"), attr)

    for other in KERNELS:                    # the kernels not under test keep their first config
        if other != name:
            find(other).configs = find(other).configs[:1]
    kernel = find(name)
    configs = list(kernel.configs)
    failed = 0
    checked = set()          # configs that ran at some size
    # K = 128 (the benchmark's size) varlen with GVA; K = 256 and K = 64 fixed length (configs that fit only
    # there, or spill there, have faulted before at sizes the first case does not reach: an inter config that
    # faulted at K = 64 alone); K = 32, V = 16 with the safe gate, where the tiles are wider than the data
    for c in (Case(B=1, T=331, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, in_op=True, seqlens=[100, 37, 1, 193]),
              Case(B=2, T=200, H=2, HV=2, K=256, V=256, dtype=torch.bfloat16, in_op=True),
              Case(B=2, T=200, H=2, HV=2, K=64, V=64, dtype=torch.bfloat16, in_op=True),
              Case(B=1, T=140, H=2, HV=4, K=32, V=16, dtype=torch.bfloat16, in_op=True, lower_bound=-5.0,
                   seqlens=[64, 1, 75])):
        inputs, kw = c.make("cuda", seed=3)
        inputs = [inputs[0], inputs[1], inputs[2], inputs[3].float(), inputs[4].float()]
        gen = torch.Generator(device="cuda").manual_seed(4)
        do = torch.randn(inputs[2].shape, generator=gen, device="cuda").to(torch.bfloat16)
        N = len(c.seqlens) if c.seqlens else c.B
        dht = torch.randn(N, c.HV, c.K, c.V, generator=gen, device="cuda")
        ref = reference_grads(inputs, kw, do, dht)
        for i, cfg in enumerate(configs):
            print(f"{c.id} config {i}: {cfg}", flush=True)
            kernel.configs = [cfg]
            kernel.cache.clear()
            try:
                got = op_grads(kda_ops.chunk_kda, inputs, kw, do, dht)
            except OutOfResources as e:
                # the autotuner skips a config that does not fit at this size; the first one runs without
                # autotuning (KDA_OPS_AUTOTUNE=0, the interpreter) and must fit everywhere
                print(f"{c.id} config {i}: {'FAIL ' if i == 0 else ''}does not fit ({e})", flush=True)
                failed += i == 0
                continue
            checked.add(i)
            errs = {n: rel_rms(x, ref[n]) for n, x in got.items()}
            bad = {n: e for n, e in errs.items() if not e <= TOL[n]}
            print(f"{c.id} config {i}: {'FAIL ' + str(bad) if bad else 'ok'} (max {max(errs.values()):.2e})",
                  flush=True)
            failed += bool(bad)
    for i in sorted(set(range(len(configs))) - checked):   # a config no case could check
        print(f"config {i}: FAIL fits at none of the sizes: {configs[i]}", flush=True)
        failed += 1
    return failed


@pytest.mark.parametrize("name", KERNELS)
def test_every_autotune_config(name):
    env = dict(os.environ, KDA_OPS_AUTOTUNE="1", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, f"{name}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    print(r.stdout)


if __name__ == "__main__":
    sys.exit(min(run_all_configs(sys.argv[1]), 1))
