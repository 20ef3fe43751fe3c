"""Artifacts exported earlier keep working: the stable op schemas and the compatibility fixtures.

tests/fixtures/schema_v<N>/ holds a .pt2 and an ONNX file of a prefill graph and of a decode step, exported by
the code that introduced schema version N, with their inputs and expected outputs (make_fixtures.py).
Here a fresh process imports the CURRENT kda_ops, loads every fixture, checks which ops its graph contains
and runs it against the stored outputs. The op schemas, the ONNX domain version and the ONNX node signatures
are pinned as text.

If one of these tests fails after a change, the change breaks artifacts users already have. Do not update the
pins or regenerate the fixtures: follow docs/design.md, "Schema policy" (add a ``*_v2`` op and ONNX domain
version 2 beside v1, keep v1 loadable, add schema_v2/ fixtures beside schema_v1/).
"""
import collections
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from expecttest import assert_expected_inline

import kda_ops
import kda_ops.onnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
sys.path.insert(0, FIXTURES)
import make_fixtures  # noqa: E402

POLICY = ("a stable kda_ops schema changed: artifacts exported earlier would stop loading or bind their "
          "arguments wrong. Do not update this pin or regenerate fixtures; add a new version beside the old one "
          "as docs/design.md, section 'Schema policy', describes.")

# What each fixture's graph contains: kda_ops call targets of the .pt2 (with counts), and the ONNX domain
# imports and kda_ops node types. A new schema version adds an entry (and its fixture directory).
PINNED = {
    1: {
        "prefill": {"pt2": {"kda_ops.chunk_kda_v1.default": 2},
                    "onnx_domains": {"kda_ops": 1}, "onnx_nodes": {"ChunkKDA": 2},
                    "onnx_functions": ["kda_ops::ChunkKDA", "kda_ops::KDAPrepare"]},
        "decode": {"pt2": {"kda_ops.recurrent_kda_v1.default": 2},
                   "onnx_domains": {"kda_ops": 1}, "onnx_nodes": {"RecurrentKDA": 2},
                   "onnx_functions": ["kda_ops::KDAPrepare", "kda_ops::RecurrentKDA"]},
    },
}
STABLE_TARGETS = {"kda_ops.chunk_kda_v1.default", "kda_ops.recurrent_kda_v1.default"}
CASES = [(v, name) for v in sorted(PINNED) for name in sorted(PINNED[v])]
IDS = [f"v{v}-{name}" for v, name in CASES]

# fp32 on CPU. The .pt2 runs the same implementation as the eager model that wrote the expected outputs; the
# ONNX function bodies are a token-by-token Scan instead of the chunked form (rounding differs, ~2e-7 here).
PT2_TOL = dict(rtol=1e-5, atol=1e-6)
ONNX_TOL = dict(rtol=1e-5, atol=2e-6)

# Runs in a fresh interpreter: loads every fixture with the current kda_ops and writes what it found.
_LOADER = textwrap.dedent("""
    import collections, json, sys, traceback
    import kda_ops                        # first: registers the ops the programs call
    import kda_ops.onnx
    import onnx, onnxruntime, torch

    repo, cases, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    assert kda_ops.__file__.startswith(repo), kda_ops.__file__
    report, tensors = {}, {}

    def ort_run(model, inputs):
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = onnxruntime.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        return [torch.from_numpy(o) for o in sess.run(None, {n: x.numpy() for n, x in zip(names, inputs)})]

    for directory, name in cases:
        key = directory + "/" + name
        r = report[key] = {}
        data = torch.load(f"{directory}/data.pt", weights_only=True)[name]
        inputs = data["inputs"]
        half = [x[:1] for x in inputs]                   # another batch size (the graphs have a dynamic batch)
        try:
            ep = torch.export.load(f"{directory}/{name}.pt2")
            r["pt2_targets"] = dict(collections.Counter(
                str(n.target) for n in ep.graph.nodes
                if n.op == "call_function" and str(n.target).startswith("kda_ops.")))
            with torch.no_grad():
                tensors[key + "/pt2"] = list(ep.module()(*inputs))
                tensors[key + "/pt2_batch1"] = list(ep.module()(*half))
        except Exception:
            r["pt2_error"] = traceback.format_exc()[-3000:]
        try:
            model = onnx.load(f"{directory}/{name}.onnx")
            r["onnx_domains"] = {o.domain: o.version for o in model.opset_import if o.domain}
            r["onnx_nodes"] = dict(collections.Counter(
                n.op_type for n in model.graph.node if n.domain == kda_ops.onnx.DOMAIN))
            r["onnx_other_domains"] = sorted({n.domain for n in model.graph.node} - {"", kda_ops.onnx.DOMAIN})
            r["onnx_functions"] = sorted(f"{f.domain}::{f.name}" for f in model.functions)
            tensors[key + "/onnx"] = ort_run(model, inputs)
            tensors[key + "/onnx_batch1"] = ort_run(model, half)
            # The old nodes with the function bodies of the current code.
            del model.functions[:]
            kda_ops.onnx.add_functions(model)
            r["onnx_current_bodies_domains"] = {o.domain: o.version for o in model.opset_import if o.domain}
            tensors[key + "/onnx_current_bodies"] = ort_run(model, inputs)
        except Exception:
            r["onnx_error"] = traceback.format_exc()[-3000:]
    torch.save(tensors, out + ".pt")
    with open(out + ".json", "w") as f:
        json.dump(report, f)
""")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(report, tensors) of the fresh process that loaded and ran every pinned fixture."""
    out = str(tmp_path_factory.mktemp("schema_compat") / "loaded")
    cases = [(make_fixtures.fixture_dir(v), name) for v, name in CASES]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _LOADER, REPO, json.dumps(cases), out], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    with open(out + ".json") as f:
        report = json.load(f)
    tensors = torch.load(out + ".pt", weights_only=True)
    return ({(v, name): report[f"{make_fixtures.fixture_dir(v)}/{name}"] for v, name in CASES},
            {(v, name, kind): tensors[f"{make_fixtures.fixture_dir(v)}/{name}/{kind}"]
             for v, name in CASES for kind in ("pt2", "pt2_batch1", "onnx", "onnx_batch1", "onnx_current_bodies")
             if f"{make_fixtures.fixture_dir(v)}/{name}/{kind}" in tensors})


def _expected(version, name, batch1=False):
    data = torch.load(os.path.join(make_fixtures.fixture_dir(version), "data.pt"), weights_only=True)[name]
    return [y[:1] for y in data["outputs"]] if batch1 else data["outputs"]


def test_every_fixture_version_is_pinned():
    """Fixture directories on disk == pinned versions, each complete; the current version has fixtures."""
    on_disk = sorted(int(d[len("schema_v"):]) for d in os.listdir(FIXTURES) if d.startswith("schema_v"))
    assert on_disk == sorted(PINNED), "pin the graphs of every fixture version in PINNED"
    assert kda_ops.SCHEMA_VERSION in PINNED, f"schema version {kda_ops.SCHEMA_VERSION} has no fixtures"
    for v in on_disk:
        files = sorted(os.listdir(make_fixtures.fixture_dir(v)))
        assert files == sorted(make_fixtures.FILES), files
        with open(os.path.join(make_fixtures.fixture_dir(v), "manifest.json")) as f:
            manifest = json.load(f)
        assert (manifest["schema_version"], manifest["onnx_domain_version"]) == (v, v)
        size = sum(os.path.getsize(os.path.join(make_fixtures.fixture_dir(v), f)) for f in files)
        assert size < 200_000, f"schema_v{v} fixtures take {size} bytes"


@pytest.mark.parametrize("version,name", CASES, ids=IDS)
def test_pt2_graph_contains_only_stable_ops(loaded, version, name):
    r = loaded[0][(version, name)]
    assert "pt2_error" not in r, f"{POLICY}\n{r.get('pt2_error')}"
    assert set(r["pt2_targets"]) <= STABLE_TARGETS, r["pt2_targets"]
    assert r["pt2_targets"] == PINNED[version][name]["pt2"]


@pytest.mark.parametrize("version,name", CASES, ids=IDS)
def test_pt2_reproduces_stored_outputs(loaded, version, name):
    r, tensors = loaded
    assert "pt2_error" not in r[(version, name)], f"{POLICY}\n{r[(version, name)].get('pt2_error')}"
    torch.testing.assert_close(tensors[(version, name, "pt2")], _expected(version, name), **PT2_TOL)
    torch.testing.assert_close(tensors[(version, name, "pt2_batch1")], _expected(version, name, True), **PT2_TOL)


@pytest.mark.parametrize("version,name", CASES, ids=IDS)
def test_onnx_graph_imports_the_versioned_domain(loaded, version, name):
    r = loaded[0][(version, name)]
    assert "onnx_error" not in r, r.get("onnx_error")
    pin = PINNED[version][name]
    assert r["onnx_domains"] == pin["onnx_domains"]
    assert r["onnx_nodes"] == pin["onnx_nodes"]
    assert r["onnx_other_domains"] == []
    assert r["onnx_functions"] == pin["onnx_functions"]


@pytest.mark.parametrize("version,name", CASES, ids=IDS)
def test_onnx_reproduces_stored_outputs(loaded, version, name):
    """onnxruntime (CPU) runs the kda_ops nodes through the function bodies stored in the file, and through
    the bodies the current code writes for that domain version."""
    r, tensors = loaded
    assert "onnx_error" not in r[(version, name)], r[(version, name)].get("onnx_error")
    want = _expected(version, name)
    torch.testing.assert_close(tensors[(version, name, "onnx")], want, **ONNX_TOL)
    torch.testing.assert_close(tensors[(version, name, "onnx_batch1")], _expected(version, name, True), **ONNX_TOL)
    torch.testing.assert_close(tensors[(version, name, "onnx_current_bodies")], want, **ONNX_TOL)
    assert r[(version, name)]["onnx_current_bodies_domains"] == PINNED[version][name]["onnx_domains"], POLICY


def _pinned(actual: str, expect: str, skip: int = 0):
    try:
        assert_expected_inline(actual, expect, skip=skip + 1)
    except AssertionError as e:
        raise AssertionError(f"{POLICY}\n{e}") from None


def test_op_schemas_are_pinned():
    assert kda_ops.SCHEMA_VERSION == 1
    _pinned(str(torch.ops.kda_ops.chunk_kda_v1.default._schema), """\
kda_ops::chunk_kda_v1(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, \
Tensor? initial_state, Tensor? cu_seqlens, float scale, float? lower_bound, bool use_qk_l2norm, bool use_gate, \
bool use_beta_sigmoid, bool allow_neg_eigval, bool output_final_state) -> (Tensor, Tensor)""")
    _pinned(str(torch.ops.kda_ops.recurrent_kda_v1.default._schema), """\
kda_ops::recurrent_kda_v1(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, \
Tensor initial_state, Tensor? cu_seqlens, float scale, float? lower_bound, bool use_qk_l2norm, bool use_gate, \
bool use_beta_sigmoid, bool allow_neg_eigval) -> (Tensor, Tensor)""")
    # Each stable op has exactly one overload: a new signature is a new op (``*_v2``), not an overload.
    for op in (torch.ops.kda_ops.chunk_kda_v1, torch.ops.kda_ops.recurrent_kda_v1):
        assert op.overloads() == ["default"], op.overloads()


def _onnx_schema_text(name: str, version: int) -> str:
    import onnx.defs
    s = onnx.defs.get_schema(name, version, kda_ops.onnx.DOMAIN)
    param = lambda p: f"{p.name}: {p.type_str}{'?' if 'Optional' in str(p.option) else ''}"  # noqa: E731
    types = "; ".join(f"{c.type_param_str} in {sorted(c.allowed_type_strs)}" for c in s.type_constraints)
    attrs = ", ".join(f"{a.name}: {a.type.name}" for a in sorted(s.attributes.values(), key=lambda a: a.name))
    return (f"{s.domain}::{s.name} v{s.since_version} ({', '.join(param(p) for p in s.inputs)}) -> "
            f"({', '.join(param(p) for p in s.outputs)}) attrs [{attrs}] types [{types}]")


def test_onnx_domain_and_node_signatures_are_pinned():
    assert (kda_ops.onnx.DOMAIN, kda_ops.onnx.VERSION) == ("kda_ops", 1), POLICY
    _pinned(repr(kda_ops.onnx.OP_NAMES), """{'chunk_kda_v1': 'ChunkKDA', 'recurrent_kda_v1': 'RecurrentKDA'}""")
    _pinned("\n".join(_onnx_schema_text(n, 1) for n in ("ChunkKDA", "RecurrentKDA")), """\
kda_ops::ChunkKDA v1 (q: T, k: T, v: T, g: T, beta: T, A_log: S, dt_bias: S, initial_state: S) -> (o: T, \
final_state: S) attrs [allow_neg_eigval: INT, lower_bound: FLOAT, scale: FLOAT, use_beta_sigmoid: INT, \
use_gate: INT, use_qk_l2norm: INT] types [T in ['tensor(bfloat16)', 'tensor(float)', 'tensor(float16)']; \
S in ['tensor(float)']]
kda_ops::RecurrentKDA v1 (q: T, k: T, v: T, g: T, beta: T, A_log: S, dt_bias: S, initial_state: S) -> (o: T, \
final_state: S) attrs [allow_neg_eigval: INT, lower_bound: FLOAT, scale: FLOAT, use_beta_sigmoid: INT, \
use_gate: INT, use_qk_l2norm: INT] types [T in ['tensor(bfloat16)', 'tensor(float)', 'tensor(float16)']; \
S in ['tensor(float)']]""")
    # The function bodies the current code writes have the same signatures as the schemas.
    sigs = {f.name: (list(f.input), list(f.output), sorted(f.attribute))
            for f in kda_ops.onnx.function_protos(18) if f.name in ("ChunkKDA", "RecurrentKDA")}
    _pinned(repr(sigs), """\
{'ChunkKDA': (['q', 'k', 'v', 'g', 'beta', 'A_log', 'dt_bias', 'initial_state'], ['o', 'final_state'], \
['allow_neg_eigval', 'lower_bound', 'scale', 'use_beta_sigmoid', 'use_gate', 'use_qk_l2norm']), \
'RecurrentKDA': (['q', 'k', 'v', 'g', 'beta', 'A_log', 'dt_bias', 'initial_state'], ['o', 'final_state'], \
['allow_neg_eigval', 'lower_bound', 'scale', 'use_beta_sigmoid', 'use_gate', 'use_qk_l2norm'])}""")


def _kda_targets(ep) -> dict:
    return dict(collections.Counter(str(n.target) for n in ep.graph.nodes
                                    if n.op == "call_function" and str(n.target).startswith("kda_ops.")))


def test_export_with_grad_emits_only_stable_ops():
    """Exporting a model whose parameters require grad (training mode, grad enabled) gives the same stable
    ops as the fixtures, never the private training ops."""
    from kda_ops.layers import KDAConfig, KDALanguageModel
    assert torch.is_grad_enabled()
    for name, (module, args, dynamic_shapes) in make_fixtures.cases().items():
        assert module.training and all(p.requires_grad for p in module.parameters())
        ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
        assert _kda_targets(ep) == PINNED[kda_ops.SCHEMA_VERSION][name]["pt2"], _kda_targets(ep)
    torch.manual_seed(0)
    model = KDALanguageModel(KDAConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=1, num_v_heads=2,
                                       head_dim=4)).train()
    ids = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(0))
    assert_expected_inline(repr(_kda_targets(torch.export.export(model, (ids,)))),
                           """{'kda_ops.chunk_kda_v1.default': 1}""")


def _onnx_kda_nodes(proto) -> tuple:
    return ({o.domain: o.version for o in proto.opset_import if o.domain},
            dict(collections.Counter(n.op_type for n in proto.graph.node if n.domain == kda_ops.onnx.DOMAIN)),
            sorted(f"{f.domain}::{f.name}" for f in proto.functions))


def test_onnx_export_emits_the_versioned_nodes():
    """The current ONNX export (function mode) of the fixture modules, parameters requiring grad, writes the
    domain version, node types and functions of the current version's fixtures."""
    pins = PINNED[kda_ops.SCHEMA_VERSION]
    for name, (module, args, dynamic_shapes) in make_fixtures.cases().items():
        proto = kda_ops.onnx.export(module, args, mode="function", dynamic_shapes=dynamic_shapes)
        pin = pins[name]
        assert _onnx_kda_nodes(proto) == (pin["onnx_domains"], pin["onnx_nodes"], pin["onnx_functions"]), POLICY
