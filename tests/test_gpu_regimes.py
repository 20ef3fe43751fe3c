"""bf16 chunk_kda on CUDA in every gate regime against the fp64 recurrence, beside FLA on the same inputs.

For each regime of kda_ops.testing.REGIMES (gate, l2norm and beta sigmoid in the op; lower_bound=-5 in
safe_gate), three shapes with odd sizes (K=100, V=60 with HV=2H; varlen with a sequence shorter than a chunk;
K=V=128 at T=1000) and SEEDS input draws of each (4; KDA_OPS_REGIME_SEEDS=N for more; fewer pool too few
draws for the dA_log bound below, docs/precision.md "Against FLA"): o and the final state,
and the gradients of q, k, v, g, beta, A_log, dt_bias and the initial state for the loss <o, do> + <ht, dht>,
as relative RMS against autograd through kda_ops.naive_recurrent_kda in float64, run on the GPU on the same
inputs upcast.

Bounds: kda_case.BF16_TOL for o, ht, dq, dk, dv, dh0, dg, dbeta, on every input. dA_log and ddt_bias are sums
over every token of a head with heavy cancellation, and their relative error over HV numbers swings by 10x from
one input draw to the next for any bf16 kernel (FLA's included: over 96 draws, each implementation's error was
more than 1.5x the other's on 15-26 of them). They are bounded per regime, pooled over the regime's inputs
(the root mean square of the per-input errors): at most FLA_FACTOR x FLA's pooled error (fla.ops.kda.chunk_kda;
safe_gate=True, lower_bound=-5 in the safe_gate regime; each FLA kernel on its first config,
gpu_compare.fla_first_configs) on the same inputs, measured in the same test; at most
BF16_TOL's 2e-2 when FLA is not importable (KDA_OPS_REQUIRE_FLA=1 turns a missing FLA into a failure). Every
error is printed, per input and as one table at the end of the module (pytest -s shows it):

    KDA_OPS_AUTOTUNE=0 KDA_OPS_REQUIRE_FLA=1 python -m pytest -q -s -p no:cacheprovider tests/test_gpu_regimes.py
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import kda_ops
from gpu_compare import FLA_BOUNDED, FLA_FACTOR, fla_first_configs, fmt, load_fla, markdown_table, require_fla, run
from kda_case import BF16_TOL, rel_rms, stable_seed
from kda_ops.testing import REGIMES, make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = "cuda"
DTYPE = torch.bfloat16
TENSORS = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")

SHAPES = {
    "B2-T300-H2-HV4-K100-V60": dict(B=2, T=300, H=2, HV=4, K=100, V=60),
    "varlen37_163_133-H2-HV4-K100-V60": dict(B=1, T=333, H=2, HV=4, K=100, V=60, cu_seqlens=[0, 37, 200, 333]),
    "B1-T1000-H2-K128-V128": dict(B=1, T=1000, H=2, HV=2, K=128, V=128),
}

SEEDS = int(os.environ.get("KDA_OPS_REGIME_SEEDS", "4"))     # input draws per (regime, shape)

ROWS: list = []        # (regime, shape or "pooled", tensor, kda_ops error, FLA error or None, bound, ok)


def seeds(regime: str, shape: str) -> list:
    return [stable_seed(f"regimes-{regime}-{shape}")] + list(range(1000, 1000 + SEEDS - 1))


def pooled(errors: list) -> float:
    """The root mean square of per-input errors."""
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def cotangents(x: dict, seed: int):
    """do [B, T, HV, V] (bf16 values, so that every path sees the same numbers) and dht [N, HV, K, V] fp32."""
    gen = torch.Generator().manual_seed(seed)
    B, T, HV, V = x["v"].shape
    N, K = x["initial_state"].shape[0], x["q"].shape[-1]
    do = torch.randn(B, T, HV, V, generator=gen).to(torch.bfloat16).to(device=x["v"].device, dtype=torch.float32)
    dht = torch.randn(N, HV, K, V, generator=gen).to(x["v"].device)
    return do, dht


def table(rows) -> str:
    return markdown_table(["regime", "shape", "tensor", "kda_ops vs fp64", "FLA vs fp64", "bound", "ok"],
                          [[r, s, t, fmt(e), fmt(f), "pooled" if math.isnan(b) else f"{b:.2e}", "yes" if ok else "NO"]
                           for r, s, t, e, f, b, ok in rows])


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    if ROWS:
        chunk_kda, why = load_fla()
        print(f"\n\nchunk_kda bf16 vs the fp64 recurrence, every gate regime (relative RMS; FLA: "
              f"{'fla.ops.kda.chunk_kda' if chunk_kda else 'not importable, ' + why}; bound for dA_log / "
              f"ddt_bias = {FLA_FACTOR} x FLA's error pooled over the regime's inputs; rows: the pooled ones and "
              f"any that failed)\n" + table(ROWS), flush=True)


def one_input(regime: str, shape: str, seed: int, fla_fn):
    """(kda_ops' and FLA's errors by tensor name (FLA's None without FLA), problems found)."""
    spec = dict(SHAPES[shape])
    cu = spec.pop("cu_seqlens", None)
    x = make_inputs(**spec, regime=regime, dtype=DTYPE, device=DEVICE, seed=seed, cu_seqlens=cu,
                    initial_state=True)
    do, dht = cotangents(x, seed + 1)

    ref = run(kda_ops.naive_recurrent_kda, x, do, dht, dtype=torch.float64)
    got = run(kda_ops.chunk_kda, x, do, dht)
    assert set(got) == set(TENSORS) == set(ref), (sorted(got), sorted(ref))
    for name in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        assert got[name].dtype == DTYPE, (name, got[name].dtype)
    assert got["ht"].dtype == torch.float32

    problems = []
    fla = None
    if fla_fn is not None:
        try:
            with fla_first_configs():
                fla = run(fla_fn, x, do, dht)
        except Exception as e:                        # reported as a failure, after the table
            problems.append(f"seed {seed}: FLA raised {type(e).__name__}: {e}")
    ours, theirs = {}, {}
    for name in TENSORS:
        if not torch.isfinite(got[name]).all():
            problems.append(f"seed {seed}: kda_ops {name} is not finite")
        ours[name] = rel_rms(got[name], ref[name])
        theirs[name] = None
        if fla is not None:
            if fla.get(name) is None:
                problems.append(f"seed {seed}: FLA gave no {name}")
            else:
                theirs[name] = rel_rms(fla[name], ref[name])
    return ours, theirs, problems


@pytest.mark.parametrize("regime", REGIMES)
def test_chunk_kda_regime_vs_fp64(regime):
    fla_fn = require_fla()

    problems, rows = [], []
    sums = {name: ([], []) for name in FLA_BOUNDED}   # per-input errors: kda_ops', FLA's
    for shape in SHAPES:
        for seed in seeds(regime, shape):
            ours, theirs, found = one_input(regime, shape, seed, fla_fn)
            problems += [f"{shape} {p}" for p in found]
            per_input = []
            for name in TENSORS:
                if name in FLA_BOUNDED:
                    sums[name][0].append(ours[name])
                    sums[name][1].append(theirs[name])
                    bound, ok = float("nan"), True          # bounded after the loop, pooled
                else:
                    bound = BF16_TOL[name]
                    ok = ours[name] <= bound
                    if not ok:
                        problems.append(f"{shape} seed {seed} {name}: {ours[name]:.3e} > {bound:.3e}")
                per_input.append((regime, f"{shape} seed {seed}", name, ours[name], theirs[name], bound, ok))
            print(f"\n{regime} {shape} seed {seed}\n" + table(per_input), flush=True)
            rows += per_input
    for name, (mine, fla_errs) in sums.items():
        err = pooled(mine)
        fla_err = None if fla_fn is None or None in fla_errs else pooled(fla_errs)
        if fla_fn is None:
            bound = BF16_TOL[name]
        else:
            bound = FLA_FACTOR * fla_err if fla_err is not None else float("nan")
        ok = err <= bound
        if not ok:
            problems.append(f"pooled {name}: {err:.3e} > {bound:.3e}")
        rows.append((regime, f"pooled over {len(mine)} inputs", name, err, fla_err, bound, ok))
    ROWS.extend(r for r in rows if r[1].startswith("pooled") or not r[-1])
    print(f"\n{regime}, pooled\n" + table(rows[-len(FLA_BOUNDED):]), flush=True)
    assert not problems, f"{regime}: " + "; ".join(problems)
