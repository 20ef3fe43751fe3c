"""The graphs of a language model that kda-export ships, and one writer per artifact format.

A model is anything with the protocol of ``kda_ops.layers.KDALanguageModel``:
``prefill(input_ids [B, T]) -> (logits, cache)`` and ``step(input_ids [B, 1], cache) -> (logits, cache)``,
the cache a flat tuple of tensors whose dim 0 is the batch. Its two graphs take and return flat tensors:

    prefill(input_ids [B, T])             -> (logits [B, T, vocab], *cache)     B, T dynamic
    decode(input_ids [B, 1], *cache)      -> (logits [B, 1, vocab], *cache)     B dynamic

Writers (``WRITERS[format](programs, out_dir) -> [Path]``):

    pt2         prefill.pt2, decode.pt2         torch.export programs holding kda_ops::* nodes
    aoti        prefill.aoti.pt2                AOTInductor package of the prefill graph
    onnx        prefill.onnx, decode.onnx       kda_ops custom-domain nodes + function bodies
    onnx-la     prefill.la.onnx, decode.la.onnx        opset-27 LinearAttention
    onnx-la-ms  prefill.la-ms.onnx, decode.la-ms.onnx  com.microsoft.LinearAttention (onnxruntime)
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from .names import DEFAULT_FORMATS, FILES, ONNX_FORMATS, all_file_names  # noqa: F401

GRAPHS = ("prefill", "decode")


class PrefillGraph(nn.Module):
    """input_ids [B, T] -> (logits, *cache)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor):
        logits, cache = self.model.prefill(input_ids)
        return (logits, *cache)


class DecodeGraph(nn.Module):
    """(input_ids [B, 1], *cache) -> (logits, *new_cache)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, *cache: Tensor):
        logits, new_cache = self.model.step(input_ids, tuple(cache))
        return (logits, *new_cache)


def graph_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {"prefill": PrefillGraph(model), "decode": DecodeGraph(model)}


def _dim(name: str, max_: int, min_: int = 1) -> Optional[Dim]:
    return Dim(name, min=min_, max=max_) if max_ > min_ else None


def example_inputs(model: nn.Module, vocab_size: int, batch: int, seq: int, device, seed: int = 0
                   ) -> dict[str, tuple[Tensor, ...]]:
    """Inputs of both graphs: a random prompt [batch, seq], and a token [batch, 1] with the prompt's cache."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen).to(device)
    tok = torch.randint(0, vocab_size, (batch, 1), generator=gen).to(device)
    with torch.no_grad():
        _, cache = model.prefill(ids)
    return {"prefill": (ids,), "decode": (tok, *cache)}


def export_programs(model: nn.Module, examples: dict, batch_max: int, seq_max: int) -> dict[str, ExportedProgram]:
    """torch.export of both graphs, batch dynamic in [1, batch_max] and the prompt length in [1, seq_max]."""
    batch, seq = _dim("batch", batch_max), _dim("seq", seq_max)
    n_cache = len(examples["decode"]) - 1
    shapes = {"prefill": ({0: batch, 1: seq},), "decode": ({0: batch}, ({0: batch},) * n_cache)}  # *cache nests
    modules = graph_modules(model)
    with torch.no_grad():
        return {name: torch.export.export(modules[name], examples[name], dynamic_shapes=shapes[name])
                for name in GRAPHS}


def write_pt2(programs, out: Path) -> list[Path]:
    paths = []
    for name, ep in programs.items():
        torch.export.save(ep, out / f"{name}.pt2")
        paths.append(out / f"{name}.pt2")
    return paths


def write_aoti(programs, out: Path) -> list[Path]:
    path = out / "prefill.aoti.pt2"
    torch._inductor.aoti_compile_and_package(programs["prefill"], package_path=str(path))
    return [path]


def _onnx_writer(mode: str, suffix: str) -> Callable[[dict, Path], list[Path]]:
    def write(programs, out: Path) -> list[Path]:
        import kda_ops.onnx
        paths = []
        for name, ep in programs.items():
            n_cache = len(ep.graph_signature.user_inputs) - 1 if name == "decode" else 0
            n_out = len(ep.graph_signature.user_outputs) - 1
            path = out / f"{name}{suffix}.onnx"
            kda_ops.onnx.export(
                ep, (), path, mode=mode,
                input_names=["input_ids"] + [f"cache_{i}" for i in range(n_cache)],
                output_names=["logits"] + [f"new_cache_{i}" for i in range(n_out)])
            paths.append(path)
        return paths
    return write


WRITERS: dict[str, Callable[[dict, Path], list[Path]]] = {
    "pt2": write_pt2,
    "aoti": write_aoti,
    "onnx": _onnx_writer("function", ""),
    "onnx-la": _onnx_writer("linear_attention", ".la"),
    "onnx-la-ms": _onnx_writer("ms_linear_attention", ".la-ms"),
}
def graph_of(path: Path) -> str:
    """'prefill' or 'decode', from an artifact's file name."""
    return path.name.split(".")[0]


assert set(WRITERS) == set(FILES), "every writer lists its files in export/names.py"
