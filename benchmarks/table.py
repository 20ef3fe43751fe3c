"""Rewrite README.md's speed table from benchmarks/results/kda.csv.

    python benchmarks/table.py            # rewrite the table between the markers in README.md
    python benchmarks/table.py --check    # exit 1 when README.md's table is not the one kda.csv gives

For each (shape, regime, mode) the table shows the latest kda_ops row and the FLA row of the same run (same
date and commit): both times, the speed-up (FLA ms / kda_ops ms) and the peak extra memory as a fraction of
FLA's. Regimes without rows are absent. Where the rows come from more than one GPU, each row names its GPU.
Standard library only.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSV_PATH = os.path.join(ROOT, "benchmarks", "results", "kda.csv")
README_PATH = os.path.join(ROOT, "README.md")
START, END = "<!-- speed-table:start -->", "<!-- speed-table:end -->"
REGIME_ORDER = ("weak", "layer_init", "strong", "safe_gate")
MODE_ORDER = ("fwd", "fwdbwd")
MODE_NAME = {"fwd": "forward", "fwdbwd": "fwd + bwd"}


def read_rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _shape(r):
    return tuple(int(r[c]) for c in ("B", "T", "H", "K", "V"))


def _order(value, known):
    return (known.index(value), "") if value in known else (len(known), value)


def select(rows):
    """[(key, kda_ops row, FLA row or None)] with key = (shape, regime, mode), in table order: shape (B, T, H,
    K, V ascending), then regime, then mode. The latest kda_ops row is the one with the latest date, the later
    line of the file on equal dates."""
    latest = {}
    for i, r in enumerate(rows):
        if r["provider"] != "kda_ops":
            continue
        key = (_shape(r), r["regime"], r["mode"])
        if key not in latest or (r["date"], i) >= (latest[key]["date"], latest[key]["_line"]):
            latest[key] = dict(r, _line=i)
    out = []
    for key in sorted(latest, key=lambda k: (k[0], _order(k[1], REGIME_ORDER), _order(k[2], MODE_ORDER))):
        ours = latest[key]
        peers = [r for r in rows if r["provider"] == "fla" and (_shape(r), r["regime"], r["mode"]) == key
                 and r["date"] == ours["date"] and r["commit"] == ours["commit"]]
        out.append((key, ours, peers[-1] if peers else None))
    return out


def _ratio(num, den, fmt):
    try:
        return fmt.format(float(num) / float(den))
    except (TypeError, ValueError, ZeroDivisionError):
        return "-"


def render(rows):
    """The markdown table (no markers), ending with a newline."""
    sel = select(rows)
    if not sel:
        return "No measurements yet.\n"
    # the FLA version of a run: its peer row's, or ours (a run with FLA installed whose FLA measurement is missing)
    runs = sorted({(r["gpu"], r["torch"], r["triton"], (f or r).get("fla", "")) for _, r, f in sel})
    lines = []
    for gpu, torch_v, triton_v, fla_v in runs:
        lines.append(f"{gpu}, torch {torch_v}, triton {triton_v}" + (f", FLA {fla_v}" if fla_v else "") +
                     "; bf16, gate + q/k l2norm + beta sigmoid inside the op.")
    per_gpu = len({r["gpu"] for _, r, _ in sel}) > 1     # rows of several GPUs: each row names its GPU
    cols = ["B, T, H, K, V", "gate regime", "pass"] + (["GPU"] if per_gpu else []) + [
        "kda_ops ms", "FLA ms", "speed-up vs FLA", "peak memory vs FLA"]
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for (shape, regime, mode), ours, peer in sel:
        fla_ms = f"{float(peer['ms']):.3f}" if peer else "-"
        speed = _ratio(peer["ms"], ours["ms"], "{:.2f}x") if peer else "-"
        mem = _ratio(ours["peak_extra_mib"], peer["peak_extra_mib"], "{:.2f}") if peer else "-"
        cells = [", ".join(map(str, shape)), regime, MODE_NAME.get(mode, mode)] + ([ours["gpu"]] if per_gpu else [])
        cells += [f"{float(ours['ms']):.3f}", fla_ms, speed, mem]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def update(readme, table):
    """readme with the text between the markers replaced by table."""
    i, j = readme.find(START), readme.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README has no {START} ... {END} markers")
    return readme[:i + len(START)] + "\n" + table + readme[j:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=CSV_PATH)
    ap.add_argument("--readme", default=README_PATH)
    ap.add_argument("--check", action="store_true", help="only check that the README is up to date")
    a = ap.parse_args(argv)
    with open(a.readme) as fh:
        old = fh.read()
    new = update(old, render(read_rows(a.csv)))
    if a.check:
        if new != old:
            print(f"{a.readme}: speed table is stale; run python benchmarks/table.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        with open(a.readme, "w") as fh:
            fh.write(new)
    print(f"{a.readme}: speed table {'rewritten' if new != old else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
