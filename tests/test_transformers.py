"""kda_ops.integrations.transformers: transformers' Kimi Linear with its KDA prefill and decode through
kda_ops, on a tiny random fp32 config on CPU: logits and generated tokens equal the model's own torch path,
the forward compiles with fullgraph=True, and torch.export keeps the kda_ops nodes."""
import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")


def test_kda_ops_does_not_import_transformers():
    code = ("import sys, kda_ops, kda_ops.fla_compat, kda_ops.integrations; "
            "assert 'transformers' not in sys.modules and 'fla' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def kimi():
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers is not installed")
    try:
        from transformers import KimiLinearConfig, KimiLinearForCausalLM
        from transformers.models.kimi_linear import modeling_kimi_linear as mod
    except ImportError as e:                     # transformers < 5
        pytest.skip(f"transformers has no Kimi Linear: {e}")
    from kda_ops.integrations import transformers as integ
    cfg = KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, num_local_experts=4, num_experts_per_tok=2, linear_head_dim=16,
        linear_num_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)                         # the model's init draws from the global generator
    model = KimiLinearForCausalLM(cfg).eval()
    # random gate parameters so that the decay is not the init's near-identity
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "KimiLinearForgetGate":
                m.A_log.copy_(torch.randn(m.A_log.shape, generator=gen))
                m.dt_bias.copy_(torch.randn(m.dt_bias.shape, generator=gen))
    ids = torch.randint(3, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(2))
    originals = (mod.chunk_kimi_delta_attention, mod.recurrent_kimi_delta_attention)
    integ.unpatch_kimi_linear()
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    yield dict(model=model, ids=ids, ref=ref, mod=mod, integ=integ, originals=originals)
    integ.unpatch_kimi_linear()


@pytest.fixture
def patched(kimi):
    kimi["integ"].patch_kimi_linear()
    yield kimi
    kimi["integ"].unpatch_kimi_linear()


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls into kda_ops.fla_compat made by the patched layers."""
    from kda_ops import fla_compat
    n = {"chunk_kda": 0, "fused_recurrent_kda": 0}
    for name in n:
        fn = getattr(fla_compat, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            n[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(fla_compat, name, counted)
    return n


def test_patch_and_unpatch_restore_exactly(kimi):
    mod, integ = kimi["mod"], kimi["integ"]
    integ.patch_kimi_linear()
    integ.patch_kimi_linear()                    # idempotent
    assert mod.chunk_kimi_delta_attention is integ.chunk_kimi_delta_attention
    assert mod.recurrent_kimi_delta_attention is integ.recurrent_kimi_delta_attention
    assert integ.is_kimi_linear_patched()
    integ.unpatch_kimi_linear()
    assert (mod.chunk_kimi_delta_attention, mod.recurrent_kimi_delta_attention) == kimi["originals"]
    assert not integ.is_kimi_linear_patched()
    integ.unpatch_kimi_linear()                  # no-op


def test_logits_match_torch_path(patched, calls):
    with torch.no_grad():
        got = patched["model"](patched["ids"], use_cache=False).logits
    assert calls["chunk_kda"] == 2               # the two KDA layers ran through kda_ops
    torch.testing.assert_close(got, patched["ref"], rtol=1e-5, atol=1e-5)


def test_generate_same_tokens(kimi, calls):
    model, prompt, integ = kimi["model"], kimi["ids"][:, :9], kimi["integ"]
    want = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert calls == {"chunk_kda": 0, "fused_recurrent_kda": 0}
    integ.patch_kimi_linear()
    try:
        got = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    finally:
        integ.unpatch_kimi_linear()
    assert calls["chunk_kda"] == 2 and calls["fused_recurrent_kda"] == 2 * 5   # prefill + 5 decode steps
    assert torch.equal(got, want)


def test_compile_fullgraph(patched):
    """fullgraph=True: any graph break (in the KDA layers or elsewhere) raises; the graph holds kda_ops."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    compiled = torch.compile(patched["model"], fullgraph=True, backend=backend)
    with torch.no_grad():
        got = compiled(patched["ids"], use_cache=False).logits
    torch._dynamo.reset()
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(t.startswith("kda_ops.") for t in targets) == 2, targets
    torch.testing.assert_close(got, patched["ref"], rtol=1e-5, atol=1e-5)


def test_export_keeps_kda_ops_nodes(patched):
    ids = patched["ids"]
    ep = torch.export.export(patched["model"], (ids,), kwargs=dict(use_cache=False))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum(t.startswith("kda_ops.") for t in targets) == 2, targets
    with torch.no_grad():
        got = ep.module()(ids, use_cache=False).logits
    torch.testing.assert_close(got, patched["ref"], rtol=1e-5, atol=1e-5)


def test_example_runs(kimi, capsys):
    spec = importlib.util.spec_from_file_location(
        "hf_kimi_linear", pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_kimi_linear.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    diff, same = example.main(["--device", "cpu", "--prompt-len", "20", "--new-tokens", "3", "--batch", "1"])
    assert diff < 1e-4 and same
    assert "kda_ops (patch_kimi_linear)" in capsys.readouterr().out
    assert not kimi["integ"].is_kimi_linear_patched()
