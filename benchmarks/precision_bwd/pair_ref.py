"""Candidate fix for the bf16 dA_log / ddt_bias error without extra precision: emu.PAIR_REF, the
cancellation-aware correction of the stage-3 pair terms (see emu.py). Compares ALL (the kernels' roundings) with
ALL + PAIR_REF for each reference choice, on the study's cases and do draws and on c3 (tests/test_gpu_bwd.py
case(1, 1000, 2, 8, 64, in_op=True, allow_neg_eigval=True, initial_state=False, dht=False)).

    PYTHONPATH=. python benchmarks/precision_bwd/pair_ref.py      (repo root; CPU, ~7 min)
"""
import os
import sys
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from study import CASES, A, make, rel_rms, Case  # noqa: E402
import emu  # noqa: E402

CASES = dict(CASES, c3=Case(B=1, T=1000, H=2, HV=8, K=64, V=64, in_op=True, allow_neg_eigval=True,
                            initial_state=False, dtype=torch.bfloat16))
SEEDS = dict(c1=(8, 9, 10, 11), c2=(8, 9, 10, 11), c3=(8, 9))
# (label, PAIR_REF, DIAG_SPLIT, SPAN3 < 0: stage 3 always on the exact path)
VARIANTS = [("PAIR_REF=False", False, False, False), ("PAIR_REF=mid", "mid", False, False),
            ("PAIR_REF=row", "row", False, False), ("PAIR_REF=first", "first", False, False),
            # combinations with the earlier candidate fixes that treat the diagonal blocks
            ("DIAG_SPLIT", False, True, False), ("DIAG_SPLIT + PAIR_REF=mid", "mid", True, False),
            ("exact path", False, False, True), ("exact path + PAIR_REF=mid", "mid", False, True)]
print("dA_log ddt_bias dg, rel RMS vs exact fp64, all roundings (ALL), per variant")
print("case do | " + " | ".join(v[0] for v in VARIANTS))
for cn, c in CASES.items():
    for ds in SEEDS[cn]:
        inputs, kw, do = make(c, do_seed=ds)
        emu.PAIR_REF = False
        ex = emu.run(inputs, kw, do)
        row = []
        for _, pr, dsplit, exact in VARIANTS:
            emu.PAIR_REF, emu.DIAG_SPLIT, emu.SPAN3 = pr, dsplit, (-1.0 if exact else emu.SPAN)
            e = emu.run(inputs, kw, do, A)
            row.append(" ".join(f"{rel_rms(e[n], ex[n]):.1e}" for n in ("dA_log", "ddt_bias", "dg")))
        emu.PAIR_REF, emu.DIAG_SPLIT, emu.SPAN3 = False, False, emu.SPAN
        print(f"{cn} {ds} | " + " | ".join(row), flush=True)
