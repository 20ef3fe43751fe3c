"""Candidate fix for the bf16 dA_log / ddt_bias error: split the stage-3 factored operands into tf32 hi + lo on
the own (diagonal) 16-row block only. Compares ALL (the kernels' roundings), ALL with that split (emu.DIAG_SPLIT)
and ALL with s3 -> s3P (the full split of next/intra-bwd-tf32x3), on the study's cases and do draws.

    python benchmarks/precision_bwd/diag_split.py      (repo root; CPU, a few minutes)
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from study import CASES, A, make, rel_rms  # noqa: E402
import emu  # noqa: E402

print("case do | ALL dA_log ddt_bias dg | diag split | full split (s3P)")
for cn, c in CASES.items():
    for ds in (8, 9, 10, 11):
        inputs, kw, do = make(c, do_seed=ds)
        ex = emu.run(inputs, kw, do)
        row = []
        for rs, diag in ((A, False), (A, True), (tuple(x if x != "s3" else "s3P" for x in A), False)):
            emu.DIAG_SPLIT = diag
            e = emu.run(inputs, kw, do, rs)
            row.append(" ".join(f"{rel_rms(e[n], ex[n]):.1e}" for n in ("dA_log", "ddt_bias", "dg")))
        emu.DIAG_SPLIT = False
        print(f"{cn} {ds} | " + " | ".join(row), flush=True)
