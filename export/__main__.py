"""kda-export command line: write the artifacts of a kda_ops model, reload each in a fresh process, compare.

    python -m export --tiny --out out/                       # the default tiny LM, every format
    python -m export --checkpoint ckpt.pt --formats pt2,onnx --out out/
    python -m export --model mypkg.models:build --batch-max 8 --seq-max 512 --out out/

Exit status: 0 when every artifact matches eager PyTorch, 1 on a mismatch or a failed artifact, 2 on bad
arguments. See export/README.md.
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import artifacts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# max relative error accepted, by model dtype (fp32: what ONNX function bodies reach, ~1e-6 seen)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
TINY_CONFIG = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=2, num_v_heads=4, head_dim=16)


class UsageError(Exception):
    """Bad arguments: printed as one line, exit status 2."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="kda-export", description="Export a kda_ops model to .pt2, AOTInductor "
                                "and ONNX, and verify every artifact against eager PyTorch.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="checkpoint written by examples/train_compiled.py")
    src.add_argument("--model", help="MODULE:FACTORY, a function returning the model (KDALanguageModel protocol)")
    src.add_argument("--tiny", action="store_true", help="the default tiny KDALanguageModel (random weights)")
    p.add_argument("--out", default="out/export", help="output directory (default: out/export)")
    p.add_argument("--formats", default=",".join(artifacts.DEFAULT_FORMATS),
                   help=f"comma-separated subset of {','.join(artifacts.WRITERS)} (default: %(default)s)")
    p.add_argument("--batch-max", type=int, default=8, help="largest batch the graphs accept (default: 8)")
    p.add_argument("--seq-max", type=int, default=512, help="longest prompt the prefill accepts (default: 512)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-verify", action="store_true", help="write the artifacts only")
    return p.parse_args(argv)


def check_args(args) -> list[str]:
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in artifacts.WRITERS]
    if unknown or not formats:
        raise UsageError(f"unknown format {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(artifacts.WRITERS)}")
    if args.batch_max < 1:
        raise UsageError(f"--batch-max must be >= 1, got {args.batch_max}")
    if args.seq_max < 2:
        raise UsageError(f"--seq-max must be >= 2, got {args.seq_max}")
    if args.checkpoint and not os.path.isfile(args.checkpoint):
        raise UsageError(f"checkpoint not found: {args.checkpoint}")
    if args.model and ":" not in args.model:
        raise UsageError(f"--model must be MODULE:FACTORY, got {args.model!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available here")
    if args.dtype == "bfloat16" and any(f.startswith("onnx") for f in formats):
        raise UsageError("ONNX formats are verified through numpy, which has no bfloat16: "
                         "use --dtype float32 or float16 with them")
    return formats


def load_model(args) -> torch.nn.Module:
    import kda_ops.layers as layers
    if args.checkpoint:
        model = layers.load_checkpoint(args.checkpoint)
    elif args.model:
        module, factory = args.model.split(":", 1)
        model = getattr(importlib.import_module(module), factory)()
    else:
        torch.manual_seed(args.seed)
        model = layers.KDALanguageModel(layers.KDAConfig(**TINY_CONFIG))
    return model.to(device=args.device, dtype=DTYPES[args.dtype]).eval()


def vocab_size(model) -> int:
    cfg = getattr(model, "config", None)
    if getattr(cfg, "vocab_size", None):
        return cfg.vocab_size
    return next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))


def verification_lengths(seq_max: int, exported_seq: int) -> list[int]:
    """Prompt lengths the artifacts are checked at: a short and the longest one, never the exported one."""
    return sorted({min(3, seq_max), seq_max} - {exported_seq}) or [1]


def verification_cases(model, vocab: int, args, seqs: list[int]) -> dict[str, list]:
    """Fresh inputs per graph (new seeds), at the given prompt lengths and batch min(3, batch_max)."""
    batch = min(3, args.batch_max)
    cases = [artifacts.example_inputs(model, vocab, batch, t, args.device, seed=args.seed + 1 + i)
             for i, t in enumerate(seqs)]
    return {g: [c[g] for c in cases] for g in artifacts.GRAPHS}


def relative_error(outputs, expected) -> float:
    """max over tensors of max|a - b| / max|b|."""
    if len(outputs) != len(expected):
        return float("inf")
    err = 0.0
    for a, b in zip(outputs, expected):
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        if a.shape != b.shape:
            return float("inf")
        err = max(err, float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
    return err


def verify(path: Path, cases: list, expected: list, device: str, tmp: Path):
    """Runs ``path`` on every case in one fresh process (python -m export.runtime).

    Returns (max relative error over cases, run time of the slowest case in seconds)."""
    fin, fout = tmp / f"{path.name}.in.pt", tmp / f"{path.name}.out.pt"
    torch.save({"cases": [[x.cpu() for x in inputs] for inputs in cases]}, fin)
    proc = subprocess.run([sys.executable, "-m", "export.runtime", str(path), str(fin), str(fout),
                           "--device", device], capture_output=True, text=True, env=_child_env())
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
    results = torch.load(fout)["cases"]
    err = max(relative_error(r["outputs"], ref) for r, ref in zip(results, expected))
    return err, max(r["seconds"] for r in results)


def _child_env() -> dict:
    """The child finds this checkout's packages (export, kda_ops) as the parent does."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _size(path: Path) -> str:
    n = path.stat().st_size + sum(p.stat().st_size for p in path.parent.glob(path.name + ".data"))
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def print_table(rows) -> None:
    head = ("artifact", "size", "max rel err", "run time", "status")
    lines = [head] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for j, line in enumerate(lines):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def run(args, formats) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args)
    vocab = vocab_size(model)
    exported_seq = min(16, args.seq_max)
    examples = artifacts.example_inputs(model, vocab, min(2, args.batch_max), exported_seq, args.device,
                                        seed=args.seed)
    t0 = time.perf_counter()
    programs = artifacts.export_programs(model, examples, args.batch_max, args.seq_max)
    print(f"torch.export: prefill and decode graphs in {time.perf_counter() - t0:.1f} s")
    seqs = verification_lengths(args.seq_max, exported_seq)
    cases = verification_cases(model, vocab, args, seqs)
    graphs = artifacts.graph_modules(model)
    with torch.no_grad():
        expected = {g: [list(graphs[g](*c)) for c in cases[g]] for g in artifacts.GRAPHS}
    tol = TOLERANCE[DTYPES[args.dtype]]
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in formats:
            t0 = time.perf_counter()
            try:
                paths = artifacts.WRITERS[fmt](programs, out)
            except Exception as e:  # report every format, then fail
                rows.append((fmt, "-", "-", "-", f"FAILED to write: {type(e).__name__}: {str(e)[:200]}"))
                ok = False
                continue
            print(f"{fmt}: wrote {', '.join(p.name for p in paths)} in {time.perf_counter() - t0:.1f} s")
            for path in paths:
                if args.no_verify:
                    rows.append((path.name, _size(path), "-", "-", "written"))
                    continue
                g = artifacts.graph_of(path)
                try:
                    err, sec = verify(path, cases[g], expected[g], args.device, Path(tmp))
                except Exception as e:
                    rows.append((path.name, _size(path), "-", "-", f"FAILED to run: {str(e)[:200]}"))
                    ok = False
                    continue
                good = err <= tol
                ok &= good
                rows.append((path.name, _size(path), f"{err:.2e}", f"{sec * 1e3:.2f} ms",
                             "ok" if good else f"MISMATCH (tol {tol:g})"))
    print(f"\nverified in fresh processes on prompts of length {seqs} "
          f"(exported at {exported_seq}), batch {min(3, args.batch_max)}, {args.dtype} on {args.device}:")
    print_table(rows)
    return 0 if ok else 1


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:      # argparse printed its message
        return int(e.code or 0)
    try:
        formats = check_args(args)
    except UsageError as e:
        print(f"kda-export: error: {e}", file=sys.stderr)
        return 2
    return run(args, formats)


if __name__ == "__main__":
    sys.exit(main())
