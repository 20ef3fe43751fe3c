"""Kimi Delta Attention as an ``nn.Module``, and a tiny causal language model built from it.

:class:`KimiDeltaAttention` is the token mixer of Kimi Linear: q/k/v projections, a causal depthwise
short convolution (kernel 4, SiLU) over the concatenated q|k|v channels, a low-rank forget-gate
projection whose activation (``A_log``, ``dt_bias``, optional safe-gate ``lower_bound``) runs inside the
op, a beta projection (sigmoid in the op), q/k l2norm in the op, and a low-rank output gate feeding a
sigmoid-gated RMSNorm over each value head before the output projection.

Every module has three entry points with the same math:

* ``forward(x)`` -- training / prefill without a cache (``kda_ops.chunk_kda``).
* ``prefill(x, ...)`` -- chunked, and returns the cache (``chunk_kda(..., output_final_state=True)``).
* ``step(x, ...)`` -- decode, token by token (``kda_ops.recurrent_kda``); any small ``T`` works.

The cache is plain tensors and the functions are pure (inputs are never modified), so ``prefill`` and
``step`` export with ``torch.export`` as they are. Per layer:

    conv_state      [B, 2 * H * K + HV * V, 3]   the last 3 inputs of the short convolution (model dtype)
    recurrent_state [B, HV, K, V]                the KDA state, float32

:class:`KDALanguageModel` passes its cache as one flat tuple ``(conv_0, state_0, conv_1, state_1, ...)``.

Checkpoint format (what ``examples/train_compiled.py`` writes and :func:`load_checkpoint` reads)::

    torch.save({"config": dataclasses.asdict(cfg),     # KDAConfig as plain Python types
                "model": model.state_dict(),           # of the uncompiled model (no "_orig_mod." prefix)
                ...},                                  # anything else: step, args, metrics
               "ckpt.pt")
    model = kda_ops.layers.load_checkpoint("ckpt.pt")  # -> KDALanguageModel in eval mode, on CPU

Example::

    >>> import torch
    >>> from kda_ops.layers import KDAConfig, KDALanguageModel
    >>> model = KDALanguageModel(KDAConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=2,
    ...                                    head_dim=32))
    >>> ids = torch.randint(0, 128, (2, 10))
    >>> model(ids).shape
    torch.Size([2, 10, 128])
    >>> logits, cache = model.prefill(ids)
    >>> logits, cache = model.step(ids[:, -1:], cache)
    >>> model.generate(ids, max_new_tokens=5).shape
    torch.Size([2, 15])
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .api import chunk_kda, recurrent_kda

Cache = tuple[Tensor, ...]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim, computed in float32 and returned in ``x.dtype``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Optional[Tensor] = None) -> Tensor:
        """x: [..., dim]; optional gate [..., dim]: returns ``rmsnorm(x) * sigmoid(gate)``."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        if gate is not None:
            y = y * torch.sigmoid(gate.float())
        return y.to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """The Kimi Linear token mixer. Input and output ``[B, T, hidden_size]``.

    Args:
        hidden_size: model width ``D``.
        num_heads: q/k heads ``H``.
        head_dim: ``K = V``, the per-head key and value width.
        num_v_heads: value heads ``HV`` (a multiple of ``H``; default ``H``).
        conv_size: short-convolution kernel width (4).
        lower_bound: safe gate, ``g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))``, in [-5, 0);
            None for the default gate ``g = -exp(A_log) * softplus(g_raw + dt_bias)``.
        norm_eps: eps of the gated output RMSNorm.

    Parameters (beyond the projections): ``A_log`` [HV] and ``dt_bias`` [HV * K], float32, consumed by
    the op (``use_gate_in_kernel=True``); ``conv.weight`` [2HK + HV*V, 1, conv_size].
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_v_heads: Optional[int] = None,
                 conv_size: int = 4, lower_bound: Optional[float] = None, norm_eps: float = 1e-6):
        super().__init__()
        HV = num_heads if num_v_heads is None else num_v_heads
        if HV % num_heads != 0:
            raise ValueError(f"num_v_heads = {HV} must be a multiple of num_heads = {num_heads}")
        self.hidden_size, self.num_heads, self.num_v_heads, self.head_dim = hidden_size, num_heads, HV, head_dim
        self.conv_size, self.lower_bound = conv_size, lower_bound
        self.key_dim, self.value_dim = num_heads * head_dim, HV * head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        # One depthwise causal convolution over the q|k|v channels (applied in _short_conv; nn.Conv1d only
        # holds the weight [C, 1, conv_size] and its usual initialisation).
        self.conv = nn.Conv1d(self.conv_dim, self.conv_dim, conv_size, groups=self.conv_dim, bias=False)
        # Low-rank forget gate (raw; activated in the op) and beta logits (sigmoid in the op).
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, head_dim, bias=False),
                                    nn.Linear(head_dim, HV * head_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, HV, bias=False)
        self.A_log = nn.Parameter(torch.empty(HV, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(HV * head_dim, dtype=torch.float32))
        # Low-rank output gate and the sigmoid-gated RMSNorm over each value head.
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, head_dim, bias=False),
                                    nn.Linear(head_dim, self.value_dim, bias=True))
        self.o_norm = RMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self, dt_min: float = 1e-3, dt_max: float = 1e-1, dt_floor: float = 1e-4):
        """Kimi Linear init: ``A_log = log U(1, 16)``; ``dt_bias = softplus^-1(dt)``,
        ``dt = exp(U(log dt_min, log dt_max))`` clamped to ``>= dt_floor``."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(dt_min), math.log(dt_max)).exp()
        dt = dt.clamp(min=dt_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))        # inverse of softplus

    def init_state(self, batch_size: int, device=None, dtype: Optional[torch.dtype] = None):
        """Zero cache: ``(conv_state [B, conv_dim, conv_size - 1], recurrent_state [B, HV, K, K] fp32)``."""
        dtype = self.conv.weight.dtype if dtype is None else dtype
        device = self.conv.weight.device if device is None else device
        conv_state = torch.zeros(batch_size, self.conv_dim, self.conv_size - 1, device=device, dtype=dtype)
        state = torch.zeros(batch_size, self.num_v_heads, self.head_dim, self.head_dim, device=device,
                            dtype=torch.float32)
        return conv_state, state

    def _short_conv(self, x: Tensor, conv_state: Tensor):
        """x [B, T, C], conv_state [B, C, W - 1] -> (silu(conv) [B, T, C], new conv_state [B, C, W - 1]).

        The depthwise causal convolution is written as W shifted multiply-adds (one fused pointwise
        kernel under Inductor) rather than ``F.conv1d``: Inductor's conv-backward lowering specialises the
        sequence length, which would recompile dynamic-T training for every new length.
        """
        W, T = self.conv_size, x.shape[1]
        xs = torch.cat([conv_state.transpose(1, 2).to(x.dtype), x], dim=1)    # [B, W - 1 + T, C]
        w = self.conv.weight.to(x.dtype).squeeze(1).t()                        # [W, C]
        y = xs[:, 0:T] * w[0]
        for i in range(1, W):
            y = y + xs[:, i:i + T] * w[i]
        return F.silu(y), xs[:, T:].transpose(1, 2).to(conv_state.dtype)

    def _mix(self, x: Tensor, conv_state: Optional[Tensor], state: Optional[Tensor], decode: bool,
             output_final_state: bool):
        B, T, _ = x.shape
        H, HV, K = self.num_heads, self.num_v_heads, self.head_dim
        if conv_state is None:
            conv_state = x.new_zeros(B, self.conv_dim, self.conv_size - 1)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)   # [B, T, C]
        qkv, new_conv_state = self._short_conv(qkv, conv_state)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = (t.reshape(B, T, n, K) for t, n in ((q, H), (k, H), (v, HV)))   # strided views
        g = self.f_proj(x).view(B, T, HV, K)                                  # raw gate
        beta = self.b_proj(x)                                                 # [B, T, HV] logits
        kw = dict(initial_state=state, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, lower_bound=self.lower_bound,
                  A_log=self.A_log.float(), dt_bias=self.dt_bias.float())
        if decode:
            o, new_state = recurrent_kda(q, k, v, g, beta, **kw)
        else:
            o, new_state = chunk_kda(q, k, v, g, beta, output_final_state=output_final_state, **kw)
        gate = self.g_proj(x).view(B, T, HV, K)
        o = self.o_norm(o, gate)                                              # [B, T, HV, V]
        y = self.o_proj(o.reshape(B, T, self.value_dim))
        return y, new_conv_state, new_state

    def forward(self, x: Tensor) -> Tensor:
        """Training / prefill without cache. x: [B, T, D] -> y: [B, T, D]."""
        return self._mix(x, None, None, decode=False, output_final_state=False)[0]

    def prefill(self, x: Tensor, conv_state: Optional[Tensor] = None, recurrent_state: Optional[Tensor] = None):
        """Chunked forward that returns the cache; continues from a cache when given.

        x [B, T, D]; conv_state [B, conv_dim, 3] or None (zeros); recurrent_state [B, HV, K, V] fp32 or None.
        Returns ``(y [B, T, D], conv_state [B, conv_dim, 3], recurrent_state [B, HV, K, V] fp32)``.
        """
        return self._mix(x, conv_state, recurrent_state, decode=False, output_final_state=True)

    def step(self, x: Tensor, conv_state: Tensor, recurrent_state: Tensor):
        """Decode (typically ``T == 1``) with the recurrent op; same shapes as :meth:`prefill`. Inference only."""
        return self._mix(x, conv_state, recurrent_state, decode=True, output_final_state=True)


# ----------------------------------------------------------------------------------------------
# A tiny causal language model.
# ----------------------------------------------------------------------------------------------
@dataclass
class KDAConfig:
    """Hyper-parameters of :class:`KDALanguageModel` (plain types: stored as a dict in checkpoints)."""
    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_v_heads: Optional[int] = None       # None -> num_heads
    head_dim: int = 64
    mlp_ratio: float = 8 / 3               # SwiGLU width = round_up(mlp_ratio * hidden_size, 16)
    conv_size: int = 4
    lower_bound: Optional[float] = None    # safe gate bound in [-5, 0), or None
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self):
        if self.num_v_heads is None:
            self.num_v_heads = self.num_heads
        if self.num_v_heads % self.num_heads:
            raise ValueError(
                f"num_v_heads = {self.num_v_heads} must be a multiple of num_heads = {self.num_heads}")

    @property
    def intermediate_size(self) -> int:
        return 16 * math.ceil(self.mlp_ratio * self.hidden_size / 16)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: [B, T, D] -> [B, T, D]."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class KDABlock(nn.Module):
    """Pre-norm residual block: ``x + KDA(norm(x))``, then ``x + SwiGLU(norm(x))``."""

    def __init__(self, cfg: KDAConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = KimiDeltaAttention(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_v_heads,
                                       cfg.conv_size, cfg.lower_bound, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, conv_state: Optional[Tensor] = None, state: Optional[Tensor] = None,
                mode: str = "train"):
        """mode "train": returns x'. "prefill" / "step": returns (x', conv_state', state')."""
        h = self.attn_norm(x)
        if mode == "train":
            x = x + self.attn(h)
            return x + self.mlp(self.mlp_norm(x))
        mixer = self.attn.prefill if mode == "prefill" else self.attn.step
        y, conv_state, state = mixer(h, conv_state, state)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), conv_state, state


class KDALanguageModel(nn.Module):
    """Embedding, ``num_layers`` :class:`KDABlock`, final RMSNorm, head tied to the embedding.

    The cache is a flat tuple of ``2 * num_layers`` tensors, ``(conv_0, state_0, conv_1, state_1, ...)``
    with conv_i [B, 2 * H * K + HV * K, conv_size - 1] (model dtype) and state_i [B, HV, K, K] float32.
    """

    def __init__(self, cfg: KDAConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(KDABlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.config.init_std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def _logits(self, h: Tensor) -> Tensor:
        return F.linear(self.norm(h), self.embed.weight)

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [B, T] int64 -> logits [B, T, vocab_size] (chunked op, no cache; for training)."""
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self._logits(h)

    def _with_cache(self, input_ids: Tensor, cache: Cache, mode: str):
        h = self.embed(input_ids)
        new_cache = []
        for i, block in enumerate(self.blocks):
            h, conv_state, state = block(h, cache[2 * i], cache[2 * i + 1], mode=mode)
            new_cache += [conv_state, state]
        return self._logits(h), tuple(new_cache)

    def prefill(self, input_ids: Tensor, cache: Optional[Cache] = None):
        """Chunked forward that returns the cache. input_ids [B, T]; cache None (start) or a previous cache.

        Returns ``(logits [B, T, vocab_size], cache)``.
        """
        if cache is None:
            cache = (None,) * (2 * len(self.blocks))
        return self._with_cache(input_ids, cache, "prefill")

    def step(self, input_ids: Tensor, cache: Cache):
        """Decode step with the recurrent op (inference only).

        input_ids [B, 1] (any small T works); returns ``(logits [B, 1, vocab_size], cache)``.
        """
        return self._with_cache(input_ids, cache, "step")

    def init_cache(self, batch_size: int, device=None) -> Cache:
        """The zero cache (what :meth:`prefill` starts from)."""
        return tuple(t for block in self.blocks for t in block.attn.init_state(batch_size, device))

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int) -> Tensor:
        """Greedy decoding: prefill the prompt [B, T], then ``step`` one token at a time.

        Returns [B, T + max_new_tokens] (prompt followed by the generated tokens).
        """
        out = [input_ids]
        if max_new_tokens > 0:
            logits, cache = self.prefill(input_ids)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(tok)
            for _ in range(max_new_tokens - 1):
                logits, cache = self.step(tok, cache)
                tok = logits[:, -1].argmax(-1, keepdim=True)
                out.append(tok)
        return torch.cat(out, dim=1)


def load_checkpoint(path, map_location="cpu") -> KDALanguageModel:
    """Rebuilds the model from a checkpoint ``{"config": asdict(KDAConfig), "model": state_dict, ...}``.

    Returns the model in eval mode on ``map_location``.
    """
    ckpt = torch.load(path, map_location=map_location, weights_only=True)
    fields = {f.name for f in dataclasses.fields(KDAConfig)}
    cfg = KDAConfig(**{k: v for k, v in ckpt["config"].items() if k in fields})
    model = KDALanguageModel(cfg)
    model.load_state_dict(ckpt["model"])
    return model.to(map_location).eval()
