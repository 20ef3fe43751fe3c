"""Triton kernels of KDA and their launchers (one file per stage; see each module's docstring).

    fwd.py        chunk_kda_fwd_triton   = intra.py (+ prepare.py helpers) -> state.py (state pass fused with output)
    bwd.py        chunk_kda_bwd_triton   = recompute intra + states -> state_bwd.py -> chunk_bwd.py -> intra_bwd.py
                                           -> prep_bwd.py (l2norm chain rule, GVA reduction)
    recurrent.py  recurrent_kda_triton   (decode step)
"""
from .bwd import chunk_kda_bwd_triton
from .common import BT
from .fwd import chunk_kda_fwd_triton
from .recurrent import recurrent_kda_triton

__all__ = ["BT", "chunk_kda_fwd_triton", "chunk_kda_bwd_triton", "recurrent_kda_triton"]
