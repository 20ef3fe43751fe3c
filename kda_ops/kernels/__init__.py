"""Triton kernels of KDA and their launchers (one file per stage; see each module's docstring)."""
from .fwd import chunk_kda_fwd_triton

__all__ = ["chunk_kda_fwd_triton", "chunk_kda_bwd_triton"]
from .bwd import chunk_kda_bwd_triton  # noqa: E402  (K2: backward launcher)
from .recurrent import recurrent_kda_triton
