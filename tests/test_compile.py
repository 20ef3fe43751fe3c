"""The tiny KDA language model under torch.compile(fullgraph=True): same numbers as eager, no graph break,
and one compile for every sequence length when compiled with dynamic shapes.
"""
import pytest
import torch
import torch.nn.functional as F

from kda_ops.layers import KDAConfig, KDALanguageModel

CFG = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_v_heads=4, head_dim=16)


def make_model():
    torch.manual_seed(0)
    return KDALanguageModel(KDAConfig(**CFG))


def loss_fn(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def test_no_graph_break():
    model = make_model()
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    explanation = torch._dynamo.explain(model)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    from kda_case import kda_op
    kda = [str(n.target) for g in explanation.graphs for n in g.graph.nodes
           if n.op == "call_function" and str(n.target).startswith("kda_ops.")]
    chunk_ops = {str(kda_op(name)).rsplit(".", 1)[0] for name in ("chunk_kda_v1", "_chunk_kda_fwd")}
    assert len(kda) == 1 and kda[0] in chunk_ops, kda     # the op is one node (one layer), not inlined


def test_compiled_forward_backward_equals_eager():
    torch._dynamo.reset()
    ids = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(1))
    eager, compiled = make_model(), make_model()
    loss_eager = loss_fn(eager, ids)
    loss_eager.backward()
    loss_compiled = loss_fn(torch.compile(compiled, fullgraph=True), ids)
    loss_compiled.backward()
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-4, atol=0)
    grads = dict(compiled.named_parameters())
    for name, p in eager.named_parameters():
        if any(key in name for key in ("A_log", "dt_bias", "q_proj", "f_proj.0", "conv", "embed")):
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_dynamic_sequence_length_compiles_once():
    torch._dynamo.reset()
    model = make_model()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(1)
    compiled(torch.randint(0, 64, (2, 5), generator=gen)).sum().backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (17, 33, 100):
            ids = torch.randint(0, 64, (2, T), generator=gen)
            model.zero_grad()
            out = compiled(ids)
            out.sum().backward()
            torch.testing.assert_close(out, model(ids), rtol=1e-4, atol=1e-5)
            assert model.blocks[0].attn.A_log.grad is not None


@pytest.mark.gpu
def test_compiled_bf16_training_step_cuda():
    model = make_model().cuda()
    compiled = torch.compile(model, fullgraph=True)
    ids = torch.randint(0, 64, (4, 130), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        loss = loss_fn(compiled, ids)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_compiled_backward_with_permuted_inputs():
    """Dense but permuted q/k/v (cut from [B, H, T, K] tensors) through compiled forward + backward."""
    import kda_ops
    torch._dynamo.reset()
    B, T, H, K = 2, 37, 2, 16
    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(B, H, T, K, generator=gen, requires_grad=True) for _ in range(3)]
    g = torch.randn(B, T, H, K, generator=gen, requires_grad=True)
    beta = torch.randn(B, T, H, generator=gen, requires_grad=True)
    A_log, dt_bias = torch.zeros(H, requires_grad=True), torch.zeros(H * K, requires_grad=True)

    def f(q, k, v, g, beta, A_log, dt_bias):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))          # [B, T, H, K], not contiguous
        o, _ = kda_ops.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                 use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        return (o * o).sum()

    inputs = (*leaves, g, beta, A_log, dt_bias)
    want = torch.autograd.grad(f(*inputs), inputs)
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, dynamic=True)(*inputs), inputs)
    for w, x in zip(want, got):
        torch.testing.assert_close(x, w, rtol=1e-4, atol=1e-6)


def test_autotune_size_class_adds_no_guard():
    """The GPU launchers pass kernels.common.tune_size(B * T, HV) (chunk-parallel kernels) or tune_lanes(N, HV)
    (state passes) into their autotune keys. Under torch.compile with dynamic shapes both must stay symbolic
    expressions: a Python branch on T there would guard on T and recompile for every sequence length (this runs
    on CPU: the expressions are the same)."""
    from kda_ops.kernels.common import tune_lanes, tune_size

    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    @torch.compile(backend=backend, dynamic=True, fullgraph=True)
    def f(x):
        return x * tune_size(x.shape[0] * x.shape[1], x.shape[2]) + 100 * tune_lanes(x.shape[0], x.shape[2])

    # (B, T, H), every size >= 2 (dynamo specialises sizes 0 and 1): tokens x heads below / at 2^16; sequences
    # x heads in lane classes 0 (< 8) .. 6 (>= 256)
    for (B, T, H), size, lanes in [((2, 5, 3), 0, 0), ((2, 8191, 4), 0, 1), ((2, 8192, 4), 1, 1),
                                   ((4, 5, 4), 0, 2), ((16, 4096, 4), 1, 4), ((64, 3, 4), 0, 6),
                                   ((1000, 2, 4), 0, 6)]:
        x = torch.ones(B, T, H)
        assert f(x)[0, 0, 0].item() == size + 100 * lanes, (B, T, H)
    assert len(frames) == 1


def test_chunk_kernels_autotune_per_size_class():
    """Every autotuned chunk kernel keys its configs on the size class as well as K / V and flags (a config
    timed on the first call's shape, e.g. a test's, was reused for every shape after it)."""
    from kda_ops.kernels import bwd_inter, bwd_intra, bwd_state, fwd_intra, fwd_state, fwd_wu

    for kernel in (fwd_intra.chunk_kda_fwd_kernel_intra, fwd_intra.chunk_kda_fwd_kernel_intra_rerun,
                   fwd_wu.chunk_kda_fwd_kernel_wu,
                   fwd_state.chunk_kda_fwd_kernel_state, bwd_state.chunk_kda_bwd_kernel_state,
                   bwd_inter.chunk_kda_bwd_kernel_inter, bwd_intra.chunk_kda_bwd_kernel_intra):
        assert "TUNE_SIZE" in kernel.keys, kernel.fn.__name__


def test_compile_cache_keys_see_every_kernel():
    """torch.compile keeps compiled graphs on disk (the FX graph and AOTAutograd caches, on by default) and keys a
    graph that calls a triton_op on the Triton source of the kernels torch finds in the op's body and in the
    functions it calls by name. A kernel it misses is not in the key, so a graph cached before an edit or an
    upgrade of kda_ops would run the old kernel. Each op must list exactly the kernels it launches, and every
    kernel of kda_ops.kernels must be launched by some op."""
    from kernel_inputs import kernel_objects
    from torch._library.triton import get_triton_kernels_for_op

    defined = {id(obj): name for (_, name), obj in kernel_objects().items()}
    forward = {"chunk_kda_fwd_kernel_intra", "chunk_kda_fwd_kernel_intra_rerun", "chunk_kda_fwd_kernel_wu",
               "chunk_kda_fwd_kernel_state", "zero_uncovered_kernel"}
    backward = forward | {"chunk_kda_bwd_kernel_state", "chunk_kda_bwd_kernel_inter", "chunk_kda_bwd_kernel_intra",
                          "chunk_kda_bwd_kernel_gate", "chunk_kda_bwd_kernel_qk"}
    expected = {"kda_ops::chunk_kda_v1": forward, "kda_ops::_chunk_kda_fwd": forward,
                "kda_ops::_chunk_kda_bwd": backward, "kda_ops::recurrent_kda_v1": {"recurrent_kda_fwd_kernel"}}
    for op, names in expected.items():
        found = {defined.get(id(k), repr(k)) for k in get_triton_kernels_for_op(op)}
        assert found == names, (op, sorted(found ^ names))
    assert set(defined.values()) == set().union(*expected.values()), sorted(set(defined.values()))
