"""transformers' Kimi Linear with its KDA layers running through kda_ops (pip install 'kda_ops[hf]').

    python examples/hf_kimi_linear.py            # tiny random model; CPU, or the GPU when there is one
    python examples/hf_kimi_linear.py --size large --prompt-len 4096 --new-tokens 64   # on a GPU

Builds a random KimiLinearForCausalLM, runs prefill and greedy decode with transformers' own KDA path
(FLA's kernels when flash-linear-attention is installed, otherwise its torch loop), then again after
``patch_kimi_linear()`` (kda_ops), and prints the timings side by side, the largest logit difference and
whether the generated tokens agree.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kda_ops.integrations.transformers import patch_kimi_linear, unpatch_kimi_linear  # noqa: E402

SIZES = {
    # 3 layers (KDA, MLA, KDA), a few experts: seconds on a laptop CPU
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                 qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_local_experts=4,
                 num_experts_per_tok=2, linear_head_dim=16, linear_num_heads=4),
    # Kimi Linear's attention shapes (16 KDA heads of 128), 4 layers with one MLA layer, few experts
    "large": dict(vocab_size=32000, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512,
                  num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                  qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, num_local_experts=8,
                  num_experts_per_tok=2, linear_head_dim=128, linear_num_heads=16),
}


def build(size: str, device, dtype):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    n = SIZES[size]["num_hidden_layers"]
    cfg = KimiLinearConfig(**SIZES[size], q_lora_rank=None, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           layer_types=["full_attention" if i == n // 2 else "linear_attention" for i in range(n)])
    torch.manual_seed(0)
    return KimiLinearForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def timed(fn, device, repeat):
    fn()                                          # warm-up (Triton compiles / autotunes here)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t) / repeat * 1e3


@torch.no_grad()
def run(model, ids, new_tokens, device, repeat):
    logits, prefill_ms = timed(lambda: model(ids, use_cache=False).logits, device, repeat)
    gen = lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,  # noqa: E731
                                 do_sample=False)
    tokens, total_ms = timed(gen, device, repeat)
    # generate = one prefill with the cache + (new_tokens - 1) decode steps
    decode_ms = max(total_ms - prefill_ms, 0.0) / max(new_tokens - 1, 1)
    return logits, tokens[:, ids.shape[1]:], prefill_ms, decode_ms


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeat", type=int, default=None, help="timed repetitions (default 1 on CPU, 5 on CUDA)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    repeat = a.repeat or (5 if device.type == "cuda" else 1)

    model = build(a.size, device, dtype)
    ids = torch.randint(3, model.config.vocab_size, (a.batch, a.prompt_len),
                        generator=torch.Generator().manual_seed(0)).to(device)
    own = "FLA" if importlib.util.find_spec("fla") is not None else "torch loop"
    print(f"Kimi Linear ({a.size}, {sum(x.numel() for x in model.parameters()) / 1e6:.1f}M params) on "
          f"{device}, {str(dtype).replace('torch.', '')}; batch {a.batch}, prompt {a.prompt_len}, "
          f"{a.new_tokens} new tokens")

    unpatch_kimi_linear()
    ref_logits, ref_tokens, *ref_ms = run(model, ids, a.new_tokens, device, repeat)
    patch_kimi_linear()
    try:
        logits, tokens, *ms = run(model, ids, a.new_tokens, device, repeat)
    finally:
        unpatch_kimi_linear()

    print(f"{'KDA path':<28}{'prefill ms':>12}{'decode ms/token':>18}")
    print(f"{'transformers (' + own + ')':<28}{ref_ms[0]:>12.2f}{ref_ms[1]:>18.2f}")
    print(f"{'kda_ops (patch_kimi_linear)':<28}{ms[0]:>12.2f}{ms[1]:>18.2f}")
    diff = (logits.float() - ref_logits.float()).abs().max().item()
    same = torch.equal(tokens, ref_tokens)
    print(f"max |logits difference| {diff:.3g}; generated tokens {'identical' if same else 'differ'}")
    if not same and dtype != torch.float32:
        print("(in reduced precision, greedy decoding of a random model may pick a different near-tie token)")
    return diff, same


if __name__ == "__main__":
    main()
