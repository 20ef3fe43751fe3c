"""Which rounding of the kernel backward makes dA_log / ddt_bias inaccurate? (CPU, fp64 emulation: emu.py)

    python benchmarks/precision_bwd/study.py        (repo root; CPU, ~8 min)
Writes results.json next to it and prints the tables of REPORT.md.
"""
import sys, json, torch
import os
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), HERE]
from kda_case import Case, rel_rms
import emu

CASES = {
    "c1": Case(B=2, T=200, H=2, HV=2, K=64, V=64, in_op=True, initial_state=False, dtype=torch.bfloat16),
    "c2": Case(B=1, T=300, H=2, HV=4, K=128, V=128, in_op=True, initial_state=False, dtype=torch.bfloat16),
}
NAMES = ("dq", "dk", "dv", "dg", "dgact", "dbeta", "dA_log", "ddt_bias")
A = emu.ALL


def make(c, seed=7, do_seed=8):
    inputs, kw = c.make(seed=seed)
    q, k, v, g, beta = inputs
    inputs = [q, k, v, g.float(), beta.float()]          # as tests/test_gpu_bwd.make
    gen = torch.Generator().manual_seed(do_seed)          # CPU generator (the GPU test draws on CUDA)
    do = torch.randn(c.B, c.T, c.HV, c.V, generator=gen).to(v.dtype)
    return inputs, kw, do


def chunk_cumsum(g, C=64):
    return torch.cat([g[:, c0:c0 + C].cumsum(1) for c0 in range(0, g.shape[1], C)], 1)


def heads(x):
    return x.movedim(2, 0).reshape(x.shape[2], -1)


def cancellation(ex):
    """per head: sum|t|/|sum t| for the two exact forms of dA_log: t = dg_t g_t (over tokens, channels) and
    t = dGam_s Gam_s (dGam before the in-chunk reverse cumsum, Gam the in-chunk cumsum of g)."""
    t1 = heads(ex["dgact"] * ex["g_act"])
    t2 = heads(ex["dgam"] * chunk_cumsum(ex["g_act"]))
    return (t1.abs().sum(1) / t1.sum(1).abs()).tolist(), (t2.abs().sum(1) / t2.sum(1).abs()).tolist()


def coherence(ex, e):
    """|sum err_i w_i| / sqrt(sum (err_i w_i)^2) per head: ~1 for independent errors, up to sqrt(n) for
    coherent ones. (1) err = dg error, w = g (dA_log = sum dg g); (2) err = dGam error, w = Gam."""
    e1 = heads((e["dgact"] - ex["dgact"]) * ex["g_act"])
    e2 = heads((e["dgam"] - ex["dgam"]) * chunk_cumsum(ex["g_act"]))
    f = lambda x: (x.sum(1).abs() / x.pow(2).sum(1).sqrt()).tolist()  # noqa: E731
    return f(e1), f(e2)


def iid_prediction(ex, e):
    """rel RMS of dA_log expected if the errors were independent with the measured per-tensor RMS:
    m1: iid errors on dg (same RMS as measured), m2: iid errors on dGam (same RMS as measured)."""
    den = ex["dA_log"].norm()
    s1 = (e["dgact"] - ex["dgact"]).pow(2).mean().sqrt()
    s2 = (e["dgam"] - ex["dgam"]).pow(2).mean().sqrt()
    v1 = s1 ** 2 * heads(ex["g_act"]).pow(2).sum(1)
    v2 = s2 ** 2 * heads(chunk_cumsum(ex["g_act"])).pow(2).sum(1)
    return float(v1.sum().sqrt() / den), float(v2.sum().sqrt() / den)


RUNS = ([(n,) for n in A] + [("s3P",), ("s3v",), A] + [tuple(x for x in A if x != n) for n in A if n != "acc32"]
        + [tuple(x if x != "s3" else "s3P" for x in A), tuple(x if x != "s3" else "s3x3" for x in A)])


def label(rs):
    if len(rs) <= 2:
        return "+".join(rs)
    if rs == A:
        return "ALL"
    miss = [x for x in A if x not in rs]
    extra = [x for x in rs if x not in A]
    return "ALL - " + ",".join(miss) + ("" if not extra else " + " + ",".join(extra))


def table(cn, ds, runs, out, head=True):
    c = CASES[cn]
    inputs, kw, do = make(c, do_seed=ds)
    ex = emu.run(inputs, kw, do)
    c1, c2 = cancellation(ex)
    if head:
        print(f"\n== {cn} {c.id} do_seed={ds} TF32_MODE={emu.TF32_MODE} BK3={emu.BK3}")
        print("   exact dA_log:", [f"{x:.4f}" for x in ex["dA_log"].tolist()])
        print("   cancellation sum|dg g|/|sum|     per head:", [f"{x:.0f}" for x in c1])
        print("   cancellation sum|dGam Gam|/|sum| per head:", [f"{x:.0f}" for x in c2])
        print(f"| {'rounded':<28} |" + "|".join(f"{n:>8} " for n in NAMES)
              + "| coh(dg) | coh(dGam) | iid pred m1 | iid pred m2 |")
        print("|" + "---|" * (len(NAMES) + 5))
    for rs in runs:
        e = emu.run(inputs, kw, do, rs)
        errs = {n: rel_rms(e[n], ex[n]) for n in NAMES}
        h1, h2 = coherence(ex, e)
        p1, p2 = iid_prediction(ex, e)
        lb = label(rs)
        print(f"| {lb:<28} |" + "|".join(f" {errs[n]:.1e} " for n in NAMES)
              + f"| {' '.join(f'{x:.0f}' for x in h1)} | {' '.join(f'{x:.0f}' for x in h2)} | {p1:.1e} | {p2:.1e} |",
              flush=True)
        out[f"{cn}|do{ds}|{emu.TF32_MODE}|BK3={emu.BK3}|{lb}"] = dict(errs, coh_dg=h1, coh_dgam=h2, pred=[p1, p2],
                                                                      canc=c1, canc_dgam=c2)


def main():
    out = {}
    for cn in CASES:
        table(cn, 8, RUNS, out)
    short = [("s3v",), A, tuple(x for x in A if x != "s3"), tuple(x if x != "s3" else "s3P" for x in A)]
    print("\n== other do seeds (ALL, s3v alone, ALL - s3, ALL with s3 -> s3P)")
    for cn in CASES:
        for ds in (9, 10, 11):
            table(cn, ds, short, out)
    print("\n== sensitivity: tf32 truncation instead of round-to-nearest; stage-3 K-block 16 / 64 (do_seed 8)")
    for cn in CASES:
        emu.TF32_MODE = "rz"
        table(cn, 8, [("s3v",), A], out)
        emu.TF32_MODE = "rn"
        for bk in (16, 64):
            emu.BK3 = bk
            table(cn, 8, [("s3v",), A], out)
        emu.BK3 = 32
    json.dump(out, open(os.path.join(HERE, "results.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
