"""kda_ops.onnx: KDA as one custom-domain node with a function body (and as LinearAttention), run by
stock onnxruntime and compared with PyTorch in fp32."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch.export import Dim

import kda_ops
import kda_ops.onnx as konnx
from export.artifacts import example_inputs, graph_modules
from kda_ops.layers import KDAConfig, KDALanguageModel

TOL = 1e-4          # fp32 relative error, max|a - b| / max|b|
LA_MODES = ["linear_attention", "ms_linear_attention"]


def rel_err(a, b) -> float:
    b = b.detach().double().numpy()
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def run_ort(model: onnx.ModelProto, inputs):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: x.numpy() for i, x in zip(sess.get_inputs(), inputs)})


def assert_close(onnx_model, torch_fn, inputs):
    with torch.no_grad():
        expected = torch_fn(*inputs)
    got = run_ort(onnx_model, inputs)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.shape == tuple(b.shape)
        assert rel_err(a, b) <= TOL


# ----------------------------------------------------------------------------------------------
# One op, every pre-processing flag: a stand-in module around kda_ops.chunk_kda / recurrent_kda.
# ----------------------------------------------------------------------------------------------
class OneOp(torch.nn.Module):
    """x [B, T, D] (+ state) -> (o, final_state), through one KDA op with projections around it."""

    def __init__(self, H=2, HV=4, K=8, V=12, D=16, decode=False, in_op=True, lower_bound=None,
                 allow_neg_eigval=False, with_dt_bias=True):
        super().__init__()
        self.H, self.HV, self.K, self.V, self.decode = H, HV, K, V, decode
        self.proj = torch.nn.Linear(D, 2 * H * K + HV * V + HV * K + HV)
        self.A_log = torch.nn.Parameter(torch.rand(HV)) if lower_bound is None else None
        self.dt_bias = torch.nn.Parameter(0.5 * torch.randn(HV * K)) if with_dt_bias else None
        self.kw = dict(use_qk_l2norm_in_kernel=in_op, use_gate_in_kernel=in_op,
                       use_beta_sigmoid_in_kernel=in_op, allow_neg_eigval=allow_neg_eigval,
                       lower_bound=lower_bound)
        self.in_op = in_op

    def forward(self, x, state=None):
        B, T, _ = x.shape
        H, HV, K, V = self.H, self.HV, self.K, self.V
        q, k, v, g, beta = self.proj(x).split([H * K, H * K, HV * V, HV * K, HV], -1)
        q, k, v, g = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V), g.view(B, T, HV, K)
        kw = dict(self.kw)
        if self.in_op:
            kw.update(A_log=self.A_log, dt_bias=self.dt_bias)
        else:   # pre-processing outside the op
            q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
            g, beta = torch.nn.functional.logsigmoid(g), beta.sigmoid()
        if self.decode:
            return kda_ops.recurrent_kda(q, k, v, g, beta, initial_state=state, **kw)
        return kda_ops.chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True, **kw)


OP_CASES = {
    "chunk-inop": dict(),
    "chunk-inop-lb-neg-noh0": dict(lower_bound=-3.0, allow_neg_eigval=True, with_dt_bias=False),
    "chunk-outside-H4HV4": dict(in_op=False, H=4),
    "recurrent-inop": dict(decode=True),
    "recurrent-lb": dict(decode=True, lower_bound=-1.0),
}


# every case as a function node; each LinearAttention mode on one case (prefill for the standard op,
# decode for onnxruntime's; the language model in tests/test_export_tool.py covers the rest)
ONE_OP = [(name, "function") for name in OP_CASES] + [("chunk-inop", LA_MODES[0]), ("recurrent-lb", LA_MODES[1])]


@pytest.mark.parametrize("name,mode", ONE_OP, ids=[f"{n}-{m}" for n, m in ONE_OP])
def test_one_op(name, mode):
    torch.manual_seed(0)
    m = OneOp(**OP_CASES[name]).eval()
    with_state = "noh0" not in name
    batch, seq = Dim("batch", max=8), Dim("seq", max=64)

    def inputs(B, T):
        x = torch.randn(B, T, 16)
        return (x, 0.3 * torch.randn(B, m.HV, m.K, m.V)) if with_state else (x,)
    shapes = ({0: batch, 1: seq}, {0: batch}) if with_state else ({0: batch, 1: seq},)
    model = konnx.export(m, inputs(2, 5), dynamic_shapes=shapes, mode=mode)
    onnx.checker.check_model(model, full_check=True)
    nodes = [(n.domain, n.op_type) for n in model.graph.node]
    if mode == "function":
        op_name = "RecurrentKDA" if m.decode else "ChunkKDA"
        assert [t for d, t in nodes if d == konnx.DOMAIN] == [op_name]
        assert {(f.domain, f.name) for f in model.functions} == {("kda_ops", op_name), ("kda_ops", "KDAPrepare")}
    else:
        assert nodes.count((konnx._LA_DOMAIN[mode], "LinearAttention")) == 1
        assert not any(d == konnx.DOMAIN for d, _ in nodes) and not model.functions
    for B, T in ((3, 1), (1, 9)) if m.decode else ((3, 17), (1, 64)):   # neither the exported size
        assert_close(model, m, inputs(B, T))


def test_packed_varlen_raises():
    class Varlen(torch.nn.Module):
        def forward(self, q, k, v, g, beta, cu):
            return kda_ops.chunk_kda(q, k, v, g, beta, cu_seqlens=cu)[0]
    q = torch.randn(1, 6, 1, 8)
    args = (q, q, q, -q.abs(), torch.rand(1, 6, 1), torch.tensor([0, 2, 6]))
    with pytest.raises(Exception, match="cu_seqlens"):
        konnx.export(Varlen(), args)


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown kda_ops ONNX mode"):
        konnx.custom_translation_table("tensorrt")


# ----------------------------------------------------------------------------------------------
# The tiny LM: prefill (dynamic batch and length) and decode (cache in, cache out).
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = KDALanguageModel(KDAConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=2,
                                       num_v_heads=4, head_dim=8)).eval()
    examples = example_inputs(model, 128, 2, 10, "cpu")
    batch, seq = Dim("batch", max=8), Dim("seq", max=128)
    shapes = {"prefill": ({0: batch, 1: seq},), "decode": ({0: batch}, ({0: batch},) * 4)}
    with torch.no_grad():
        programs = {name: torch.export.export(g, examples[name], dynamic_shapes=shapes[name])
                    for name, g in graph_modules(model).items()}
    return model, programs


@pytest.mark.parametrize("mode", ["function"])
def test_language_model(lm, mode):
    model, programs = lm
    graphs = graph_modules(model)
    for name, ep in programs.items():
        onnx_model = konnx.export(ep, (), mode=mode)
        onnx.checker.check_model(onnx_model, full_check=True)
        kda_nodes = [n for n in onnx_model.graph.node if n.domain == konnx.DOMAIN]
        la_nodes = [n for n in onnx_model.graph.node if n.op_type == "LinearAttention"]
        assert len(kda_nodes if mode == "function" else la_nodes) == model.config.num_layers
        # exported at length 10: run two other lengths (and batches); decode on a real cache
        for B, T in ((3, 1), (1, 37)):
            inputs = example_inputs(model, 128, B, T, "cpu", seed=T)[name]
            assert_close(onnx_model, graphs[name], inputs)
