"""torch.export of the tiny KDA language model: KDA stays one custom-op node (also after
run_decompositions), dynamic batch and sequence length, a .pt2 that a fresh process loads and runs, and the
prefill / decode-step graphs with the cache as plain tensor inputs and outputs.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn
from torch.export import Dim

from kda_ops.layers import KDAConfig, KDALanguageModel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SEQ = Dim("batch", min=1, max=64), Dim("seq", min=1, max=4096)


class Prefill(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model.prefill(input_ids)


class Step(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, cache):
        return self.model.step(input_ids, cache)


def kda_targets(ep):
    """Sorted kda_ops call targets of an ExportedProgram (stable across torch versions, unlike aten ones)."""
    return str(sorted({str(n.target) for n in ep.graph.nodes
                       if n.op == "call_function" and str(n.target).startswith("kda_ops.")}))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return KDALanguageModel(KDAConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_v_heads=4,
                                      head_dim=16)).eval()


@pytest.fixture(scope="module")
def exported(model):
    ids = torch.randint(0, 64, (2, 20))
    return torch.export.export(model, (ids,), dynamic_shapes=({0: BATCH, 1: SEQ},))


def test_forward_graph_keeps_the_op(exported):
    assert_expected_inline(kda_targets(exported), """['kda_ops.chunk_kda_fwd.default']""")
    assert_expected_inline(kda_targets(exported.run_decompositions()), """['kda_ops.chunk_kda_fwd.default']""")


def test_pt2_runs_in_a_fresh_process(model, exported, tmp_path):
    path, inputs, outputs = tmp_path / "kda_lm.pt2", tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.export.save(exported, str(path))
    ids = torch.randint(0, 64, (3, 70), generator=torch.Generator().manual_seed(1))  # new batch and length
    torch.save({"ids": ids}, inputs)
    script = textwrap.dedent(f"""
        import torch
        import kda_ops  # registers the ops the program calls
        ep = torch.export.load({str(path)!r})
        ids = torch.load({str(inputs)!r})["ids"]
        with torch.no_grad():
            torch.save({{"logits": ep.module()(ids)}}, {str(outputs)!r})
    """)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        expected = model(ids)
    torch.testing.assert_close(torch.load(outputs)["logits"], expected, rtol=1e-5, atol=1e-5)


def test_prefill_and_decode_step_export(model):
    ids = torch.randint(0, 64, (2, 20))
    prefill = torch.export.export(Prefill(model), (ids,), dynamic_shapes=({0: BATCH, 1: SEQ},))
    _, cache = model.prefill(ids)
    cache_spec = tuple({0: BATCH} for _ in cache)
    step = torch.export.export(Step(model), (ids[:, :1], cache), dynamic_shapes=({0: BATCH}, cache_spec))
    assert_expected_inline(kda_targets(prefill), """['kda_ops.chunk_kda_fwd.default']""")
    assert_expected_inline(kda_targets(step), """['kda_ops.recurrent_kda.default']""")
    assert_expected_inline(kda_targets(step.run_decompositions()), """['kda_ops.recurrent_kda.default']""")

    # Another batch size and prompt length; then three decode steps, all against eager.
    ids = torch.randint(0, 64, (3, 33))
    with torch.no_grad():
        got_logits, got_cache = prefill.module()(ids)
        want_logits, want_cache = model.prefill(ids)
        torch.testing.assert_close(got_logits, want_logits)
        torch.testing.assert_close(got_cache, want_cache)
        for t in range(3):
            tok = want_logits[:, -1:].argmax(-1)
            got_logits, got_cache = step.module()(tok, got_cache)
            want_logits, want_cache = model.step(tok, want_cache)
            torch.testing.assert_close(got_logits, want_logits)
            torch.testing.assert_close(got_cache, want_cache)
