"""benchmarks/gate_spans.py: the share of intra-chunk tiles on the fast path (CPU)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gate_spans.py")


def _load():
    spec = importlib.util.spec_from_file_location("kda_bench_gate_spans", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


spans = _load()


def test_no_decay_is_all_fast():
    assert spans.fast_shares(torch.zeros(2, 128, 3, 32), 16) == (1.0, 1.0)


def test_one_step_past_span_sends_its_block_and_chunk_exact():
    # one step of 100 nats (144 in log2, past SPAN = 60) at row 41 of every chunk, channel 0 only: in row block 2
    # (rows 32-47, middle row 40) rows 41-47 are 144 from the middle; the other blocks keep a zero spread
    g = torch.zeros(1, 128, 2, 32)
    g[:, 41::64, :, 0] = -100.0
    chunk, block = spans.fast_shares(g, 16, spans.SPAN.value, "middle")
    assert chunk == pytest.approx(0.5)                # K-block 0 of each chunk is exact, K-block 1 fast
    assert block == pytest.approx((0.75 + 1.0) / 2)   # in K-block 0 only row block 2 of 4 fails


def test_cli_prints_every_regime():
    out = subprocess.run([sys.executable, SCRIPT, "--shape", "1,128,2,32", "--block-k", "32"], cwd=ROOT,
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    tables = out.split("\n\n")
    assert len(tables) == 2
    for table in tables:
        rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
        assert [r.split("|")[1].strip() for r in rows] == ["weak", "layer_init", "strong", "safe_gate"]


def test_step_between_the_two_spans():
    # one step of 55 nats (79 in log2) at row 41 of every chunk, channel 0: past SPAN = 60 (without the l2norm),
    # within SPAN_UNIT = 112 (with the in-op l2norm)
    g = torch.zeros(1, 128, 2, 32)
    g[:, 41::64, :, 0] = -55.0
    assert spans.fast_shares(g, 16, spans.SPAN.value, "middle")[0] == pytest.approx(0.5)
    assert spans.fast_shares(g, 16, spans.SPAN_UNIT.value, "middle") == (1.0, 1.0)
    assert spans.fast_shares(g, 16, spans.SPAN_UNIT.value, "midpoint") == (1.0, 1.0)


def test_midpoint_halves_the_spread():
    # one step of 120 nats (173 in log2) at row 41: 132 from the middle row 40 of block 32-47, past SPAN_UNIT;
    # the midpoint of rows 32 and 47 is 87 from every row of the block, within it
    g = torch.zeros(1, 128, 2, 32)
    g[:, 41::64, :, 0] = -120.0
    assert spans.fast_shares(g, 16, spans.SPAN_UNIT.value, "middle")[0] == pytest.approx(0.5)
    assert spans.fast_shares(g, 16) == (1.0, 1.0)


@pytest.mark.parametrize("rows, channel, tiers", [
    ((40,), 0, (0.0, 0.0, 1.0, 0.0, 0.0)), ((44,), 0, (0.0, 0.0, 0.5, 0.5, 0.0)),
    ((41,), 0, (0.0, 0.0, 0.5, 0.0, 0.5)), ((40,), 16, (0.5, 0.0, 0.5, 0.0, 0.0))])
def test_forward_tiers(rows, channel, tiers):
    # one step of 180 nats (260 in log2: past twice SPAN_UNIT, 224) at each of `rows` of every chunk, in one channel:
    # its 32-row half and 16-row block fail. At row 40 it falls between the halves of 16-row block 2 (rows 32-47):
    # 8-row blocks do not see it. At row 44, between the halves of the 8-row block 40-47: 4-row blocks do not see
    # it. At row 41 a 4-row block (40-43) does. Channel 0 is in K-block 0 (BK 16): K-block 1, whose own tests would
    # pass, follows it onto the exact path, where its 8-row test passes; channel 16 (K-block 1) leaves K-block 0 on
    # the halves
    g = torch.zeros(1, 128, 2, 32)
    for row in rows:
        g[:, row::64, :, channel] = -180.0
    assert spans.forward_tiers(g, 16) == pytest.approx(tiers)


def test_forward_tiers_16_row_blocks():
    # two steps of 100 nats (144 in log2) in one 32-row half (rows 36 and 52), one in each of its 16-row blocks:
    # the half spans 288, past 224, each block 144; K-block 1 (no steps) follows K-block 0 to the 16-row blocks
    g = torch.zeros(1, 128, 2, 32)
    g[:, 36::64, :, 0] = -100.0
    g[:, 52::64, :, 0] = -100.0
    assert spans.forward_tiers(g, 16) == pytest.approx((0.0, 1.0, 0.0, 0.0, 0.0))


@pytest.mark.parametrize("lower_bound", [-1.0, -5.0, -5.19, -5.21, -8.0])
def test_bounded_gate_matches_the_worst_safe_gate(lower_bound):
    # kernels.common.bounded_gate builds the intra kernels without their span test and exact path; it must say
    # yes exactly when the worst gate that lower_bound allows (every step at lower_bound) keeps each 16-row block
    # within SPAN of its middle row. 8 steps x 5.2 nats x log2(e) = 60.02: the bound lies between -5.19 and -5.21
    from kda_ops.kernels.common import bounded_gate
    from kda_ops.options import KDAOptions
    g = torch.full((1, 128, 1, 16), lower_bound, dtype=torch.float64)
    worst_fits = spans.spreads(g, 16).max().item() <= spans.SPAN.value
    assert bounded_gate(KDAOptions(1.0, lower_bound, use_gate=True), spans.SPAN) == worst_fits
    assert not bounded_gate(KDAOptions(1.0, lower_bound, use_gate=False), spans.SPAN)   # g given: nothing bounds it
    assert not bounded_gate(KDAOptions(1.0, None, use_gate=True), spans.SPAN)


@pytest.mark.parametrize("lower_bound", [-1.0, -5.0, -5.007, -5.01, -8.0])
def test_diagonal_rows_matches_the_worst_safe_gate(lower_bound):
    # kernels.fwd_intra.diagonal_rows lets the forward take each 32-row half of a chunk in one factored dot per
    # operand; it must say so exactly when the worst gate that lower_bound allows keeps every half within
    # SPAN_UNIT of its midpoint: 15.5 steps x 5.007 nats x log2(e) = 111.97, at 5.01 112.03
    from kda_ops.kernels.fwd_intra import diagonal_rows
    from kda_ops.options import KDAOptions
    g = torch.full((1, 128, 1, 16), lower_bound, dtype=torch.float64)
    worst_fits = spans.spreads(g, 16, 32, "midpoint").max().item() <= spans.SPAN_UNIT.value
    opts = KDAOptions(1.0, lower_bound, use_qk_l2norm=True, use_gate=True)
    assert diagonal_rows(opts) == (32 if worst_fits else 16)
    assert diagonal_rows(KDAOptions(1.0, lower_bound, use_gate=True)) == 16      # raw rows: the span is SPAN
    assert diagonal_rows(KDAOptions(1.0, None, use_qk_l2norm=True, use_gate=True)) == 16


def test_16bit_floor_bounds_every_16_row_block():
    # steps of 100 nats (144 in log2): unfloored, only 2-row blocks stay within 2 SPAN_UNIT (the last column);
    # floored as for 16-bit inputs (common.gate_floor), every 16-row block does, whatever the decay
    from kda_ops.kernels.common import gate_floor
    from kda_ops.options import KDAOptions
    g = torch.full((1, 128, 2, 32), -100.0)
    assert spans.forward_tiers(g, 32) == (0.0, 0.0, 0.0, 0.0, 1.0)
    opts = KDAOptions(scale=1.0, use_qk_l2norm=True, use_gate=True)
    floored = g.clamp(min=gate_floor(opts, torch.bfloat16))
    assert spans.forward_tiers(floored, 32) == (0.0, 1.0, 0.0, 0.0, 0.0)
    assert gate_floor(opts, torch.float32) == -128.0
    assert gate_floor(KDAOptions(scale=1.0, use_gate=True), torch.bfloat16) == -128.0     # no in-op l2norm
