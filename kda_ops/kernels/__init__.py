"""Triton kernels of KDA and their launchers, one file per stage (each module's docstring has the math).

    common.py      shared by every stage: BT, the varlen chunk index (chunk_index, ChunkIndex), autotune
                   configs, and the @triton.jit helpers (sequence / chunk bounds, gate and beta activation,
                   l2norm factors, q / k row loads)
    chunk.py       the op-level launchers chunk_kda_fwd_triton and chunk_kda_bwd_triton, composing:
      forward      fwd_intra.py  gate, beta, l2norm factors, gam, Aqk, Tm = (I + L)^-1, kd, qg
                   fwd_wu.py     W, U
                   fwd_state.py  state pass over chunks fused with the output
      backward     (the forward stages recompute what was not kept)
                   bwd_state.py  reverse state pass
                   bwd_inter.py  per chunk: terms through the state and the inverse
                   bwd_intra.py  per chunk: pairwise in-chunk terms, beta chain rule
                   bwd_gate.py   reverse in-chunk cumsum, gate chain rule
                   bwd_qk.py     GVA sum over value heads, l2norm chain rule
    recurrent.py   recurrent_kda_triton (the decode step, one launch)

Launchers take the op's bundles (kda_ops.options.KDAInputs, KDAOptions) and the call's ChunkIndex, built once
per call by chunk_index; none synchronises with the host.
"""
from .chunk import chunk_kda_bwd_triton, chunk_kda_fwd_triton
from .common import BT, ChunkIndex, chunk_index
from .recurrent import recurrent_kda_triton

__all__ = ["BT", "ChunkIndex", "chunk_index", "chunk_kda_fwd_triton", "chunk_kda_bwd_triton",
           "recurrent_kda_triton"]
