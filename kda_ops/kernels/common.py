"""Shared launch helpers for the KDA Triton kernels: chunk sizes, the varlen chunk index, autotune configs.

Nothing here reads tensor values on the host: the varlen index is built with torch ops on the device
and the grids are sized from shapes only (a static bound on the number of chunks).
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

# Under TRITON_INTERPRET=1 (CPU tests) an autotuner may hold only one config: there is no driver to time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# KDA_OPS_AUTOTUNE=0 keeps the first (default) config only: quicker compiles, e.g. for correctness tests.
AUTOTUNE = not INTERPRET and os.environ.get("KDA_OPS_AUTOTUNE", "1") != "0"

BT = 64   # chunk size (tokens)
BC = 16   # sub-chunk size: the blocks of the intra-chunk matrices and of the blockwise inverse


def absent(x: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """x, or for an absent optional tensor a fresh 1-element placeholder on like's device (never read).

    Each absent pointer gets its own tensor: under torch.compile, wrap_triton's functionalization replaces a
    tensor passed as a kernel argument by that argument's output copy, so one placeholder passed for several
    arguments (or a real output reused as a placeholder) would alias them and corrupt the real output.
    """
    return like.new_empty(1, dtype=torch.float32) if x is None else x


def autotune_configs(configs: list) -> list:
    """All configs on a GPU, the first one alone under the interpreter (or with KDA_OPS_AUTOTUNE=0)."""
    return configs if AUTOTUNE else configs[:1]


class ChunkLayout(NamedTuple):
    """Where each chunk program finds its work.

    N: number of sequences. NT_total: programs on the chunk axis (exact for fixed length, a static upper
    bound ``cdiv(T, BT) + N - 1`` for varlen). chunk_indices [NT_total, 2] int32 (sequence, chunk in the
    sequence; sequence == N marks a program past the real work) and chunk_offsets [N] int32 (index of
    each sequence's first chunk in the per-chunk state tensor) exist only for varlen.
    """
    N: int
    NT_total: int
    chunk_indices: Optional[torch.Tensor]
    chunk_offsets: Optional[torch.Tensor]


def chunk_layout(B: int, T: int, cu_seqlens: Optional[torch.Tensor]) -> ChunkLayout:
    if cu_seqlens is None:
        return ChunkLayout(B, B * triton.cdiv(T, BT), None, None)
    N = cu_seqlens.shape[0] - 1
    NT_total = triton.cdiv(T, BT) + N - 1
    cu = cu_seqlens.to(torch.int64)
    n_chunks = (cu[1:] - cu[:-1] + BT - 1) // BT                        # [N]
    ends = n_chunks.cumsum(0)                                           # [N] one past each sequence's last chunk
    starts = ends - n_chunks                                            # [N]
    # searchsorted over a fresh tensor, never a slice: Inductor (torch 2.11) dropped the storage offset of a
    # sliced boundaries tensor (chunk_offsets[1:]) and searched the unsliced one (seen on the H200)
    ids = torch.arange(NT_total, device=cu.device)
    seq = torch.searchsorted(ends, ids, right=True)                     # [NT_total] in [0, N]
    local = ids - starts[seq.clamp(max=N - 1)]
    chunk_indices = torch.stack([seq, local], 1).to(torch.int32).contiguous()
    return ChunkLayout(N, NT_total, chunk_indices, starts.to(torch.int32).contiguous())


def tune_size(tokens, heads):
    """The problem-size part of the chunk kernels' autotune keys: tokens * value heads / 2^14, at most 32.

    Without it a config timed on the first call's shape was reused for every later one: the forward's state
    pass kept a config timed at a test-sized shape (~0.02 ms per call) in every benchmark after it. Under torch.compile
    this is a symbolic expression (a min of a floor division: no guard), so a new sequence length recompiles
    nothing; each distinct value tunes once (at most 33 per kernel and flags).
    """
    return torch.sym_min((tokens * heads) // 16384, 32)


def dot_precision(dtype: torch.dtype) -> str:
    """input_precision of the fp32 dots: tf32 for 16-bit inputs, IEEE fp32 for fp32 inputs.

    (Dots whose operands are stored in the input dtype run in that dtype.)"""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def chunk_bounds(i_t, cu_seqlens, chunk_indices, T, N, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(sequence, chunk in the sequence, first token of the sequence, end of the sequence) of program i_t."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        # a program past the real work reads sequence N - 1 with an empty range (its stores are all masked)
        valid = i_n < N
        i_n = tl.minimum(i_n, N - 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        eos = tl.where(valid, eos, bos)
    else:
        NT = tl.cdiv(T, BT)
        i_n = (i_t // NT).to(tl.int64)
        i_c = (i_t % NT).to(tl.int64)
        bos = i_n * T
        eos = bos + T
    return i_n, i_c, bos, eos


def lowp_dot(dtype: torch.dtype) -> bool:
    """Whether dots run on 16-bit operands (bf16/fp16 inputs). Not under the interpreter, whose bf16 dot
    is wrong (triton 3.9): there the same kernels run their dots in fp32."""
    return dtype in (torch.bfloat16, torch.float16) and not INTERPRET
