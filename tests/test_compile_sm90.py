"""benchmarks/compile_sm90.py's reading of a SASS listing (no GPU, no compile): the paths through a loop."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import compile_sm90  # noqa: E402

# a loop at 0x10-0x60 whose body branches on P0 (two HGMMA one way, an FADD and one HGMMA the other), a branch on
# !PT (never taken) and one on PT (always) over a block the loop never runs; its backward branch at 0x60, then code
# after the loop
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/              @P0 BRA 0x50 ;
        /*0030*/                   FADD R1, R1, R2 ;
        /*0038*/             @!PT BRA 0x48 ;
        /*0040*/              @PT BRA 0x60 ;
        /*0048*/                   FADD R1, R1, R2 ;
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0060*/              @P1 BRA 0x10 ;
        /*0070*/                   EXIT ;
"""


def test_loop_and_its_paths():
    insts = compile_sm90.sass_insts(LISTING)
    assert compile_sm90.sass_loops(insts) == [(0x10, 0x60)]
    # P0 taken: 0x10, 0x20, 0x50, 0x60 (2 HGMMA); not taken: 0x10 - 0x40, 0x60 (1 HGMMA); 0x48 is never reached
    assert compile_sm90.sass_paths(insts, 0x10, 0x60) == [(4, 2), (6, 1)]
    # the code after the loop is a path of its own that ends at EXIT
    assert compile_sm90.sass_paths(insts, 0x70, 0x70) == [(1, 0)]


def test_loop_left_by_a_forward_branch():
    """A loop whose backward branch is unconditional: one path ends there, the other leaves by a branch out of it."""
    listing = """
        /*0010*/                   FADD R1, R1, R2 ;
        /*0020*/              @P2 BRA 0x90 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0040*/                   BRA 0x10 ;
        /*0090*/                   EXIT ;
"""
    insts = compile_sm90.sass_insts(listing)
    assert compile_sm90.sass_loops(insts) == [(0x10, 0x40)]
    assert compile_sm90.sass_paths(insts, 0x10, 0x40) == [(2, 0), (4, 1)]


def test_walk_cut_short():
    """A loop body of 12 branches one after another has 4,096 paths: with fewer blocks allowed than that the walk
    stops, and the list says so; with enough it finds all 13 lengths."""
    lines = []
    for i in range(12):
        a = 0x10 + 0x20 * i
        lines += [f"        /*{a:04x}*/              @P0 BRA {a + 0x20:#x} ;",
                  f"        /*{a + 0x10:04x}*/                   FADD R1, R1, R2 ;"]
    end = 0x10 + 0x20 * 12
    lines.append(f"        /*{end:04x}*/              @P1 BRA 0x10 ;")
    insts = compile_sm90.sass_insts("\n".join(lines))
    assert compile_sm90.sass_loops(insts) == [(0x10, end)]
    full = compile_sm90.sass_paths(insts, 0x10, end, limit=20)
    assert full == [(13 + f, 0) for f in range(13)]
    cut = compile_sm90.sass_paths(insts, 0x10, end, limit=20, budget=100)
    assert cut[-1] == (-1, -1) and set(cut[:-1]) < set(full)
