"""Run an artifact: load it as ``fn(*tensors) -> list[Tensor]``, greedy generation, the fresh-process runner.

Artifacts are told apart by name: ``*.onnx`` (onnxruntime), ``*.aoti.pt2`` (AOTInductor package),
other ``*.pt2`` (torch.export program; needs ``kda_ops`` imported for its custom-op nodes).

``python -m export.runtime ARTIFACT INPUTS.pt OUTPUTS.pt [--device D]`` (``kda_ops_export.runtime`` when
installed) loads ARTIFACT in this (fresh) process, runs it on each input list of
``torch.load(INPUTS.pt)["cases"]`` and saves ``{"cases": [{"outputs": [...], "seconds": t, "backend": b}, ...]}``
(t: median of a few runs after warm-up; b: what ran it, e.g. onnxruntime's execution provider).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Sequence

import torch

Runner = Callable[..., list]


def load(path: str, device: str = "cpu") -> Runner:
    """Loads an artifact written by export.artifacts as a callable on torch tensors (inference: no grad)."""
    fn = _load(str(path), device)
    return torch.no_grad()(fn)


def _backend(fn: Runner, path: str, device: str) -> str:
    return getattr(fn, "backend", None) or f"torch on {device}"


def _load(path: str, device: str) -> Runner:
    if path.endswith(".onnx"):
        return _load_onnx(path, device)
    # Both .pt2 kinds call kda_ops ops: a program holds kda_ops::* nodes, and an AOTInductor package built
    # on CPU calls the opaque torch implementation (kda_ops::*_torch) through the Python op registry.
    import kda_ops  # noqa: F401
    if path.endswith(".aoti.pt2"):
        compiled = torch._inductor.aoti_load_package(path)
        return lambda *xs: list(compiled(*xs))
    module = torch.export.load(path).module()
    return lambda *xs: list(module(*xs))


def _load_onnx(path: str, device: str) -> Runner:
    import kda_ops
    ort = kda_ops.require("onnxruntime", "running an ONNX artifact")
    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    sess = ort.InferenceSession(path, providers=providers)
    names = [i.name for i in sess.get_inputs()]

    def run(*xs):
        # through numpy: fp32/fp16 models (the command line refuses ONNX with bf16, which numpy lacks)
        feed = {n: x.detach().cpu().numpy() for n, x in zip(names, xs)}
        return [torch.from_numpy(y) for y in sess.run(None, feed)]
    run.backend = sess.get_providers()[0]
    return run


@torch.no_grad()
def greedy_generate(prefill: Runner, step: Runner, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding through flat graphs: ``prefill(ids) -> [logits, *cache]``,
    ``step(ids[B, 1], *cache) -> [logits, *cache]``. Returns [B, T + max_new_tokens]."""
    out = [input_ids]
    logits, *cache = prefill(input_ids)
    for i in range(max_new_tokens):
        tok = logits[:, -1].argmax(-1, keepdim=True).to(input_ids.device)
        out.append(tok)
        if i + 1 < max_new_tokens:
            logits, *cache = step(tok, *cache)
    return torch.cat(out, dim=1)


def timed_run(fn: Runner, inputs: Sequence[torch.Tensor], device: str, repeats: int = 5):
    """(outputs, median seconds of ``repeats`` runs after two warm-ups: a loaded program's first calls are slow)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    outputs = fn(*inputs)
    fn(*inputs)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn(*inputs)
        sync()
        times.append(time.perf_counter() - t0)
    return outputs, statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}.runtime", description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("inputs")
    p.add_argument("outputs")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    raw = _load(args.artifact, args.device)
    fn, backend = torch.no_grad()(raw), _backend(raw, args.artifact, args.device)
    results = []
    for inputs in torch.load(args.inputs)["cases"]:
        outputs, seconds = timed_run(fn, [x.to(args.device) for x in inputs], args.device)
        results.append({"outputs": [y.detach().cpu() for y in outputs], "seconds": seconds, "backend": backend})
    torch.save({"cases": results}, args.outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
