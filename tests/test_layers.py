"""KimiDeltaAttention and KDALanguageModel: the chunked path, the cached prefill and the decode step agree.

fp32 on CPU with tiny shapes; T = 70 crosses a 64-token chunk boundary.
"""
import dataclasses

import pytest
import torch

from kda_ops.layers import KDAConfig, KDALanguageModel, KimiDeltaAttention, load_checkpoint


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def tiny_config(**kw):
    return KDAConfig(**{**dict(vocab_size=97, hidden_size=48, num_layers=2, num_heads=2, num_v_heads=4,
                               head_dim=16), **kw})


@pytest.mark.parametrize("lower_bound", [None, -3.0], ids=["gate-softplus", "gate-safe"])
def test_layer_chunked_equals_decode(lower_bound):
    torch.manual_seed(0)
    layer = KimiDeltaAttention(48, num_heads=2, head_dim=16, num_v_heads=4, lower_bound=lower_bound)
    x = torch.randn(2, 70, 48)
    with torch.no_grad():
        y = layer(x)
        conv_state, state = layer.init_state(2)
        steps = []
        for t in range(x.shape[1]):
            y_t, conv_state, state = layer.step(x[:, t:t + 1], conv_state, state)
            steps.append(y_t)
        _, conv_ref, state_ref = layer.prefill(x)
    assert rel_err(torch.cat(steps, 1), y) < 1e-5
    assert rel_err(state, state_ref) < 1e-5
    torch.testing.assert_close(conv_state, conv_ref)        # the last 3 projected inputs
    assert state.dtype == torch.float32 and state.shape == (2, 4, 16, 16)
    assert conv_state.shape == (2, layer.conv_dim, 3)


def test_cache_is_not_mutated():
    torch.manual_seed(0)
    layer = KimiDeltaAttention(48, num_heads=2, head_dim=16)
    conv_state, state = (torch.randn_like(t) for t in layer.init_state(2))
    before = conv_state.clone(), state.clone()
    with torch.no_grad():
        layer.step(torch.randn(2, 1, 48), conv_state, state)
        layer.prefill(torch.randn(2, 5, 48), conv_state, state)
    torch.testing.assert_close((conv_state, state), before, rtol=0, atol=0)


def test_lm_prefill_then_steps_equals_forward():
    torch.manual_seed(0)
    model = KDALanguageModel(tiny_config()).eval()
    ids = torch.randint(0, 97, (2, 75))
    with torch.no_grad():
        full = model(ids)
        logits, cache = model.prefill(ids[:, :50])
        parts = [logits]
        for t in range(50, 75):
            logits, cache = model.step(ids[:, t:t + 1], cache)
            parts.append(logits)
        # a chunked prefill that continues from a cache is the same computation
        first, cache2 = model.prefill(ids[:, :30])
        second, _ = model.prefill(ids[:, 30:], cache2)
    assert rel_err(torch.cat(parts, 1), full) < 1e-5
    assert rel_err(torch.cat([first, second], 1), full) < 1e-5
    assert len(cache) == 2 * model.config.num_layers
    for got, zero in zip(cache, model.init_cache(2)):
        assert got.shape == zero.shape and got.dtype == zero.dtype


def test_generate_is_deterministic_and_matches_forward():
    torch.manual_seed(0)
    model = KDALanguageModel(tiny_config()).eval()
    prompt = torch.randint(0, 97, (3, 9))
    out = model.generate(prompt, max_new_tokens=6)
    assert out.shape == (3, 15)
    assert torch.equal(out[:, :9], prompt)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=6))
    with torch.no_grad():                          # greedy: each new token is the argmax of the full forward
        assert torch.equal(model(out[:, :-1])[:, 8:].argmax(-1), out[:, 9:])
    assert torch.equal(model.generate(prompt, max_new_tokens=0), prompt)


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = KDALanguageModel(tiny_config(lower_bound=-5.0))
    ids = torch.randint(0, 97, (2, 20))
    torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    attn = model.blocks[0].attn
    for p in (attn.A_log, attn.dt_bias, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
              attn.f_proj[0].weight, attn.f_proj[1].weight, attn.b_proj.weight, attn.g_proj[1].bias,
              attn.o_proj.weight, attn.conv.weight):
        assert p.grad.abs().sum() > 0


def test_gate_init():
    torch.manual_seed(0)
    layer = KimiDeltaAttention(64, num_heads=4, head_dim=32)
    a = layer.A_log.exp()
    assert layer.A_log.dtype == torch.float32 and ((a >= 1) & (a <= 16)).all()
    dt = torch.nn.functional.softplus(layer.dt_bias)
    assert ((dt >= 1e-4) & (dt <= 0.1 + 1e-6)).all() and dt.min() < 0.01


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_config(lower_bound=-4.0)
    model = KDALanguageModel(cfg).eval()
    path = tmp_path / "ckpt.pt"
    torch.save({"config": dataclasses.asdict(cfg), "model": model.state_dict(), "step": 3}, path)
    loaded = load_checkpoint(path)
    assert loaded.config == cfg and not loaded.training
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
