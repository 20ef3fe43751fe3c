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

import kda_ops
from kda_case import kda_op
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


def kda_calls(ep):
    """Every kda_ops call of an ExportedProgram, in graph order, one a line, with its arguments by schema name:
    a tensor argument by name only (None when absent), every other argument with its value. (aten nodes are
    left out: their count and names change across torch versions.)"""
    lines = []
    for n in ep.graph.nodes:
        if n.op != "call_function" or not str(n.target).startswith("kda_ops."):
            continue
        assert not n.kwargs, n.kwargs
        args = [a.name if isinstance(v, torch.fx.Node) else f"{a.name}={v!r}"
                for a, v in zip(n.target._schema.arguments, n.args)]
        lines.append(f"{n.target}({', '.join(args)})")
    return "\n".join(lines)


def assert_only_public_ops(ep):
    """Exported programs hold the stable versioned ops only, never a private (``_``) one."""
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"
               and str(n.target).startswith("kda_ops.")]
    assert targets, "no kda_ops node"
    assert all(t in ("kda_ops.chunk_kda_v1.default", "kda_ops.recurrent_kda_v1.default") for t in targets), targets




@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return KDALanguageModel(KDAConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_v_heads=4,
                                      head_dim=16)).eval()


@pytest.fixture(scope="module")
def exported(model):
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    return torch.export.export(model, (ids,), dynamic_shapes=({0: BATCH, 1: SEQ},))


def test_op_schemas():
    """The versioned ops' schemas are the contract of every exported program: pinned."""
    assert kda_ops.SCHEMA_VERSION == 1
    assert_expected_inline(str(kda_op("chunk_kda_v1")._schema), """\
kda_ops::chunk_kda_v1(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, \
Tensor? initial_state, Tensor? cu_seqlens, float scale, float? lower_bound, bool use_qk_l2norm, bool use_gate, \
bool use_beta_sigmoid, bool allow_neg_eigval, bool output_final_state) -> (Tensor, Tensor)""")
    assert_expected_inline(str(kda_op("recurrent_kda_v1")._schema), """\
kda_ops::recurrent_kda_v1(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, \
Tensor? dt_bias, Tensor initial_state, Tensor? cu_seqlens, float scale, float? lower_bound, bool use_qk_l2norm, \
bool use_gate, bool use_beta_sigmoid, bool allow_neg_eigval) -> (Tensor, Tensor)""")


def test_forward_graph_keeps_the_op(exported):
    """One chunk_kda_v1 node per layer (2), with the layer's flags, also after run_decompositions."""
    for ep in (exported, exported.run_decompositions()):
        assert_only_public_ops(ep)
        assert_expected_inline(kda_calls(ep), """\
kda_ops.chunk_kda_v1.default(q, k, v, g, beta, A_log, dt_bias, initial_state=None, cu_seqlens=None, scale=0.25, lower_bound=None, use_qk_l2norm=True, use_gate=True, use_beta_sigmoid=True, allow_neg_eigval=False, output_final_state=False)
kda_ops.chunk_kda_v1.default(q, k, v, g, beta, A_log, dt_bias, initial_state=None, cu_seqlens=None, scale=0.25, lower_bound=None, use_qk_l2norm=True, use_gate=True, use_beta_sigmoid=True, allow_neg_eigval=False, output_final_state=False)""")


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
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    prefill = torch.export.export(Prefill(model), (ids,), dynamic_shapes=({0: BATCH, 1: SEQ},))
    _, cache = model.prefill(ids)
    cache_spec = tuple({0: BATCH} for _ in cache)
    step = torch.export.export(Step(model), (ids[:, :1], cache), dynamic_shapes=({0: BATCH}, cache_spec))
    for ep in (prefill, step, step.run_decompositions()):
        assert_only_public_ops(ep)
    assert_expected_inline(kda_calls(prefill), """\
kda_ops.chunk_kda_v1.default(q, k, v, g, beta, A_log, dt_bias, initial_state=None, cu_seqlens=None, scale=0.25, lower_bound=None, use_qk_l2norm=True, use_gate=True, use_beta_sigmoid=True, allow_neg_eigval=False, output_final_state=True)
kda_ops.chunk_kda_v1.default(q, k, v, g, beta, A_log, dt_bias, initial_state=None, cu_seqlens=None, scale=0.25, lower_bound=None, use_qk_l2norm=True, use_gate=True, use_beta_sigmoid=True, allow_neg_eigval=False, output_final_state=True)""")
    assert_expected_inline(kda_calls(step.run_decompositions()), """\
kda_ops.recurrent_kda_v1.default(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens=None, scale=0.25, lower_bound=None, use_qk_l2norm=True, use_gate=True, use_beta_sigmoid=True, allow_neg_eigval=False)
kda_ops.recurrent_kda_v1.default(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens=None, scale=0.25, lower_bound=None, use_qk_l2norm=True, use_gate=True, use_beta_sigmoid=True, allow_neg_eigval=False)""")

    # Another batch size and prompt length; then three decode steps, all against eager.
    ids = torch.randint(0, 64, (3, 33), generator=torch.Generator().manual_seed(3))
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
