"""emu.run with no rounding vs autograd through the fp64 recurrence (validation of the emulation).

    python benchmarks/precision_bwd/check.py
"""
import sys, time, torch
import os
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), HERE]
from kda_case import Case, rel_rms, reference_grads
import emu
c = Case(B=2, T=200, H=2, HV=2, K=64, V=64, in_op=True, initial_state=False, dtype=torch.bfloat16)
inputs, kw = c.make(seed=7)
q, k, v, g, beta = inputs
inputs = [q, k, v, g.float(), beta.float()]
kw = dict(kw, output_final_state=True)
gen = torch.Generator().manual_seed(8)
do = torch.randn(2, 200, 2, 64, generator=gen).to(torch.bfloat16)
t = time.time(); ref = reference_grads(inputs, kw, do, torch.zeros(2, 2, 64, 64)); print("ref", time.time() - t)
for pr in (False, "mid", "row", "first"):          # emu.PAIR_REF: the correction is zero in exact arithmetic
    emu.PAIR_REF = pr
    t = time.time(); e = emu.run(inputs, kw, do); print(f"emu PAIR_REF={pr}", time.time() - t)
    for n in ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias"):
        print(n, rel_rms(e[n], ref[n]))
    print(ref["dA_log"], e["dA_log"])
    print("max |D_rc| (pair sums, exact 0):", float(e["Dpair"].abs().max()))
