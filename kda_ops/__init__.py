"""kda_ops: Kimi Delta Attention as torch.library custom ops (Triton on CUDA, torch elsewhere)."""
from .api import chunk_kda, recurrent_kda, set_cu_seqlens_check
from .ops import SCHEMA_VERSION
from .options import KDAInputs, KDAOptions
from .reference import naive_recurrent_kda

__all__ = ["chunk_kda", "recurrent_kda", "naive_recurrent_kda", "set_cu_seqlens_check", "KDAInputs", "KDAOptions",
           "SCHEMA_VERSION"]
__version__ = "0.1.0"
