"""Which path the intra-chunk kernels take, per gate regime: the share of tiles on the fast path.

Both intra-chunk kernels choose, per K-block, between the fast factored dots and the exact path from the data
(docs/algorithm.md): fast when every row's log2 decay from the midpoint of its 16-row block's first and last rows
stays within a span (the forward tests the same condition from each block's last row), SPAN_UNIT with the in-op
l2norm (which every regime here uses). The forward tests the four blocks of a chunk at once (a tile is a chunk,
value head and K-block); the backward, one program per 16-row block, tests that block alone (a tile is a block,
value head and K-block; its other bound, on the gradients, is not drawn here). Without the in-op l2norm both take
SPAN. This script draws the benchmark's inputs (kda_ops.testing.make_inputs) on the CPU, activates the gate as the
op does, and counts the tiles that pass each test. The second table follows the forward's choice: the chunk's
32-row halves, else its 16-row blocks, else the exact path, which goes down the binary split and takes the
diagonal pairs by one dot per operand at the first block size (8, 4 rows, else single rows) whose test passes;
a level that failed for a K-block is not tried for the chunk's later K-blocks. It gives the share of tiles at
each. (With the in-op safe gate the kernels are built without the tests: common.bounded_gate.) With --dtype
bf16 (the default, the benchmark's) the gate is floored as the kernels floor it for 16-bit inputs with the in-op
gate and l2norm (common.gate_floor): no 16-row block then spans past the forward's test, so its exact path is
empty; --dtype fp32 shows the unfloored gate. No GPU needed.

    python benchmarks/gate_spans.py --shape 1,8192,32,128
"""
from __future__ import annotations

import argparse

import torch

from kda_ops.kernels.common import BC, BT, SPAN, SPAN_UNIT, gate_floor
from kda_ops.options import KDAOptions
from kda_ops.reference import kda_gate
from kda_ops.testing import REGIMES, make_inputs


def spreads(g: torch.Tensor, block_k: int, rows: int = BC, ref: str = "middle") -> torch.Tensor:
    """[B, NT, HV, K // block_k] the largest |gam_i - c(i)| (log2) of each (chunk, value head, K-block) tile, c(i)
    the reference of i's `rows`-row block: its middle row's gam (ref "middle", the backward) or the midpoint of its
    first and last rows' (ref "midpoint", the forward), for the activated log decay g [B, T, HV, K] (natural log
    units), T a multiple of the chunk size and K of block_k."""
    B, T, HV, K = g.shape
    gam = g.view(B, T // BT, BT, HV, K).cumsum(2) / torch.log(torch.tensor(2.0))      # log2, per chunk
    blocks = gam.view(B, T // BT, BT // rows, rows, HV, K)
    if ref == "middle":
        c = blocks[:, :, :, rows // 2:rows // 2 + 1]
    else:
        c = (blocks[:, :, :, :1] + blocks[:, :, :, -1:]) / 2
    spread = (blocks - c).abs()
    return spread.view(B, T // BT, BT // rows, rows, HV, K // block_k, block_k).amax(dim=(3, 6))


def fast_shares(g: torch.Tensor, block_k: int, span: float = SPAN_UNIT.value, ref: str = "midpoint") -> tuple:
    """(share of fast tiles with the per-chunk test (the forward's), with the per-16-row-block test (the
    backward's)) at `span` for the activated log decay g [B, T, HV, K] (natural log units), T a multiple of the
    chunk size and K of block_k; ref as in spreads."""
    per_block = spreads(g, block_k, ref=ref)
    return ((per_block.amax(dim=2) <= span).float().mean().item(),
            (per_block <= span).float().mean().item())


def forward_tiers(g: torch.Tensor, block_k: int, span: float = SPAN_UNIT.value) -> tuple:
    """Shares of the tiles that the forward takes by one dot per operand over the chunk's 32-row halves, over its
    16-row blocks, and on the exact path with the diagonal pairs over 8- and 4-row blocks or down to single rows
    (g as for fast_shares; they sum to 1). As in the kernel, the K-blocks of a chunk go in order and a test that
    failed for one is not tried again for the later ones: a K-block starts from the level (halves, 16-row blocks,
    exact) the one before it took; on the exact path the 8- and 4-row tests are taken anew per K-block."""
    passes = [spreads(g, block_k, rows, "midpoint").amax(dim=2) <= span for rows in (2 * BC, BC, BC // 2, BC // 4)]
    # [B, NT, HV, NK] level of each K-block: 0 halves, 1 16-row blocks, 2 exact; then the running maximum over K
    level = torch.where(passes[0], 0, torch.where(passes[1], 1, 2)).cummax(dim=-1).values
    shares = [(level == 0).float().mean().item(), (level == 1).float().mean().item()]
    taken = level < 2      # tiles that took a level above the exact path's
    for p in passes[2:]:
        shares.append((p & ~taken).float().mean().item())
        taken = taken | p
    return tuple(shares) + ((~taken).float().mean().item(),)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,8192,32,128", help="B,T,H,K (T a multiple of 64)")
    ap.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    ap.add_argument("--block-k", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16 floors the gate")
    a = ap.parse_args()
    dtype = dict(bf16=torch.bfloat16, fp32=torch.float32)[a.dtype]
    B, T, H, K = (int(s) for s in a.shape.split(","))
    gates = {}
    for regime in a.regimes:
        x = make_inputs(B, T, H, K, regime=regime, dtype=torch.float32, seed=0)
        opts = KDAOptions(scale=1.0, lower_bound=x["lower_bound"], use_qk_l2norm=True, use_gate=True)
        gates[regime] = kda_gate(x["g"], x["A_log"], x["dt_bias"], x["lower_bound"]).clamp(min=gate_floor(opts, dtype))
    print(f"| regime | BK | forward: per chunk at SPAN_UNIT = {SPAN_UNIT.value:g} | backward: per 16-row block at "
          f"SPAN_UNIT | without the in-op l2norm: forward at SPAN = {SPAN.value:g} | backward at SPAN |")
    print("|---|---|---|---|---|---|")
    for regime, g in gates.items():
        for bk in a.block_k:
            shares = fast_shares(g, bk) + fast_shares(g, bk, SPAN.value)
            print(f"| {regime} | {bk} | " + " | ".join(f"{s:.3f}" for s in shares) + " |")
    print(f"\n| regime | BK | forward at SPAN_UNIT = {SPAN_UNIT.value:g}: one dot per 32-row half | per 16-row "
          f"block | exact, per 8-row | per 4-row | single rows |")
    print("|---|---|---|---|---|---|---|")
    for regime, g in gates.items():
        for bk in a.block_k:
            print(f"| {regime} | {bk} | " + " | ".join(f"{s:.3f}" for s in forward_tiers(g, bk)) + " |")


if __name__ == "__main__":
    main()
