"""The tool's formats and file names, importable without torch (argument checks, clean-up of earlier runs)."""
from __future__ import annotations

FORMATS = ("pt2", "aoti", "onnx", "onnx-la", "onnx-la-ms")
DEFAULT_FORMATS = ("pt2", "aoti", "onnx", "onnx-la")
ONNX_FORMATS = tuple(f for f in FORMATS if f.startswith("onnx"))
# The files each writer of export/artifacts.py creates; an ONNX model too large for one file keeps its
# weights beside it in NAME.data.
FILES: dict[str, tuple[str, ...]] = {
    "pt2": ("prefill.pt2", "decode.pt2"),
    "aoti": ("prefill.aoti.pt2",),
    "onnx": ("prefill.onnx", "decode.onnx"),
    "onnx-la": ("prefill.la.onnx", "decode.la.onnx"),
    "onnx-la-ms": ("prefill.la-ms.onnx", "decode.la-ms.onnx"),
}
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1                     # layout of manifest.json itself
STAGING_PREFIX = ".kda-export-partial-"  # staging folders inside --out; removed on exit or by the next run


def all_file_names() -> set[str]:
    """Every file name a writer of this tool can create (the names a later run into the same folder removes)."""
    names = {n for files in FILES.values() for n in files}
    return names | {n + ".data" for n in names if n.endswith(".onnx")}


def is_ours(name: str) -> bool:
    return name in all_file_names() or name == MANIFEST or name.startswith(STAGING_PREFIX)

PROG = "kda-export"


class UsageError(Exception):
    """Bad arguments or an unreadable model: printed as one line, exit status 2."""


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300].rstrip(": ")
