"""kda_ops: Kimi Delta Attention as torch.library custom ops (Triton on CUDA, torch elsewhere).

``import kda_ops`` registers the ops and gives the functions below; the submodules ``layers``, ``testing``,
``onnx``, ``fla_compat`` and ``integrations`` load on first use (``kda_ops.layers.KDALanguageModel``).
"""
from __future__ import annotations

import importlib

from .api import chunk_kda, recurrent_kda, set_cu_seqlens_check
from .ops import SCHEMA_VERSION
from .options import KDAInputs, KDAOptions
from .reference import naive_recurrent_kda

__all__ = ["chunk_kda", "recurrent_kda", "naive_recurrent_kda", "set_cu_seqlens_check", "KDAInputs", "KDAOptions",
           "SCHEMA_VERSION"]
# The one place the version is written (pyproject.toml reads it).
__version__ = "0.1.0"

_LAZY = ("layers", "testing", "onnx", "fla_compat", "integrations")

# Optional dependencies: the extra that installs each (pyproject.toml [project.optional-dependencies]).
EXTRAS = {
    "onnx": "onnx-cpu", "onnxscript": "onnx-cpu", "onnxruntime": "onnx-cpu",
    "tqdm": "examples", "matplotlib": "examples",
    "transformers": "hf",
}


def missing_dependency_message(module: str, needed_for: str) -> str:
    """One line telling the user which extra installs ``module``."""
    top = module.split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return f"{needed_for} needs the Python package {top!r}: pip install {top}"
    hint = f"pip install 'kda_ops[{extra}]'"
    if extra == "onnx-cpu":
        hint += " (or 'kda_ops[onnx]' for onnxruntime-gpu on CUDA machines)"
    return f"{needed_for} needs {top!r}, which is not installed: {hint}"


def require(module: str, needed_for: str):
    """Imports ``module``; if it is missing, raises ImportError with one message naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != module.split(".")[0]:
            raise
        raise ModuleNotFoundError(missing_dependency_message(module, needed_for), name=e.name) from None


def __getattr__(name: str):
    if name in _LAZY:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name == f"{__name__}.{name}":          # a submodule this install does not have
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
            top = (e.name or "").split(".")[0]
            if top in EXTRAS:
                raise ModuleNotFoundError(missing_dependency_message(top, f"kda_ops.{name}"), name=e.name) from None
            raise
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
