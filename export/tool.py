"""kda-export's work once export/__main__.py has checked the arguments: load the model, clear the previous
artifacts, write each format through a staging folder, verify each artifact in a fresh process, write
manifest.json last, print the table.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from . import artifacts
from .names import MANIFEST, MANIFEST_VERSION, PROG, STAGING_PREFIX, UsageError
from .names import is_ours as _is_ours
from .names import one_line as _one_line

# Test hook: "after-first-write" raises KeyboardInterrupt once the first format is written, before it is renamed.
INTERRUPT_HOOK_ENV = "KDA_EXPORT_TEST_INTERRUPT"
VERIFY_TIMEOUT_S = 900

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype choices
# max relative error accepted, by model dtype (fp32: what ONNX function bodies reach, ~1e-6 seen)
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
TINY_CONFIG = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=2, num_v_heads=4, head_dim=16)


def _read_checkpoint(path: str) -> torch.nn.Module:
    import kda_ops.layers as layers
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UsageError(f"checkpoint {path} holds objects other than tensors and plain containers "
                         "(torch.load(weights_only=True) refuses them)") from None
    except Exception as e:
        raise UsageError(f"checkpoint {path} cannot be read: {_one_line(e)}") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("config"), dict) or "model" not in ckpt:
        raise UsageError(f"checkpoint {path} has no 'config' and 'model' entries (the format of "
                         "examples/train_compiled.py: {'config': asdict(KDAConfig), 'model': state_dict})")
    try:
        return layers.load_checkpoint(path)
    except Exception as e:
        raise UsageError(f"checkpoint {path} does not match its config: {_one_line(e)}") from None


def _call_factory(spec: str) -> torch.nn.Module:
    module_name, factory = spec.split(":", 1)
    if os.getcwd() not in sys.path and "" not in sys.path:     # MODULE may live in the current folder
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise UsageError(f"--model {spec}: cannot import {module_name!r}: {_one_line(e)}") from None
    fn = getattr(module, factory, None)
    if not callable(fn):
        raise UsageError(f"--model {spec}: module {module_name!r} has no function {factory!r}")
    try:
        model = fn()
    except Exception as e:
        raise UsageError(f"--model {spec}: the factory raised {_one_line(e)}") from None
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "prefill") and hasattr(model, "step")):
        raise UsageError(f"--model {spec}: returned {type(model).__name__}, not an nn.Module with prefill() and "
                         "step() (the protocol of kda_ops.layers.KDALanguageModel)")
    return model


def load_model(args) -> torch.nn.Module:
    """The model on --device in --dtype, eval mode. Raises UsageError (one line) when it cannot be had."""
    import kda_ops.layers as layers
    if args.checkpoint:
        model = _read_checkpoint(args.checkpoint)
    elif args.model:
        model = _call_factory(args.model)
    else:
        torch.manual_seed(args.seed)
        model = layers.KDALanguageModel(layers.KDAConfig(**TINY_CONFIG))
    return model.to(device=args.device, dtype=DTYPES[args.dtype]).eval()


def vocab_size(model) -> int:
    cfg = getattr(model, "config", None)
    if getattr(cfg, "vocab_size", None):
        return cfg.vocab_size
    return next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))


def model_sha256(model) -> str:
    """sha256 over the state dict (names, dtypes, shapes, bytes) in a fixed order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def quiet_foreign_noise():
    """Keeps known messages of torch and onnxscript that are not the user's business off the screen:
    the LeafSpec FutureWarning raised inside torch.export / torch.onnx, torch.onnx's "torchvision is not
    installed" lines, and onnxscript's note that it converts the opset through the onnx C API."""
    class Drop(logging.Filter):
        def filter(self, record):
            msg = str(record.msg)
            return not (msg.startswith("torchvision is not installed")
                        or msg.startswith("The model version conversion is not supported by the onnxscript"))
    loggers = [logging.getLogger("torch.onnx._internal.exporter._registration"),
               logging.getLogger("onnxscript.version_converter")]
    drop = Drop()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        for lg in loggers:
            lg.addFilter(drop)
        try:
            yield
        finally:
            for lg in loggers:
                lg.removeFilter(drop)


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


class VerifyFailed(Exception):
    pass


def verify(path: Path, cases: list, expected: list, device: str, tmp: Path):
    """Runs ``path`` on every case in one fresh process (python -m <this package>.runtime).

    Returns (max relative error over cases, run time of the slowest case in seconds, what ran it).
    Raises VerifyFailed with one line when the process fails, is killed by a signal, or times out."""
    fin, fout = tmp / f"{path.name}.in.pt", tmp / f"{path.name}.out.pt"
    torch.save({"cases": [[x.cpu() for x in inputs] for inputs in cases]}, fin)
    cmd = [sys.executable, "-m", f"{__package__}.runtime", str(path), str(fin), str(fout), "--device", device]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(), timeout=VERIFY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise VerifyFailed(f"the loading process did not finish in {VERIFY_TIMEOUT_S} s") from None
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = f"signal {-proc.returncode}"
        raise VerifyFailed(f"the fresh process loading it was killed by {sig}")
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise VerifyFailed(f"exit {proc.returncode}: {lines[-1] if lines else 'no message'}")
    results = torch.load(fout)["cases"]
    err = max(relative_error(r["outputs"], ref) for r, ref in zip(results, expected))
    return err, max(r["seconds"] for r in results), results[0].get("backend", "")


def _child_env() -> dict:
    """Run from a checkout (python -m export), the child finds this checkout's export and kda_ops."""
    env = dict(os.environ)
    if __package__ == "export":
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def print_table(rows) -> None:
    head = ("artifact", "size", "max rel err", "run time", "status")
    lines = [head] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for j, line in enumerate(lines):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def clear_previous(out: Path) -> list[str]:
    """Removes what an earlier run of this tool left in ``out``: the manifest first (so that an interrupted
    clean-up leaves a folder without one), then the files it lists and every file name this tool writes, and
    staging folders. Other files are left alone. Returns the names removed."""
    listed = []
    manifest = out / MANIFEST
    if manifest.is_file():
        try:
            listed = [a["file"] for a in json.loads(manifest.read_text()).get("artifacts", [])]
        except Exception:       # an unreadable manifest: the tool's file names below still go
            listed = []
        manifest.unlink()
    names = {n for n in listed if isinstance(n, str) and n == Path(n).name and _is_ours(n)}
    names |= {p.name for p in out.iterdir() if _is_ours(p.name)}
    removed = []
    for name in sorted(names):
        p = out / name
        if p.is_dir() and name.startswith(STAGING_PREFIX):
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file() or p.is_symlink():
            p.unlink()
        else:
            continue
        removed.append(name)
    return removed


def _versions() -> dict:
    import kda_ops
    v = {"kda_ops": kda_ops.__version__, "torch": torch.__version__}
    for mod in ("onnx", "onnxscript", "onnxruntime"):
        try:
            v[mod] = importlib.import_module(mod).__version__ if importlib.util.find_spec(mod) else None
        except Exception:
            v[mod] = None
    return v


def write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / f".{MANIFEST}.partial"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(args, formats) -> int:
    import kda_ops
    out = Path(args.out)
    _say(f"loading the model ({args.checkpoint or args.model or 'tiny, random weights'}) on {args.device}")
    model = load_model(args)           # UsageError here: nothing written yet
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot be created: {_one_line(e)}") from None
    removed = clear_previous(out)
    if removed:
        _say(f"removed the previous artifacts of this tool in {out}: {', '.join(removed)}")
    vocab = vocab_size(model)
    exported_seq = min(16, args.seq_max)
    tol = TOLERANCE[args.dtype]
    manifest = {
        "manifest_version": MANIFEST_VERSION, "tool": PROG, "complete": False,
        "schema_version": kda_ops.SCHEMA_VERSION, "versions": _versions(),
        "model": {"source": ("checkpoint" if args.checkpoint else "model" if args.model else "tiny"),
                  "spec": args.checkpoint or args.model or "tiny", "sha256": model_sha256(model),
                  "checkpoint_sha256": file_sha256(Path(args.checkpoint)) if args.checkpoint else None,
                  "vocab_size": vocab},
        "device": args.device, "dtype": args.dtype, "formats": formats,
        "batch_max": args.batch_max, "seq_max": args.seq_max, "exported_seq": exported_seq,
        "tolerance": {"max_rel_err": tol,
                      "definition": "max |artifact - eager| / max |eager| over all outputs and cases"},
        "verified": None, "artifacts": [],
    }
    with quiet_foreign_noise():
        examples = artifacts.example_inputs(model, vocab, min(2, args.batch_max), exported_seq, args.device,
                                            seed=args.seed)
        _say("torch.export: tracing the prefill and decode graphs...")
        t0 = time.perf_counter()
        programs = artifacts.export_programs(model, examples, args.batch_max, args.seq_max)
        _say(f"torch.export: done in {time.perf_counter() - t0:.1f} s")
        seqs = verification_lengths(args.seq_max, exported_seq)
        cases = verification_cases(model, vocab, args, seqs)
        graphs = artifacts.graph_modules(model)
        with torch.no_grad():
            expected = {g: [list(graphs[g](*c)) for c in cases[g]] for g in artifacts.GRAPHS}
        rows, ok, complete = [], True, True
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
        try:
            for fmt in formats:
                what = {"aoti": " (AOTInductor compiles C++: about a minute)",
                        "onnx": " (translating to ONNX: some seconds)"}.get(fmt.split("-")[0], "")
                _say(f"{fmt}: writing {', '.join(artifacts.FILES[fmt])}{what}...")
                t0 = time.perf_counter()
                fmt_dir = staging / fmt
                fmt_dir.mkdir()
                try:
                    paths = artifacts.WRITERS[fmt](programs, fmt_dir)
                except Exception as e:  # report every format, then fail
                    _say(f"{fmt}: FAILED: {_one_line(e)}")
                    rows.append((fmt, "-", "-", "-", f"FAILED to write: {_one_line(e)}"))
                    manifest["artifacts"].append({"format": fmt, "file": None, "status": "failed to write",
                                                  "error": _one_line(e)})
                    ok = complete = False
                    continue
                if os.environ.get(INTERRUPT_HOOK_ENV) == "after-first-write":
                    raise KeyboardInterrupt
                for p in sorted(fmt_dir.iterdir()):          # artifacts and their .data files, complete now
                    os.replace(p, out / p.name)
                _say(f"{fmt}: done in {time.perf_counter() - t0:.1f} s")
                for p in paths:
                    final = out / p.name
                    n = final.stat().st_size + sum(q.stat().st_size for q in out.glob(p.name + ".data"))
                    manifest["artifacts"].append({"format": fmt, "file": p.name, "graph": artifacts.graph_of(p),
                                                  "bytes": n, "sha256": file_sha256(final)})
            if not args.no_verify:
                _say("verifying: each artifact is loaded in a fresh process, run on new inputs and compared "
                     "with eager PyTorch...")
            for entry in manifest["artifacts"]:
                if entry["file"] is None:
                    continue
                final = out / entry["file"]
                if args.no_verify:
                    entry["status"] = "written"
                    rows.append((entry["file"], _size(entry["bytes"]), "-", "-", "written (not verified)"))
                    continue
                g = entry["graph"]
                try:
                    err, sec, backend = verify(final, cases[g], expected[g], args.device, staging)
                except VerifyFailed as e:
                    entry.update(status="failed to run", error=str(e))
                    rows.append((entry["file"], _size(entry["bytes"]), "-", "-", f"FAILED to run: {e}"))
                    ok = False
                    continue
                good = err <= tol
                ok &= good
                status = "ok" if good else "MISMATCH"
                note = _backend_note(backend, args.device)
                entry.update(status=status.lower(), max_rel_err=err, run_ms=sec * 1e3, ran_on=backend)
                rows.append((entry["file"], _size(entry["bytes"]), f"{err:.2e}", f"{sec * 1e3:.2f} ms",
                             status + note))
                _say(f"  {entry['file']}: {status}{note}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    manifest["complete"] = complete
    manifest["verified"] = None if args.no_verify else ok
    manifest["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    write_manifest(out, manifest)       # last: its presence marks a finished set
    _report(args, rows, seqs, exported_seq, tol, out, ok)
    return 0 if ok else 1


def _backend_note(backend: str, device: str) -> str:
    if device.startswith("cuda") and backend == "CPUExecutionProvider":
        return " (ran on onnxruntime's CPU EP: this onnxruntime has no CUDA EP)"
    return ""


def _report(args, rows, seqs, exported_seq, tol, out: Path, ok: bool) -> None:
    print()
    if args.no_verify:
        print(f"written, not verified ({args.dtype} on {args.device}):")
    else:
        print(f"verified in fresh processes on {args.device}, {args.dtype}: batch {min(3, args.batch_max)}, "
              f"prompts of length {seqs} (the graphs were traced at {exported_seq})")
        print(f"  max rel err: max |artifact - eager| / max |eager| over all outputs (logits and cache); "
              f"tolerance {tol:g}")
        print("  run time: median of 5 runs of the slowest case after warm-up, in the fresh process "
              "(not a benchmark)")
    print_table(rows)
    print(f"\nartifacts and manifest.json in {out.resolve()}")
    if not args.no_verify:
        n = len(rows)
        print(f"all {n} artifacts match eager PyTorch" if ok else
              f"{sum(1 for r in rows if not r[4].startswith('ok'))} of {n} artifacts FAILED (see status)")
