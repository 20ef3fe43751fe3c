"""kda-export command line: write the artifacts of a kda_ops model, reload each in a fresh process, compare.

    python -m export --tiny --out out/                       # the default tiny LM, every format
    python -m export --checkpoint ckpt.pt --formats pt2,onnx --out out/
    python -m export --model mypkg.models:build --batch-max 8 --seq-max 512 --out out/

Exit status: 0 when every artifact matches eager PyTorch, 1 on a mismatch or a failed artifact, 2 on bad
arguments or an unreadable model (one line on stderr, nothing written), 130 when interrupted.

The output folder is complete and consistent exactly when it holds ``manifest.json`` with ``"complete": true``:
earlier artifacts of this tool (and their manifest) are removed first, every artifact is written in a staging
folder inside the output folder and renamed into place when complete, and the manifest is written last.
This module checks the arguments without importing torch (a bad argument answers at once); export/tool.py
does the work. See export/README.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import zipfile
from pathlib import Path

from .names import DEFAULT_FORMATS, FORMATS, MANIFEST, ONNX_FORMATS, PROG, UsageError
from .names import one_line as _one_line

DTYPE_NAMES = ("float32", "bfloat16", "float16")


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # one line (argparse would print the usage first)
        raise UsageError(message)


def parse_args(argv):
    p = _Parser(prog=PROG, description="Export a kda_ops model to .pt2, AOTInductor and ONNX, and verify every "
                "artifact against eager PyTorch in a fresh process.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="checkpoint written by examples/train_compiled.py")
    src.add_argument("--model", help="MODULE:FACTORY, a function returning the model (KDALanguageModel protocol)")
    src.add_argument("--tiny", action="store_true", help="the default tiny KDALanguageModel (random weights)")
    p.add_argument("--out", default="out/export", help="output directory (default: out/export); earlier "
                   "artifacts of this tool in it are replaced, other files are left alone")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help=f"comma-separated subset of {','.join(FORMATS)} (default: %(default)s)")
    p.add_argument("--batch-max", type=int, default=8, help="largest batch the graphs accept (default: 8)")
    p.add_argument("--seq-max", type=int, default=512, help="longest prompt the prefill accepts (default: 512)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-verify", action="store_true", help="write the artifacts only")
    return p.parse_args(argv)


def check_device(name: str) -> str:
    """The device the artifacts are made and verified on: cpu, or a CUDA device this machine has. Refused
    otherwise (meta, another backend), with --no-verify too: the tool writes only what it could verify."""
    m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", name.strip())
    if not m:
        raise UsageError(f"--device {name!r}: artifacts can only be made and verified on cpu or cuda[:i]")
    if m.group(1) == "cpu":
        return "cpu"
    import torch
    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available here")
    if m.group(2) is not None and int(m.group(2)) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name.strip()


def check_out(out: Path) -> None:
    """--out must be a writable folder, or a path where one can be created."""
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"--out {out}: exists and is not a directory")
        if not os.access(out, os.W_OK | os.X_OK):
            raise UsageError(f"--out {out}: directory is not writable")
        return
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--out {out}: cannot be created, {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: cannot be created, {parent} is not writable")


def check_dependencies(formats, verify: bool) -> None:
    onnx = [f for f in formats if f in ONNX_FORMATS]
    needed = (["onnx", "onnxscript"] + (["onnxruntime"] if verify else [])) if onnx else []
    for module in needed:
        if importlib.util.find_spec(module) is None:
            import kda_ops
            raise UsageError(kda_ops.missing_dependency_message(module, f"--formats {','.join(onnx)}"))


def check_checkpoint(path: str) -> None:
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint not found: {path}")
    if os.path.getsize(path) == 0:
        raise UsageError(f"checkpoint {path} is empty")
    if not zipfile.is_zipfile(path):
        raise UsageError(f"checkpoint {path} is not a complete torch.save file (truncated, or not a checkpoint)")


def check_model_spec(spec: str) -> None:
    module, _, factory = spec.partition(":")
    if not module or not factory:
        raise UsageError(f"--model must be MODULE:FACTORY, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:     # MODULE may live in the current folder
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        raise UsageError(f"--model {spec}: cannot import {module!r}: {_one_line(e)}") from None
    if found is None:
        raise UsageError(f"--model {spec}: cannot import {module!r}: no such module")


def check_args(args) -> list[str]:
    """Every check that needs no model; raises UsageError. Returns the formats."""
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise UsageError(f"unknown format {', '.join(unknown) or '(none given)'}; choose from {', '.join(FORMATS)}")
    formats = list(dict.fromkeys(formats))
    if importlib.util.find_spec("torch") is None:
        raise UsageError("kda-export needs torch: install the build for your platform first "
                         "(https://pytorch.org/get-started/locally/), then kda_ops")
    if args.batch_max < 1:
        raise UsageError(f"--batch-max must be >= 1, got {args.batch_max}")
    if args.seq_max < 2:
        raise UsageError(f"--seq-max must be >= 2, got {args.seq_max}")
    if args.checkpoint:
        check_checkpoint(args.checkpoint)
    if args.model:
        check_model_spec(args.model)
    check_out(Path(args.out))
    if args.dtype == "bfloat16" and any(f in ONNX_FORMATS for f in formats):
        raise UsageError("ONNX formats are verified through numpy, which has no bfloat16: "
                         "use --dtype float32 or float16 with them")
    check_dependencies(formats, not args.no_verify)
    args.device = check_device(args.device)
    return formats


def load_model(args):
    """The model the tool would export for these arguments (on --device, in --dtype, eval mode)."""
    from . import tool
    return tool.load_model(args)


def main(argv=None) -> int:
    args = None
    try:
        args = parse_args(argv)
        formats = check_args(args)
        from . import tool              # torch, kda_ops: only once the arguments are good
        return tool.run(args, formats)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = args.out if args is not None else "the output folder"
        print(f"{PROG}: interrupted; {where} is incomplete (it has no {MANIFEST})", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
