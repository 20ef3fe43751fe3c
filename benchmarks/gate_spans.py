"""Which path the intra-chunk kernels take, per gate regime: the share of (chunk, value head, K-block) tiles on
the fast path.

The forward and backward intra-chunk kernels choose, per K-block, between the fast factored dots and the exact
path from the data: fast when every row's log2 decay from the middle row of its 16-row block stays within a span
(docs/algorithm.md): SPAN in the backward, SPAN_UNIT in the forward with the in-op l2norm (which every regime
here uses). This script draws the benchmark's inputs (kda_ops.testing.make_inputs) on the CPU, activates the
gate as the op does, and counts the tiles that pass that test over the whole chunk (what the kernels test) at
both spans and, for comparison, per 16-row block at SPAN (a finer choice no kernel makes). No GPU needed.

    python benchmarks/gate_spans.py --shape 1,8192,32,128
"""
from __future__ import annotations

import argparse

import torch

from kda_ops.kernels.common import BC, BT, SPAN, SPAN_UNIT
from kda_ops.reference import kda_gate
from kda_ops.testing import REGIMES, make_inputs


def fast_shares(g: torch.Tensor, block_k: int, span: float = SPAN.value) -> tuple:
    """(share of fast tiles with the per-chunk test, with a per-16-row-block test) at `span` for the activated log
    decay g [B, T, HV, K] (natural log units), T a multiple of the chunk size and K of block_k."""
    B, T, HV, K = g.shape
    gam = g.view(B, T // BT, BT, HV, K).cumsum(2) / torch.log(torch.tensor(2.0))      # log2, per chunk
    blocks = gam.view(B, T // BT, BT // BC, BC, HV, K)
    spread = (blocks - blocks[:, :, :, BC // 2:BC // 2 + 1]).abs()                    # from the middle row
    per_block = spread.view(B, T // BT, BT // BC, BC, HV, K // block_k, block_k).amax(dim=(3, 6))
    return ((per_block.amax(dim=2) <= span).float().mean().item(),
            (per_block <= span).float().mean().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,8192,32,128", help="B,T,H,K (T a multiple of 64)")
    ap.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    ap.add_argument("--block-k", type=int, nargs="+", default=[16, 32, 64, 128])
    a = ap.parse_args()
    B, T, H, K = (int(s) for s in a.shape.split(","))
    print(f"| regime | BK | fast tiles at SPAN = {SPAN.value:g} (backward) | at SPAN_UNIT = {SPAN_UNIT.value:g} "
          f"(forward) | per-16-row-block test at SPAN |")
    print("|---|---|---|---|---|")
    for regime in a.regimes:
        x = make_inputs(B, T, H, K, regime=regime, dtype=torch.float32, seed=0)
        g = kda_gate(x["g"], x["A_log"], x["dt_bias"], x["lower_bound"])
        for bk in a.block_k:
            chunk, block = fast_shares(g, bk)
            unit, _ = fast_shares(g, bk, SPAN_UNIT.value)
            print(f"| {regime} | {bk} | {chunk:.3f} | {unit:.3f} | {block:.3f} |")


if __name__ == "__main__":
    main()
