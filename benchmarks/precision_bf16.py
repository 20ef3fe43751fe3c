"""What rounding each forward intermediate to bf16 costs, on CPU: the numbers behind intra.py's / state.py's
choice of which tensors the forward stores in bf16 (W, qg, U, Aqk, kd) and which dot operands it rounds
(S for W S and qg S, Vn for Aqk Vn and kd^T Vn).

    python benchmarks/precision_bf16.py

The chunked forward of kda_ops.reference (fp64) is run once exactly and once with one tensor rounded to bf16
(round to nearest, as the GPU stores it) before the state pass uses it; printed: relative RMS error of the
output and the final state against the exact run. 'S' and 'Vn' round the state and the new values where
they enter a dot (S and Vn themselves stay exact, as the kernel keeps them in fp32).
'Tm' computes W and U as bf16 dots (Tm, beta k exp(gam) and beta v rounded first), as FLA does: measured
2026-11-29, o 2.38e-3 -> 2.90e-3 with every other rounding of the bf16 forward on.
(The Triton interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest: biased, about twice
these errors in the interpreter tests.) Case: tests/kda_case.Case with the gate, l2norm and beta
sigmoid in the op, T = 1024, K = V = 128, bf16 inputs, an initial state.
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from kda_case import Case, rel_rms  # noqa: E402
from kda_ops import reference as R  # noqa: E402


def main():
    c = Case(B=1, T=1024, H=2, HV=2, K=128, V=128, dtype=torch.bfloat16, in_op=True, initial_state=True)
    (q, k, v, g, beta), kw = c.make()
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    p, h0, _, _, _ = R._prepare(q, k, v, g, beta, kw["A_log"].double(), kw["dt_bias"].double(),
                                kw["initial_state"].double(), None, None, True, True, True, False, 64)
    x = R._Intra(p["q"], p["k"], p["v"], p["g"], p["beta"], c.K ** -0.5)
    scale = c.K ** -0.5

    bf = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    # 'Tm': W and U as bf16 dots, Tm and the right operands (beta k exp(gam), beta v) rounded to bf16 first
    w_lp = bf(x.tm) @ bf(x.beta[..., None] * x.kg)
    u_lp = bf(x.tm) @ bf(x.beta[..., None] * x.v)

    def forward(rounded):
        """o and the final state with the named tensors rounded to bf16 ('S', 'Vn': as dot operands)."""
        r = lambda name, t: bf(t) if name in rounded else t  # noqa: E731
        w, u = (w_lp, u_lp) if "Tm" in rounded else (x.w, x.u)
        S, outs = h0, []
        for i in range(x.gam.shape[2]):
            vn = r("U", u[:, :, i]) - r("W", w[:, :, i]) @ r("S", S)
            outs.append(scale * r("qg", x.qg[:, :, i]) @ r("S", S) + r("Aqk", x.aqk[:, :, i]) @ r("Vn", vn))
            S = x.eg_last[:, :, i, :, None] * S + r("kd", x.kd[:, :, i]).transpose(-1, -2) @ r("Vn", vn)
        return torch.stack(outs, 2), S

    o0, s0 = forward(())
    print(f"{'rounded to bf16':<24} {'o rel RMS':>10} {'state rel RMS':>14}")
    for rounded in [("U",), ("Aqk",), ("kd",), ("W",), ("qg",), ("S",), ("Vn",), ("W", "qg", "S"),
                    ("U", "Aqk", "kd", "W", "qg", "S"),
                    ("Aqk", "kd", "W", "qg", "S", "Vn"),               # every dot bf16, U kept fp32
                    ("U", "Aqk", "kd", "W", "qg", "S", "Vn"),          # the bf16 forward (lowp)
                    ("Tm",), ("Tm", "U", "Aqk", "kd", "W", "qg", "S", "Vn")]:   # + W, U as bf16 dots
        o1, s1 = forward(rounded)
        print(f"{', '.join(rounded):<24} {rel_rms(o1, o0):>10.2e} {rel_rms(s1, s0):>14.2e}")


if __name__ == "__main__":
    main()
