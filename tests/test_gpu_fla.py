"""kda_ops.fla_compat against FLA's own chunk_kda / fused_recurrent_kda: the same inputs, the same call.

Every gate regime of kda_ops.testing.REGIMES, bf16, gate + l2norm + beta sigmoid in the op, both state
layouts (state_v_first False / True) with K != V, fixed length and varlen (int64 cu_seqlens), an initial
state and output_final_state=True; in the safe_gate regime both get safe_gate=True, lower_bound=-5.

  - chunk_kda: o and the final state of the two agree to relative RMS <= 1e-2 and each is within
    kda_case.BF16_TOL of the fp64 recurrence (kda_ops.naive_recurrent_kda on the GPU); the gradients of q, k,
    v, g, beta and the initial state agree to <= 2e-2; dA_log / ddt_bias and every error against fp64 are
    reported (tests/test_gpu_regimes.py bounds them).
  - fused_recurrent_kda (forward only: decode at T=1, and a short varlen batch): o and the final state, as above.

Their speed is a benchmark's: `python benchmarks/bench_kda.py --providers kda_ops fla fla_compat`. FLA runs the
first config of each of its autotuners (gpu_compare.fla_first_configs; KDA_OPS_FLA_AUTOTUNE=1 keeps its tuning):
its tuning compiles every config of every kernel at each new shape, minutes per test on a cold machine.

Tables are printed (pytest -s):

    KDA_OPS_AUTOTUNE=0 python -m pytest -q -s -p no:cacheprovider tests/test_gpu_fla.py
"""
from __future__ import annotations

import importlib.util
import functools

import pytest
import torch

import kda_ops
from gpu_compare import fla_first_configs, fmt, markdown_table, run
from kda_case import BF16_TOL, rel_rms, stable_seed
from kda_ops.testing import REGIMES, make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs FLA (fla-core)"),
]

DEVICE = "cuda"
DTYPE = torch.bfloat16
AGREE_OUT = 1e-2          # o, ht: kda_ops vs FLA
AGREE_GRAD = 2e-2         # dq, dk, dv, dg, dbeta, dh0: kda_ops vs FLA
ASSERT_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
REPORT_GRADS = ("dA_log", "ddt_bias")

CHUNK_SHAPES = {
    "B2-T300-H2-HV4-K128-V64": dict(B=2, T=300, H=2, HV=4, K=128, V=64),
    "varlen37_163_133-H2-HV4-K128-V64": dict(B=1, T=333, H=2, HV=4, K=128, V=64, cu_seqlens=[0, 37, 200, 333]),
}
RECURRENT_SHAPES = {
    "decode-B8-T1-H2-HV4-K128-V64": dict(B=8, T=1, H=2, HV=4, K=128, V=64),
    "varlen1_32_37-H2-HV4-K128-V64": dict(B=1, T=70, H=2, HV=4, K=128, V=64, cu_seqlens=[0, 1, 33, 70]),
}


def fla_ops():
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    return chunk_kda, fused_recurrent_kda


def inputs(spec: dict, regime: str, seed: int) -> dict:
    """make_inputs with an initial state, cu_seqlens as int64 (FLA's documented type; both get the same)."""
    spec = dict(spec)
    cu = spec.pop("cu_seqlens", None)
    x = make_inputs(**spec, regime=regime, dtype=DTYPE, device=DEVICE, seed=seed, initial_state=True,
                    cu_seqlens=cu)
    if "cu_seqlens" in x:
        x["cu_seqlens"] = x["cu_seqlens"].long()
    return x


def v_first(x: dict) -> dict:
    """The same problem with the initial state stored [N, HV, V, K]."""
    x = dict(x)
    x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    return x


def call(fn, **fixed):
    return functools.partial(fn, **fixed) if fixed else fn


def states_k_first(out: dict) -> dict:
    """ht and dh0 of a V-first call in the [N, HV, K, V] layout of the fp64 reference."""
    out = dict(out)
    for name in ("ht", "dh0"):
        if out.get(name) is not None:
            out[name] = out[name].transpose(-1, -2)
    return out


def table(rows) -> str:
    return markdown_table(["op", "regime", "shape", "state", "tensor", "kda_ops vs FLA", "kda_ops vs fp64",
                           "FLA vs fp64", "ok"],
                          [[op, r, s, lay, t, fmt(a), fmt(e), fmt(f), ok] for op, r, s, lay, t, a, e, f, ok in rows])


ROWS: list = []


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    if ROWS:
        print("\n\nkda_ops.fla_compat vs FLA on the same inputs (relative RMS; 'ok' is blank for reported-only "
              "rows)\n" + table(ROWS), flush=True)


def compare(op, regime, shape, layout, ours, theirs, ref, names, agree, problems):
    """Rows for ``names``; a name with a bound in ``agree`` must have kda_ops vs FLA within it, and with a
    BF16_TOL entry among o / ht, each of the two within BF16_TOL of fp64."""
    rows = []
    for name in names:
        a, b = ours.get(name), theirs.get(name)
        if a is None or b is None:
            problems.append(f"{layout} {name}: missing ({'kda_ops' if a is None else 'FLA'})")
            continue
        if not torch.isfinite(a).all():
            problems.append(f"{layout} kda_ops {name} is not finite")
        d, e, f = rel_rms(a, b), rel_rms(a, ref[name]), rel_rms(b, ref[name])
        ok = ""
        if name in agree:
            good = d <= agree[name]
            if name in ("o", "ht"):
                good = good and e <= BF16_TOL[name] and f <= BF16_TOL[name]
            ok = "yes" if good else "NO"
            if not good:
                problems.append(f"{layout} {name}: vs FLA {d:.3e} (bound {agree[name]:.0e}), vs fp64 kda_ops "
                                f"{e:.3e} FLA {f:.3e}")
        rows.append((op, regime, shape, layout, name, d, e, f, ok))
    return rows


@pytest.mark.parametrize("shape", list(CHUNK_SHAPES))
@pytest.mark.parametrize("regime", REGIMES)
def test_chunk_kda_matches_fla(regime, shape):
    from kda_ops import fla_compat
    chunk_fla, _ = fla_ops()
    seed = stable_seed(f"fla-chunk-{regime}-{shape}")
    x = inputs(CHUNK_SHAPES[shape], regime, seed)
    safe = dict(safe_gate=x["lower_bound"] is not None)
    gen = torch.Generator().manual_seed(seed + 1)
    B, T, HV, V = x["v"].shape
    N, K = x["initial_state"].shape[0], x["q"].shape[-1]
    do = torch.randn(B, T, HV, V, generator=gen).to(torch.bfloat16).float().to(DEVICE)
    dht = torch.randn(N, HV, K, V, generator=gen).to(DEVICE)
    ref = run(kda_ops.naive_recurrent_kda, x, do, dht, dtype=torch.float64)

    problems, rows = [], []
    names = ("o", "ht") + ASSERT_GRADS + REPORT_GRADS
    agree = dict(o=AGREE_OUT, ht=AGREE_OUT, **{n: AGREE_GRAD for n in ASSERT_GRADS})
    for layout in ("K-first", "V-first"):
        vf = layout == "V-first"
        xl, dht_l = (v_first(x), dht.transpose(-1, -2).contiguous()) if vf else (x, dht)
        ours = run(call(fla_compat.chunk_kda, state_v_first=vf, **safe), xl, do, dht_l)
        with fla_first_configs():
            theirs = run(call(chunk_fla, state_v_first=vf, **safe), xl, do, dht_l)
        for name in ("ht", "dh0"):
            assert ours[name].shape == theirs[name].shape == xl["initial_state"].shape, (layout, name)
        if vf:
            ours, theirs = states_k_first(ours), states_k_first(theirs)
        rows += compare("chunk_kda", regime, shape, layout, ours, theirs, ref, names, agree, problems)
    ROWS.extend(rows)
    print(f"\nchunk_kda {regime} {shape}\n" + table(rows), flush=True)
    assert not problems, f"chunk_kda {regime} {shape}: " + "; ".join(problems)


@pytest.mark.parametrize("shape", list(RECURRENT_SHAPES))
@pytest.mark.parametrize("regime", REGIMES)
def test_fused_recurrent_kda_matches_fla(regime, shape):
    from kda_ops import fla_compat
    _, recurrent_fla = fla_ops()
    x = inputs(RECURRENT_SHAPES[shape], regime, stable_seed(f"fla-recurrent-{regime}-{shape}"))
    ref = run(kda_ops.naive_recurrent_kda, x, dtype=torch.float64)
    problems, rows = [], []
    for layout in ("K-first", "V-first"):
        vf = layout == "V-first"
        xl = v_first(x) if vf else x
        ours = run(call(fla_compat.fused_recurrent_kda, state_v_first=vf), xl)
        with fla_first_configs():
            theirs = run(call(recurrent_fla, state_v_first=vf), xl)
        assert ours["ht"].shape == theirs["ht"].shape == xl["initial_state"].shape, layout
        assert ours["o"].dtype == theirs["o"].dtype, (ours["o"].dtype, theirs["o"].dtype)
        if vf:
            ours, theirs = states_k_first(ours), states_k_first(theirs)
        rows += compare("fused_recurrent_kda", regime, shape, layout, ours, theirs, ref, ("o", "ht"),
                        dict(o=AGREE_OUT, ht=AGREE_OUT), problems)
    ROWS.extend(rows)
    print(f"\nfused_recurrent_kda {regime} {shape}\n" + table(rows), flush=True)
    assert not problems, f"fused_recurrent_kda {regime} {shape}: " + "; ".join(problems)
