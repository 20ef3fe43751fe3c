"""What the KDA stages share: chunk sizes, the varlen chunk index, autotune configs, and the @triton.jit helpers
(sequence / chunk bounds, gate and beta activation, l2norm factors, q / k row loads).

Nothing here reads tensor values on the host: the varlen index is built with torch ops on the device
and the grids are sized from shapes only (a static bound on the number of chunks).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch
from torch.library import wrap_triton
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..options import KDAOptions

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


def state_strides(x: Optional[torch.Tensor]) -> tuple:
    """The 4 element strides of a state [N, HV, K, V] (any layout: a transposed V-first state, a batch-expanded
    one with stride 0), read by the kernels as they are, without a copy; zeros for an absent state."""
    return (0, 0, 0, 0) if x is None else tuple(x.stride())


def autotune_configs(configs: list) -> list:
    """All configs on a GPU, the first one alone under the interpreter (or with KDA_OPS_AUTOTUNE=0)."""
    return configs if AUTOTUNE else configs[:1]


class ChunkIndex(NamedTuple):
    """Where each chunk program finds its work; built once per op call by :func:`chunk_index`.

    N: number of sequences. NT_total: programs on the chunk axis (exact for fixed length, the static upper
    bound ``cdiv(T, BT) + N - 1`` for varlen; the per-chunk state tensors have NT_total blocks).
    Varlen only (all None for fixed length): cu_seqlens [N + 1] int32, the sanitised copy of the user's
    (clamped to [0, T], non-decreasing); chunk_indices [NT_total, 2] int32 (sequence, chunk in the sequence;
    sequence == N marks a program past the real work); chunk_offsets [N] int32 (index of each sequence's first
    chunk in the per-chunk state tensors).
    """
    N: int
    NT_total: int
    cu_seqlens: Optional[torch.Tensor]
    chunk_indices: Optional[torch.Tensor]
    chunk_offsets: Optional[torch.Tensor]

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens is not None

    @classmethod
    def from_tensors(cls, B: int, T: int, cu_seqlens: Optional[torch.Tensor], chunk_indices: Optional[torch.Tensor],
                     chunk_offsets: Optional[torch.Tensor]) -> "ChunkIndex":
        """The index again from its three tensors (as :func:`chunk_index` built them, e.g. passed through
        autograd) and the shapes B, T: no device work."""
        if cu_seqlens is None:
            return cls(B, B * triton.cdiv(T, BT), None, None, None)
        N = cu_seqlens.shape[0] - 1
        return cls(N, triton.cdiv(T, BT) + N - 1, cu_seqlens, chunk_indices, chunk_offsets)


def sanitize_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """int32 copy of cu_seqlens clamped to [0, T] and made non-decreasing (running maximum), on its device
    without a host sync: whatever the values, every sequence is a (possibly empty) range inside [0, T], so no
    kernel reads or writes outside its tensors. Valid values are returned unchanged."""
    cu = cu_seqlens.to(torch.int64).clamp(0, T)
    return torch.cummax(cu, 0).values.to(torch.int32)


def chunk_index(B: int, T: int, cu_seqlens: Optional[torch.Tensor]) -> ChunkIndex:
    """The chunk index of a call: q is [B, T, ...]; cu_seqlens [N + 1] (any integer dtype, B == 1) or None."""
    if cu_seqlens is None:
        return ChunkIndex.from_tensors(B, T, None, None, None)
    N = cu_seqlens.shape[0] - 1
    NT_total = triton.cdiv(T, BT) + N - 1
    cu_safe = sanitize_cu_seqlens(cu_seqlens, T)
    cu = cu_safe.to(torch.int64)
    n_chunks = (cu[1:] - cu[:-1] + BT - 1) // BT                        # [N]
    ends = n_chunks.cumsum(0)                                           # [N] one past each sequence's last chunk
    starts = ends - n_chunks                                            # [N]
    # searchsorted over a fresh tensor, never a slice: Inductor (torch 2.11) dropped the storage offset of a
    # sliced boundaries tensor (chunk_offsets[1:]) and searched the unsliced one
    ids = torch.arange(NT_total, device=cu.device)
    seq = torch.searchsorted(ends, ids, right=True)                     # [NT_total] in [0, N]
    local = ids - starts[seq.clamp(max=N - 1)]
    chunk_indices = torch.stack([seq, local], 1).to(torch.int32).contiguous()
    return ChunkIndex(N, NT_total, cu_safe, chunk_indices, starts.to(torch.int32).contiguous())


LENGTH_ARGS = ("T", "N", "TUNE_SIZE", "n_tokens", "row")


def length_jit(fn):
    """triton.jit for a kernel, with its length-like integer arguments (those of LENGTH_ARGS it has) not
    specialised: Triton otherwise compiles a kernel per class (== 1, divisible by 16, other) of every integer
    argument, so a call at a new sequence length could compile the whole pipeline again."""
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return triton.jit(do_not_specialize=[n for n in LENGTH_ARGS if n in names])(fn)


@length_jit
def zero_uncovered_kernel(x, cu_seqlens, T, N, row, BR: tl.constexpr, BC: tl.constexpr):
    """Zeros the token rows of x [T, row] that no sequence covers: t < cu_seqlens[0] or t >= cu_seqlens[N]
    (cu_seqlens sanitised: non-decreasing, so these are exactly the uncovered rows). Grid (cdiv(T, BR),);
    a program whose rows are all covered returns after two scalar loads."""
    i_r = tl.program_id(0)
    lo = tl.load(cu_seqlens).to(tl.int64)
    hi = tl.load(cu_seqlens + N).to(tl.int64)
    r0 = i_r.to(tl.int64) * BR
    if (r0 >= lo) & (r0 + BR <= hi):
        return
    o_r = r0 + tl.arange(0, BR)
    m_r = ((o_r < lo) | (o_r >= hi)) & (o_r < T)
    for i_c in range(tl.cdiv(row, BC)):
        o_c = i_c * BC + tl.arange(0, BC)
        tl.store(x + o_r[:, None] * row + o_c[None, :], tl.zeros([BR, BC], dtype=x.dtype.element_ty),
                 mask=m_r[:, None] & (o_c[None, :] < row))


def zero_uncovered(x: torch.Tensor, idx: ChunkIndex) -> torch.Tensor:
    """x [1, T, ...] contiguous, with the tokens that no sequence of idx covers set to 0 (in place; varlen
    only). The chunk kernels write only covered tokens: with cu_seqlens that do not start at 0 or end at T,
    the rest of an output would be uninitialised memory."""
    if idx.is_varlen:
        T = x.shape[1]
        row = x[0, 0].numel()
        BR = 32
        wrap_triton(zero_uncovered_kernel)[(triton.cdiv(T, BR),)](
            x, idx.cu_seqlens, T, idx.N, row, BR=BR, BC=min(256, triton.next_power_of_2(max(row, 16))),
            num_warps=4)
    return x


class GateArgs(NamedTuple):
    """What a kernel that activates the gate and beta takes besides g and beta (see gate_args)."""
    A_log: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]
    lower_bound: float
    flags: dict


def gate_args(x, opts) -> GateArgs:
    """A_log and dt_bias of x (None without opts.use_gate), lower_bound as a float (0.0 when unused) and the
    constexpr flags USE_GATE, HAS_A_LOG, HAS_DT_BIAS, HAS_LOWER_BOUND, USE_BETA_SIGMOID, ALLOW_NEG_EIGVAL."""
    use_gate = opts.use_gate
    A_log = x.A_log if use_gate else None
    dt_bias = x.dt_bias if use_gate else None
    lower_bound = opts.lower_bound if use_gate else None
    return GateArgs(A_log, dt_bias, 0.0 if lower_bound is None else float(lower_bound), dict(
        USE_GATE=use_gate, HAS_A_LOG=A_log is not None, HAS_DT_BIAS=dt_bias is not None,
        HAS_LOWER_BOUND=lower_bound is not None, USE_BETA_SIGMOID=opts.use_beta_sigmoid,
        ALLOW_NEG_EIGVAL=opts.allow_neg_eigval))


def size_class(x, lo: int, classes: int):
    """x's class among `classes`: 0 below lo, then one per doubling (lo, 2 lo, 4 lo, ...), the last one open.

    A sum of mins of floor divisions: under torch.compile with dynamic shapes a symbolic expression, no guard
    (a Python branch here would guard on the size and recompile at a new sequence length)."""
    return sum(torch.sym_min(x // (lo << i), 1) for i in range(classes - 1))


def bounded_gate(opts: KDAOptions, span, steps=BC // 2, floor=None) -> bool:
    """Whether the in-op gate keeps every row of gam within `span` (log2 units) of its block's reference,
    whatever the inputs, when no row is more than `steps` steps from that reference: each step's log decay lies in
    [max(lower_bound, floor), 0] (an invalid gate element counts as 0, rows past the end too; floor: the kernels'
    floor of a step, gate_floor, None for G_MIN). The default is the 16-row blocks around their middle rows
    (BC // 2 steps: the backward's reference; the forward's, the midpoint of the block's first and last rows, is
    within (BC - 1) / 2). A kernel given True can drop its test of the span and its exact path. Decided from the
    options alone, never from the data."""
    if not opts.use_gate:
        return False
    lo = max(-math.inf if opts.lower_bound is None else float(opts.lower_bound),
             G_MIN.value if floor is None else floor)
    return -lo * steps * LOG2E.value <= getattr(span, "value", span)


def gate_floor(opts: KDAOptions, dtype: torch.dtype) -> float:
    """The floor of one step's activated log decay in the chunked kernels (natural log units; gam_block applies
    it, and the gate's gradient is zero below it): G_MIN, or G_MIN_16BIT with the in-op gate and l2norm on 16-bit
    inputs, where a decay factor below 2^-14.9 is under what the kernels resolve (common.G_MIN_16BIT says why).
    Decided from the options and the dtype alone, so the backward's rerun floors as the forward did."""
    if opts.use_gate and opts.use_qk_l2norm and dtype in (torch.bfloat16, torch.float16):
        return G_MIN_16BIT.value
    return G_MIN.value


def tune_size(tokens, heads):
    """The problem-size part of the chunk-parallel kernels' autotune keys (intra, W / U, inter, intra
    gradients): 0 for a grid that barely fills the GPU (tokens x value heads < 2^16), 1 otherwise.

    Their best config does not depend on the size beyond that: on the H200 at K = V = 128, bf16, from
    (1, 2048, 32) to (8, 4096, 32) (B, T, value heads), each kernel's best config was the same at
    every shape, within 4% (`python benchmarks/tune_sweep.py`). The small class keeps a config timed at a
    launch-bound, test-sized first call away from the large shapes. So a new sequence length tunes nothing,
    unless it is the first call on the other side of 2^16 tokens x heads.
    """
    return size_class(tokens * heads, 1 << 16, 2)


def tune_lanes(sequences, heads):
    """The problem-size part of the sequential state passes' autotune keys: the class of sequences x value
    heads (their parallel lanes; the length only sets how long each lane runs): < 8, 8-15, ..., 128-255, >= 256.

    Their best config depends on the lanes, not on the length: BV 32 with 4 warps at 32 lanes, BV 64 with 8
    warps from 64 lanes, BV 16 at 8 lanes (the forward state pass on the H200, `benchmarks/tune_sweep.py`).
    A new length at the same batch size and heads tunes nothing; varlen batches tune once per class of their
    number of sequences.
    """
    return size_class(sequences * heads, 8, 7)


def dot_precision(dtype: torch.dtype) -> str:
    """input_precision of the fp32 dots: tf32 for 16-bit inputs, IEEE fp32 for fp32 inputs.

    (Dots whose operands are stored in the input dtype run in that dtype.)"""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def seq_bounds(cu_seqlens, i_n, T):
    """[bos, eos) of sequence i_n (int64), clamped into [0, T]: cu_seqlens comes sanitised from chunk_index;
    the clamp keeps a kernel inside its tensors whatever it is given."""
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    bos = tl.minimum(tl.maximum(bos, 0), T)
    eos = tl.minimum(tl.maximum(eos, bos), T)
    return bos, eos


@triton.jit
def chunk_bounds(i_t, cu_seqlens, chunk_indices, T, N, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(sequence, chunk in the sequence, first token of the sequence, end of the sequence) of program i_t."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        # a program past the real work reads sequence N - 1 with an empty range (its stores are all masked)
        valid = i_n < N
        i_n = tl.minimum(i_n, N - 1)
        bos, eos = seq_bounds(cu_seqlens, i_n, T)
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


# ---- shared @triton.jit helpers of the stages ----

L2NORM_EPS = tl.constexpr(1e-6)   # same constant as kda_ops.reference.L2NORM_EPS (kernels do not import the reference)
# Largest |gam_i - gam_m| (log2) for which the factored dots run on the diagonal blocks too: factors stay in
# [2^-60, 2^60], so the masked entries above the diagonal stay finite (< 2^120 |q| |k|) and nothing flushes.
SPAN = tl.constexpr(60.0)
# The same bound where the rows enter the dots l2-normalised (the forward intra kernel with the in-op l2norm,
# |q_i|, |k_i| <= 1): an operand is at most 2^112 in magnitude (bf16, tf32 and fp32 reach 2^128), and an operand
# element below 2^-126 (subnormal, or flushed to zero) loses at most a term 2^-126 * 2^112 = 2^-14 (the other operand
# is at most 2^112) from a sum whose terms are at most 1.
# Entries above the diagonal may overflow; they are discarded.
SPAN_UNIT = tl.constexpr(112.0)
# Floor of one step's log decay g in the chunked kernels (natural log units): see gam_block
G_MIN = tl.constexpr(-128.0)
# The floor with the in-op gate and l2norm on 16-bit inputs (gate_floor): a step's decay factor is kept at least
# 2^-14.9 (3.3e-5). A pair of rows whose decay lies below that then contributes at most 2^-14.9 |q_i| |k_j| <=
# 2^-14.9 where the exact product would be smaller still: the size of term that the fast path may already drop
# (SPAN_UNIT, 2^-14), and 60 times below a bf16 rounding (2^-9). In exchange a 16-row block spans at most 15 x
# 14.9 = 223.5 < 2 SPAN_UNIT (the rest covers the fp32 cumsum's rounding), so the forward intra kernel's 16-row
# blocks always pass its test and it is built without the exact path (bounded_gate with this floor).
G_MIN_16BIT = tl.constexpr(-14.9 * 0.6931471805599453)


@triton.jit
def kd_chunk(kd, i_t, t0, i_hv, HV, K: tl.constexpr, BT: tl.constexpr, KD_T: tl.constexpr):
    """kd at one (chunk i_t, value head): its [K, BT] block of kd^T (KD_T: [NT_total, HV, K, BT]) or its first
    token row (token-major [B, T, HV, K], row stride HV * K)."""
    if KD_T:
        return kd + (i_t.to(tl.int64) * HV + i_hv) * (K * BT)
    else:
        return kd + t0 * (HV * K) + i_hv * K


@triton.jit
def finite(x):
    """Elementwise: x is neither NaN nor +-inf (a comparison, so a NaN gives False)."""
    return tl.abs(x) < float("inf")


@triton.jit
def mark_invalid(x, ok, DT: tl.constexpr):
    """x in dtype DT (fp32 or a 16-bit float) where ok, -0.0 where not: the mark of an invalid element
    (rows_marked). A valid x below fp32's smallest normal in magnitude (zeros of either sign included) becomes
    +0.0, so that no valid element reads as a mark, in fp32 or rounded to 16 bits; as a dot operand a mark is a
    zero. The mark is set on the integer bits: a -0.0 float constant selected after the conversion to bf16 lost
    its sign in the sm_90 build (triton 3.6)."""
    y = tl.where(tl.abs(x) < 1.1754943508222875e-38, 0.0, x).to(DT)
    if DT.primitive_bitwidth == 16:
        return tl.where(ok, y.to(tl.int16, bitcast=True), -32768).to(tl.int16).to(DT, bitcast=True)
    else:
        return tl.where(ok, y.to(tl.int32, bitcast=True), -2147483648).to(DT, bitcast=True)


@triton.jit
def rows_marked(x):
    """[BT] per row of x [BT, N] (fp32 or a 16-bit float, as stored by mark_invalid): whether the row holds a -0.0.
    A row minimum of the bits as signed integers: -0.0 is the only float whose bits are the integer minimum."""
    if x.dtype.primitive_bitwidth == 16:
        return tl.min(x.to(tl.int16, bitcast=True), axis=1) == -32768
    else:
        return tl.min(x.to(tl.int32, bitcast=True), axis=1) == -2147483648


@triton.jit
def rows_nonfinite(x):
    """[BT] per row of x [BT, N] fp32: whether the row has a NaN or an inf (a row maximum of the magnitudes' bits:
    those of NaN and inf are the largest)."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1) >= 0x7F800000


@triton.jit
def first_row(bad, BT: tl.constexpr):
    """First row i with bad[i] of bad [BT], BT if none: int32 scalar (the one whole-chunk reduction of the
    checks for invalid inputs, see chunk_kda_fwd_kernel_intra's note on non-finite inputs)."""
    return tl.min(tl.where(bad, tl.arange(0, BT), BT), axis=0)


@triton.jit
def poison_rows(qg, kd, gam, f, Tc, HV, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                KD_T: tl.constexpr):
    """NaN into rows f .. Tc - 1 of one (chunk, value head) of qg and gam [BT, K] (row stride HV * K) and of kd
    (KD_T: columns of its [K, BT] kd^T block; else rows, row stride HV * K); the pointers are at the chunk's
    first row / its block. Then the state pass gives NaN o rows >= f (qg S is row by row) and a NaN state
    leaving the chunk (kd^T Vn sums over every row; exp2 of the last row's gam), and in the backward's
    recompute dVn = Aqk^T dO + kd dS, dq (through exp2(gam)) and the gradient of the state entering the chunk
    are NaN. Only called for a chunk with an invalid row (rare): never on the clean path."""
    # row by row with [BK] vectors: few registers (the callers' register budgets are tight), speed irrelevant
    b_nan = tl.full([BK], float("nan"), dtype=tl.float32)
    for t in range(f, Tc):
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            tl.store(qg + t * (HV * K) + o_k, b_nan.to(qg.dtype.element_ty), mask=m_k)
            tl.store(gam + t * (HV * K) + o_k, b_nan, mask=m_k)
            if KD_T:
                tl.store(kd + o_k * BT + t, b_nan.to(kd.dtype.element_ty), mask=m_k)
            else:
                tl.store(kd + t * (HV * K) + o_k, b_nan.to(kd.dtype.element_ty), mask=m_k)


@triton.jit
def l2norm_factor(b_ss, EPS: tl.constexpr, ZERO_BAD: tl.constexpr):
    """Per-row factor of the in-op l2norm, 1 / sqrt(sum_d x^2 + eps), from the row sums of squares b_ss [BT].
    ZERO_BAD (k): 0 for a row with a NaN or inf element (its sum of squares is NaN or inf; a sum of finite
    elements that overflows gives 0 too), so that the row's zeroed k stays zero."""
    b_r = tl.rsqrt(b_ss + EPS)
    if ZERO_BAD:
        b_r = tl.where(b_ss == b_ss, b_r, 0.0)
    return b_r


# Whether the kernels may call the GPU's approximate special functions (not under the interpreter, which has none)
SFU = tl.constexpr(not INTERPRET)
LOG2E = tl.constexpr(1.4426950408889634)   # log2(e): natural-log units to log2 units
LN2 = tl.constexpr(0.6931471805599453)     # ln(2)


@triton.jit
def log2_sfu(x):
    """log2(x) for x >= 1 on the special-function unit (lg2.approx, an error of about 2^-22). tl.log and
    tl.log2 compile to libdevice's accurate logf / log2f, ~20 instructions and a branch per element."""
    if SFU:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def softplus(x):
    """log(1 + exp(x)) without overflow, in base 2 (both functions on the special-function unit)."""
    return tl.maximum(x, 0.0) + LN2 * log2_sfu(1.0 + tl.exp2(-tl.abs(x) * LOG2E))


@triton.jit
def gate_scale(A_log, i_hv, HAS_A_LOG: tl.constexpr):
    """a = exp(A_log) of value head i_hv, the in-op gate's scale (fp32 scalar); 1.0 without A_log."""
    if HAS_A_LOG:
        return tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        return 1.0


@triton.jit
def chunk_tile(x, Tc, sx, i_k, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """K-block i_k of one chunk's rows of x (x at the chunk's first row, row stride sx) as stored: [BT, BK],
    zero past Tc and past K."""
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    return tl.load(x + o_t[:, None] * sx + o_k[None, :], mask=(o_t < Tc)[:, None] & (o_k < K)[None, :], other=0.0)


@triton.jit
def pass_tiles(q, k, g, dt_bias, Tc, i_k, sq, sg, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               USE_L2NORM: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """What the forward intra kernel's pre-processing takes of K-block i_k, as stored and without arithmetic
    (loads only, so that the kernel can issue them a block ahead of their use): q, k, g [BT, BK] (q, k, g at the
    chunk's first row and head; row strides sq, sg) and dt_bias [BK] (at the value head). q and k are zeros
    without USE_L2NORM and dt_bias without HAS_DT_BIAS (not loaded). Zero past Tc and past K."""
    if USE_L2NORM:
        b_q = chunk_tile(q, Tc, sq, i_k, K, BT, BK)
        b_k = chunk_tile(k, Tc, sq, i_k, K, BT, BK)
    else:
        b_q = tl.zeros([BT, BK], dtype=q.dtype.element_ty)
        b_k = tl.zeros([BT, BK], dtype=k.dtype.element_ty)
    o_k = i_k * BK + tl.arange(0, BK)
    if HAS_DT_BIAS:
        b_db = tl.load(dt_bias + o_k, mask=o_k < K, other=0.0)
    else:
        b_db = tl.zeros([BK], dtype=tl.float32)
    return b_q, b_k, chunk_tile(g, Tc, sg, i_k, K, BT, BK), b_db


@triton.jit
def gam_block(b_x, b_db, b_a, lower_bound, Tc, i_k, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
              G_FLOOR: tl.constexpr):
    """gam of one chunk and K-block: the in-chunk cumsum of the activated gate, [BT, BK] fp32 in log2 units,
    from the raw gate b_x [BT, BK] and dt_bias b_db [BK] (pass_tiles) and the gate's scale b_a (gate_scale).
    With the in-op gate, the activated log decay is -a softplus(x + dt_bias), or lower_bound sigmoid(a (x +
    dt_bias)) with HAS_LOWER_BOUND (natural log units); without it, b_x is the log decay itself. Floored at G_FLOOR
    (gate_floor: G_MIN or G_MIN_16BIT).

    Rows past the chunk's valid length Tc get a zero log decay, so gam stays finite (they are masked later);
    so do invalid elements (NaN, +inf: selection). Each element's lowest mantissa bit says whether the gate
    element of its row was invalid (gam_valid); the change of at most 1 ulp is below fp32's own rounding of gam.
    """
    b_g = b_x.to(tl.float32)
    if USE_GATE:
        if HAS_DT_BIAS:
            b_g = b_g + b_db.to(tl.float32)[None, :]
        if HAS_LOWER_BOUND:
            b_g = lower_bound * tl.sigmoid(b_a * b_g)
        else:
            b_g = -b_a * softplus(b_g)
        o_t = tl.arange(0, BT)
        o_k = i_k * BK + tl.arange(0, BK)
        b_g = tl.where((o_t < Tc)[:, None] & (o_k < K)[None, :], b_g, 0.0)
    # NaN and +inf are invalid inputs. -inf is a valid full reset: a step below G_MIN decays to exactly 0 in fp32
    # either way (exp(-104) is below the smallest fp32); raising it to G_MIN keeps the cumsum finite (g = -inf
    # would make gam_i - gam_j = -inf + inf = NaN) and well conditioned
    ok = b_g < float("inf")
    b_g = tl.where(ok, tl.where(b_g < G_FLOOR, G_FLOOR, b_g), 0.0)
    b_gam = tl.cumsum(b_g, axis=0) * LOG2E
    # invalid elements marked in gam's lowest mantissa bit (set there, clear elsewhere; 1 ulp). ok is used in the
    # layout of the cumsum's result: used in any other layout, the compiler loads and activates the gate twice
    bits = b_gam.to(tl.int32, bitcast=True)
    return tl.where(ok, bits & -2, bits | 1).to(tl.float32, bitcast=True)


@triton.jit
def gam_valid(b_g):
    """Elementwise on gam as gam_block makes it: whether the gate element of that row was valid."""
    return (b_g.to(tl.int32, bitcast=True) & 1) == 0


@triton.jit
def load_beta(beta, i_hv, t0, Tc, HV, BT: tl.constexpr,
              USE_BETA_SIGMOID: tl.constexpr, ALLOW_NEG_EIGVAL: tl.constexpr):
    """Activated beta of one chunk: [BT] fp32, zero past Tc (a NaN or inf is kept: the caller zeroes it where it
    is used as a factor)."""
    o_t = tl.arange(0, BT)
    m_t = o_t < Tc
    b_beta = tl.load(beta + (t0 + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    if USE_BETA_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
        if ALLOW_NEG_EIGVAL:
            b_beta = 2.0 * b_beta
        b_beta = tl.where(m_t, b_beta, 0.0)
    return b_beta


@triton.jit
def tf32_round(x, PREC: tl.constexpr):
    """With PREC == "tf32": fp32 x rounded to the nearest tf32 value (10 mantissa bits, ties away from zero),
    still fp32; a tf32 dot takes such an operand exactly, whatever rounding the tensor cores apply, so a kernel
    can multiply by the value the dot used. Otherwise x."""
    if PREC == "tf32":
        i = x.to(tl.int32, bitcast=True)
        return ((i + 0x1000) & -8192).to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def load_rows(x, r, o_t, m_t, o_k, m_k, sx, sr, USE_L2NORM: tl.constexpr):
    """Rows o_t (row strides sx of x, sr of r) of q or k as fp32 [len(o_t), BK], l2-normalised with the row
    factors r when USE_L2NORM; zero where masked. x, r already point at the head of the chunk's first row."""
    b_x = tl.load(x + o_t[:, None] * sx + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_x = b_x.to(tl.float32)
    if USE_L2NORM:
        b_x *= tl.load(r + o_t * sr, mask=m_t, other=0.0)[:, None]
    return b_x
