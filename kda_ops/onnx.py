"""ONNX translation of the kda_ops ops for ``torch.onnx.export(..., dynamo=True)``.

Two modes (``mode=``):

``"function"`` (default): each KDA op becomes ONE opaque node in the custom domain ``kda_ops``

    torch.ops.kda_ops.chunk_kda_v1      ->  kda_ops::ChunkKDA      (domain kda_ops, version 1)
    torch.ops.kda_ops.recurrent_kda_v1  ->  kda_ops::RecurrentKDA

    inputs   q [B, T, H, K], k [B, T, H, K], v [B, T, HV, V], g [B, T, HV, K], beta [B, T, HV],
             A_log [HV] f32, dt_bias [HV * K] f32, initial_state [B, HV, K, V] f32
    outputs  o [B, T, HV, V] (dtype of v), final_state [B, HV, K, V] f32
    attrs    scale: float, lower_bound: float (0.0 = no safe gate), use_qk_l2norm, use_gate,
             use_beta_sigmoid, allow_neg_eigval: int (0/1)

  Absent optional torch inputs become constants (A_log = 0, i.e. a gate scale of 1; dt_bias = 0;
  initial_state = 0), so the node has a fixed signature. :func:`add_functions` appends to the model a
  model-local ``FunctionProto`` of the same domain/name whose body is standard ONNX: the in-op
  pre-processing (l2norm, gate, sigmoid; written once, in the helper function ``kda_ops::KDAPrepare``),
  the grouped-value expansion of q/k, and a ``Scan`` over time carrying the fp32 state. Any ONNX
  runtime runs the model by inlining the body; a runtime with a native ``kda_ops`` kernel registered
  (an onnxruntime custom-op library, say) runs the kernel instead.

``"linear_attention"`` / ``"ms_linear_attention"``: the recurrence becomes the opset-27 standard
``LinearAttention`` (``update_rule="gated_delta"``, per-key decay ``[B, T, HV * K]``), or onnxruntime's
``com.microsoft.LinearAttention``. Both apply ``S <- exp(g) S + beta k (v - exp(g) S^T k)^T`` and read
``o = scale S^T q``, which is KDA exactly once q, k, g, beta are pre-processed. The mapping:

    KDA                                      LinearAttention
    l2norm / gate / sigmoid in the op   ->   standard ops before the node (KDAPrepare, inlined)
    H q/k heads, HV value heads (GVA)   ->   q, k repeated to HV heads; q_num_heads = kv_num_heads = HV
    g [B, T, HV, K] (log decay)         ->   decay [B, T, HV * K]
    q, k [B, T, HV, K], v [B, T, HV, V] ->   [B, T, HV * K], [B, T, HV * K], [B, T, HV * V]
    initial_state / final_state         ->   past_state / present_state [B, HV, K, V]
    scale                               ->   scale (explicit, never the 0.0 "default" value)

  What falls back: nothing within an exported LM (every flag combination maps). Packed variable-length
  input (``cu_seqlens``) has no ONNX form in either mode: export raises, export a padded batch instead.
  The standard op needs the model at opset 27 (torch exports at 18; the onnx converter lifts it). On
  onnxruntime 1.32 CPU, ``com.microsoft.LinearAttention`` runs natively and the opset-27 op through its
  ONNX function body (it ran here with dynamic batch and length).

Public helpers: :func:`custom_translation_table` (to call ``torch.onnx.export`` yourself, then
:func:`finalize`), :func:`export` (both in one call). Models must use fp32 state (the op's contract).

Example::

    >>> import torch, kda_ops.onnx
    >>> model_proto = kda_ops.onnx.export(model, (input_ids,), "model.onnx",
    ...     dynamic_shapes=({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},))
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import onnx
import onnx.defs
import onnx.inliner
import onnx.parser
import onnxscript
import onnxscript.values
import torch
from onnxscript import opset18 as op

from . import ops  # noqa: F401  (registers torch.ops.kda_ops.*)

DOMAIN = "kda_ops"
VERSION = 1
MODES = ("function", "linear_attention", "ms_linear_attention")
LINEAR_ATTENTION_OPSET = 27
_LA_PLACEHOLDER = "kda_ops.linear_attention"      # private domain renamed by finalize()
_LA_DOMAIN = {"linear_attention": "", "ms_linear_attention": "com.microsoft"}
_FLAGS = ("use_qk_l2norm", "use_gate", "use_beta_sigmoid", "allow_neg_eigval")

# torch op -> ONNX op name in DOMAIN
OP_NAMES = {"chunk_kda_v1": "ChunkKDA", "recurrent_kda_v1": "RecurrentKDA"}
PREPARE = "KDAPrepare"


# ----------------------------------------------------------------------------------------------
# Function bodies (standard ONNX, textual syntax). Compute in fp32 whatever the input dtype.
# ----------------------------------------------------------------------------------------------
_PREPARE_BODY = """
<domain: "kda_ops", opset_import: ["" : {opset}]>
KDAPrepare <lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval>
    (q, k, g, beta, A_log, dt_bias) => (qh, kh, gh, bh)
{{
    zero = Constant <value_float = 0.0> ()
    one = Constant <value_float = 1.0> ()
    eps = Constant <value_float = 1e-6> ()
    last = Constant <value_ints = [-1]> ()
    ax3 = Constant <value_ints = [3]> ()
    qf = Cast <to = 1> (q)
    kf = Cast <to = 1> (k)
    gf = Cast <to = 1> (g)
    bf = Cast <to = 1> (beta)
    # q, k <- x / sqrt(sum(x^2) + 1e-6) along K (reference.L2NORM_EPS)
    l2_i = Constant <value_int: int = @use_qk_l2norm> ()
    l2 = Cast <to = 9> (l2_i)
    q_ss = ReduceSumSquare <keepdims = 1> (qf, last)
    q_eps = Add (q_ss, eps)
    q_nrm = Sqrt (q_eps)
    q_l2 = Div (qf, q_nrm)
    q1 = Where (l2, q_l2, qf)
    k_ss = ReduceSumSquare <keepdims = 1> (kf, last)
    k_eps = Add (k_ss, eps)
    k_nrm = Sqrt (k_eps)
    k_l2 = Div (kf, k_nrm)
    k1 = Where (l2, k_l2, kf)
    # gate: x = g + dt_bias[HV, K]; a = exp(A_log)[HV, 1]
    #   lower_bound == 0: g <- -a softplus(x);  lower_bound < 0: g <- lower_bound sigmoid(a x)
    gate_i = Constant <value_int: int = @use_gate> ()
    gate = Cast <to = 9> (gate_i)
    lb = Constant <value_float: float = @lower_bound> ()
    safe = Less (lb, zero)
    hv_k = Shape <start = 2> (g)
    bias = Reshape (dt_bias, hv_k)
    x = Add (gf, bias)
    a_exp = Exp (A_log)
    a = Unsqueeze (a_exp, last)
    sp = Softplus (x)
    a_sp = Mul (a, sp)
    g_soft = Neg (a_sp)
    ax = Mul (a, x)
    sg = Sigmoid (ax)
    g_safe = Mul (lb, sg)
    g_gate = Where (safe, g_safe, g_soft)
    gh = Where (gate, g_gate, gf)
    # beta <- sigmoid(beta), times 2 with allow_neg_eigval
    bs_i = Constant <value_int: int = @use_beta_sigmoid> ()
    bs = Cast <to = 9> (bs_i)
    neg_i = Constant <value_int: int = @allow_neg_eigval> ()
    neg = Cast <to = 1> (neg_i)
    factor = Add (one, neg)
    b_sig = Sigmoid (bf)
    b_act = Mul (b_sig, factor)
    bh = Where (bs, b_act, bf)
    # grouped values: repeat each q/k head G = HV / H times -> [B, T, HV, K]
    bth = Shape <end = 3> (q)
    bt = Shape <end = 2> (q)
    h = Shape <start = 2, end = 3> (q)
    kd = Shape <start = 3> (q)
    hv = Shape <start = 2, end = 3> (g)
    grp = Div (hv, h)
    exp_shape = Concat <axis = 0> (bth, grp, kd)
    rep_shape = Concat <axis = 0> (bt, hv, kd)
    q_u = Unsqueeze (q1, ax3)
    q_e = Expand (q_u, exp_shape)
    qh = Reshape (q_e, rep_shape)
    k_u = Unsqueeze (k1, ax3)
    k_e = Expand (k_u, exp_shape)
    kh = Reshape (k_e, rep_shape)
}}
"""

# One body for both ops: KDAPrepare, then a Scan over time (axis 1) carrying S [B, HV, K, V].
_KDA_BODY = """
<domain: "kda_ops", opset_import: ["" : {opset}, "kda_ops" : 1]>
{name} <scale, lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval>
    (q, k, v, g, beta, A_log, dt_bias, initial_state) => (o, final_state)
{{
    qh, kh, gh, bh = kda_ops.KDAPrepare <lower_bound: float = @lower_bound,
        use_qk_l2norm: int = @use_qk_l2norm, use_gate: int = @use_gate,
        use_beta_sigmoid: int = @use_beta_sigmoid, allow_neg_eigval: int = @allow_neg_eigval>
        (q, k, g, beta, A_log, dt_bias)
    sc = Constant <value_float: float = @scale> ()
    qs = Mul (qh, sc)
    eg = Exp (gh)
    vf = Cast <to = 1> (v)
    h0 = Cast <to = 1> (initial_state)
    m1 = Constant <value_ints = [-1]> ()
    m2 = Constant <value_ints = [-2]> ()
    final_state, o_f = Scan <num_scan_inputs = 5, scan_input_axes = [1, 1, 1, 1, 1], scan_output_axes = [1],
        body = kda_step (float[B, HV, K, V] s, float[B, HV, K] q_t, float[B, HV, K] k_t,
                         float[B, HV, V] v_t, float[B, HV, K] eg_t, float[B, HV] b_t)
                     => (float[B, HV, K, V] s_new, float[B, HV, V] o_t)
        {{
            eg_c = Unsqueeze (eg_t, m1)
            s_dec = Mul (s, eg_c)             # S' = diag(exp(g)) S
            k_r = Unsqueeze (k_t, m2)
            ks = MatMul (k_r, s_dec)          # [B, HV, 1, K] @ [B, HV, K, V] -> [B, HV, 1, V]
            v_r = Unsqueeze (v_t, m2)
            vn = Sub (v_r, ks)                # v - S'^T k
            b_c = Unsqueeze (b_t, m1)
            kb = Mul (k_t, b_c)
            kb_c = Unsqueeze (kb, m1)
            upd = MatMul (kb_c, vn)           # [B, HV, K, 1] @ [B, HV, 1, V] -> [B, HV, K, V]
            s_new = Add (s_dec, upd)
            q_r = Unsqueeze (q_t, m2)
            o_r = MatMul (q_r, s_new)         # read the updated state
            o_t = Squeeze (o_r, m2)
        }}> (h0, qs, kh, vf, eg, bh)
    o = CastLike (o_f, v)
}}
"""


def function_protos(opset: int) -> list[onnx.FunctionProto]:
    """The model-local functions of the ``kda_ops`` domain, importing standard ONNX at ``opset``."""
    protos = [onnx.parser.parse_function(_PREPARE_BODY.format(opset=opset))]
    protos += [onnx.parser.parse_function(_KDA_BODY.format(opset=opset, name=name))
               for name in OP_NAMES.values()]
    return protos


# ----------------------------------------------------------------------------------------------
# Schemas: onnxscript needs one to emit a custom-domain node; the checker uses them too.
# ----------------------------------------------------------------------------------------------
_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def _schema(name, domain, inputs, outputs, attributes, doc=""):
    P, A = onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.Attribute
    opt = onnx.defs.OpSchema.FormalParameterOption.Optional

    def param(spec):
        pname, ptype, *optional = spec
        return P(pname, ptype, "", param_option=opt) if optional else P(pname, ptype, "")
    return onnx.defs.OpSchema(
        name, domain, VERSION, doc,
        inputs=[param(s) for s in inputs], outputs=[param(s) for s in outputs],
        type_constraints=[("T", _FLOAT_TYPES, "activations"), ("S", ["tensor(float)"], "state, gate params")],
        attributes=[a if isinstance(a, A) else A(a[0], a[1], "") for a in attributes])


def _register_schemas() -> None:
    AT = onnx.defs.OpSchema.AttrType
    flags = [(f, AT.INT) for f in _FLAGS]
    kda_in = [("q", "T"), ("k", "T"), ("v", "T"), ("g", "T"), ("beta", "T"),
              ("A_log", "S"), ("dt_bias", "S"), ("initial_state", "S")]
    schemas = [_schema(n, DOMAIN, kda_in, [("o", "T"), ("final_state", "S")],
                       [("scale", AT.FLOAT), ("lower_bound", AT.FLOAT)] + flags,
                       doc="Kimi Delta Attention (see kda_ops/onnx.py)") for n in OP_NAMES.values()]
    schemas.append(_schema(
        PREPARE, DOMAIN, [("q", "T"), ("k", "T"), ("g", "T"), ("beta", "T"), ("A_log", "S"), ("dt_bias", "S")],
        [("qh", "S"), ("kh", "S"), ("gh", "S"), ("bh", "S")], [("lower_bound", AT.FLOAT)] + flags))
    schemas.append(_schema(
        "LinearAttention", _LA_PLACEHOLDER,
        [("query", "T"), ("key", "T"), ("value", "T"), ("past_state", "S", 1), ("decay", "T", 1),
         ("beta", "T", 1)], [("output", "T"), ("present_state", "S")],
        [("q_num_heads", AT.INT), ("kv_num_heads", AT.INT), ("scale", AT.FLOAT), ("update_rule", AT.STRING)]))
    for s in schemas:
        if not onnx.defs.has(s.name, s.domain):
            onnx.defs.register_schema(s)


_register_schemas()
_kda = onnxscript.values.Opset(DOMAIN, VERSION)
_la = onnxscript.values.Opset(_LA_PLACEHOLDER, VERSION)


# ----------------------------------------------------------------------------------------------
# Translations (called by the exporter with the torch op's arguments, tensors as symbolic values).
# ----------------------------------------------------------------------------------------------
def _node_inputs(q, v, A_log, dt_bias, initial_state, cu_seqlens):
    """Fills absent optional inputs with their neutral constants (the node has a fixed signature)."""
    if cu_seqlens is not None:
        raise NotImplementedError(
            "kda_ops ONNX export: packed variable-length input (cu_seqlens) has no ONNX form; "
            "export the model on a padded batch (cu_seqlens=None)")
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    for name, d in (("H", H), ("K", K), ("HV", HV), ("V", V)):
        if not isinstance(d, int):
            raise ValueError(f"kda_ops ONNX export: head count/size {name} must be static, got {d}")
    if A_log is None:   # zero log scale: gate scale exp(0) = 1 (A_log=None is only allowed with lower_bound)
        A_log = op.ConstantOfShape(op.Constant(value_ints=[HV]))
    if dt_bias is None:
        dt_bias = op.ConstantOfShape(op.Constant(value_ints=[HV * K]))
    if initial_state is None:
        batch = op.Shape(q, start=0, end=1)
        initial_state = op.ConstantOfShape(op.Concat(batch, op.Constant(value_ints=[HV, K, V]), axis=0))
    return A_log, dt_bias, initial_state, (H, K, HV, V)


def _flag_attrs(lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval):
    return dict(lower_bound=0.0 if lower_bound is None else float(lower_bound),
                use_qk_l2norm=int(use_qk_l2norm), use_gate=int(use_gate),
                use_beta_sigmoid=int(use_beta_sigmoid), allow_neg_eigval=int(allow_neg_eigval))


def _function_translation(onnx_name: str):
    def translate(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                  use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, output_final_state=True):
        A_log, dt_bias, h0, _ = _node_inputs(q, v, A_log, dt_bias, initial_state, cu_seqlens)
        node = getattr(_kda, onnx_name)
        return node(q, k, v, g, beta, A_log, dt_bias, h0, scale=float(scale),
                    **_flag_attrs(lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval))
    translate.__name__ = f"kda_ops_{onnx_name}"
    return translate


def _linear_attention_translation(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale,
                                  lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid,
                                  allow_neg_eigval, output_final_state=True):
    A_log, dt_bias, h0, (H, K, HV, V) = _node_inputs(q, v, A_log, dt_bias, initial_state, cu_seqlens)
    qh, kh, gh, bh = _kda.KDAPrepare(
        q, k, g, beta, A_log, dt_bias,
        **_flag_attrs(lower_bound, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval))
    packed = lambda x, d: op.Reshape(x, op.Constant(value_ints=[0, 0, HV * d]))  # noqa: E731
    vf = op.Cast(v, to=onnx.TensorProto.FLOAT)
    o, ht = _la.LinearAttention(
        packed(qh, K), packed(kh, K), packed(vf, V), op.Cast(h0, to=onnx.TensorProto.FLOAT),
        packed(gh, K), bh, q_num_heads=HV, kv_num_heads=HV, scale=float(scale), update_rule="gated_delta")
    o = op.Reshape(o, op.Constant(value_ints=[0, 0, HV, V]))
    return op.CastLike(o, v), ht


def custom_translation_table(mode: str = "function") -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``; follow with :func:`finalize`."""
    if mode not in MODES:
        raise ValueError(f"unknown kda_ops ONNX mode {mode!r}; choose one of {MODES}")
    table = {}
    for name, onnx_name in OP_NAMES.items():
        translate = _function_translation(onnx_name) if mode == "function" else _linear_attention_translation
        table[getattr(torch.ops.kda_ops, name).default] = translate
    return table


# ----------------------------------------------------------------------------------------------
# Post-processing of the exported ModelProto.
# ----------------------------------------------------------------------------------------------
def _opset(model: onnx.ModelProto, domain: str) -> Optional[int]:
    return next((o.version for o in model.opset_import if o.domain == domain), None)


def _set_opset(model: onnx.ModelProto, domain: str, version: Optional[int]) -> None:
    keep = [o for o in model.opset_import if o.domain != domain]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    if version is not None:
        model.opset_import.append(onnx.helper.make_opsetid(domain, version))


def add_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Appends the FunctionProtos (bodies of standard ONNX) of the ``kda_ops`` ops the graph uses, in place."""
    used = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    if used:
        used.add(PREPARE)
        have = {(f.domain, f.name) for f in model.functions}
        model.functions.extend(f for f in function_protos(_opset(model, ""))
                               if f.name in used and (f.domain, f.name) not in have)
        _set_opset(model, DOMAIN, VERSION)
    return model


def finalize(model: onnx.ModelProto, mode: str = "function") -> onnx.ModelProto:
    """Completes a model exported with :func:`custom_translation_table` (in place; returns it).

    ``function``: appends the function bodies. LinearAttention modes: moves the placeholder nodes into
    their real domain and inlines KDAPrepare, leaving only standard ops around the LinearAttention node.
    """
    if mode not in MODES:
        raise ValueError(f"unknown kda_ops ONNX mode {mode!r}; choose one of {MODES}")
    add_functions(model)
    if mode == "function":
        return model
    domain = _LA_DOMAIN[mode]
    if domain == "" and _opset(model, "") < LINEAR_ATTENTION_OPSET:
        raise ValueError(f"mode {mode!r} needs the model at opset >= {LINEAR_ATTENTION_OPSET}, "
                         f"got {_opset(model, '')} (pass opset_version={LINEAR_ATTENTION_OPSET})")
    for node in model.graph.node:
        if node.domain == _LA_PLACEHOLDER:
            node.domain = domain
    _set_opset(model, _LA_PLACEHOLDER, None)
    if domain:
        _set_opset(model, domain, 1)
    model = onnx.inliner.inline_selected_functions(model, [(DOMAIN, PREPARE)])
    del model.functions[:]              # KDAPrepare, now inlined: no kda_ops node is left
    _set_opset(model, DOMAIN, None)
    return model


def export(model, args: tuple, path: Optional[str | os.PathLike] = None, *, kwargs: Optional[dict] = None,
           dynamic_shapes=None, mode: str = "function", input_names: Optional[Sequence[str]] = None,
           output_names: Optional[Sequence[str]] = None, opset_version: Optional[int] = None
           ) -> onnx.ModelProto:
    """``torch.onnx.export(dynamo=True)`` with the kda_ops translations and function bodies.

    ``model`` is an ``nn.Module`` or a ``torch.export.ExportedProgram``. Returns the ModelProto and,
    given ``path``, saves it there (weights inline below 1 GiB, else as external data next to it).
    """
    table = custom_translation_table(mode)
    if mode == "linear_attention":
        opset_version = max(opset_version or 0, LINEAR_ATTENTION_OPSET)
    program = torch.onnx.export(
        model, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes, custom_translation_table=table,
        input_names=input_names, output_names=output_names, opset_version=opset_version, dynamo=True,
        verbose=False)
    proto = finalize(program.model_proto, mode)
    if path is not None:
        large = proto.ByteSize() > (1 << 30)
        onnx.save_model(proto, os.fspath(path), save_as_external_data=large,
                        location=os.path.basename(os.fspath(path)) + ".data" if large else None)
    return proto
