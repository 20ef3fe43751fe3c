"""kda-export through subprocesses: bad arguments, the manifest, interrupted and repeated runs (CPU, tiny model)."""
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kda_ops
from export import tool as export_tool
from export import artifacts

ROOT = Path(__file__).resolve().parent.parent
TOOL_NAMES = artifacts.all_file_names() | {"manifest.json"}


def tool(*argv, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "export", *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, **kw)


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tool_files(out: Path) -> set:
    return {p.name for p in out.iterdir() if p.name in TOOL_NAMES}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One tiny checkpoint and its broken variants, made once."""
    d = tmp_path_factory.mktemp("inputs")
    from kda_ops.layers import KDAConfig, KDALanguageModel
    torch.manual_seed(0)
    model = KDALanguageModel(KDAConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, head_dim=8))
    torch.save({"config": dataclasses.asdict(model.config), "model": model.state_dict()}, d / "good.pt")
    torch.save({"model": model.state_dict()}, d / "noconfig.pt")
    good = (d / "good.pt").read_bytes()
    (d / "truncated.pt").write_bytes(good[: len(good) // 2])
    (d / "empty.pt").write_bytes(b"")
    (d / "random.pt").write_bytes(bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1),
                                                      dtype=torch.uint8).tolist()))
    (d / "a_file").write_text("not a folder")
    return d


BAD = {   # case -> (arguments, a part of the message); {d} is the inputs folder
    "random-checkpoint": (["--checkpoint", "{d}/random.pt"], "not a complete torch.save file"),
    "truncated-checkpoint": (["--checkpoint", "{d}/truncated.pt"], "not a complete torch.save file"),
    "empty-checkpoint": (["--checkpoint", "{d}/empty.pt"], "is empty"),
    "no-config": (["--checkpoint", "{d}/noconfig.pt"], "has no 'config'"),
    "missing-checkpoint": (["--checkpoint", "{d}/nope.pt"], "checkpoint not found"),
    "out-is-a-file": (["--tiny", "--out", "{d}/a_file"], "exists and is not a directory"),
    "out-uncreatable": (["--tiny", "--out", "{d}/a_file/sub"], "cannot be created"),
    "device-foo": (["--tiny", "--device", "foo"], "cpu or cuda"),
    "device-meta": (["--tiny", "--device", "meta", "--no-verify"], "cpu or cuda"),
    "no-such-module": (["--model", "nosuchmod:f"], "cannot import 'nosuchmod'"),
    "unknown-format": (["--tiny", "--formats", "pt2,tflite"], "unknown format tflite"),
    "unknown-option": (["--tiny", "--bogus"], "unrecognized arguments"),
}
if not torch.cuda.is_available():
    BAD["cuda-without-cuda"] = (["--tiny", "--device", "cuda", "--no-verify"], "CUDA is not available")


@pytest.fixture(scope="module")
def bad_runs(files):
    """All bad-argument cases at once (each its own process; run side by side to keep the file fast)."""
    procs = {}
    for case, (argv, _) in BAD.items():
        argv = [a.format(d=files) for a in argv]
        if "--out" not in argv:
            argv += ["--out", str(files / f"out-{case}" / "sub")]
        procs[case] = subprocess.Popen([sys.executable, "-m", "export", *argv], cwd=ROOT, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return {case: (p.wait(timeout=300), *p.communicate()) for case, p in procs.items()}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_argument_exits_2_with_one_line_and_writes_nothing(case, bad_runs, files):
    rc, _, err = bad_runs[case]
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("kda-export: error: "), err
    assert BAD[case][1] in lines[0]
    assert not (files / f"out-{case}").exists()          # the output folder is not created
    assert (files / "a_file").read_text() == "not a folder"


@pytest.fixture(scope="module")
def first_run(files, tmp_path_factory):
    """A complete, verified run of the checkpoint (pt2 only: the fast format)."""
    out = tmp_path_factory.mktemp("first") / "export"
    proc = tool("--checkpoint", files / "good.pt", "--formats", "pt2", "--seq-max", 20, "--batch-max", 2,
                "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


def test_normal_run_writes_a_manifest_last(first_run, files):
    out, proc = first_run
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] is True and m["verified"] is True
    assert m["schema_version"] == kda_ops.SCHEMA_VERSION and m["versions"]["kda_ops"] == kda_ops.__version__
    assert m["versions"]["torch"] == torch.__version__ and "onnxruntime" in m["versions"]
    assert m["model"]["checkpoint_sha256"] == sha256(files / "good.pt") and len(m["model"]["sha256"]) == 64
    assert m["device"] == "cpu" and m["formats"] == ["pt2"] and m["tolerance"]["max_rel_err"] == 1e-4
    assert {a["file"] for a in m["artifacts"]} == {"prefill.pt2", "decode.pt2"} == tool_files(out) - {"manifest.json"}
    for a in m["artifacts"]:
        assert a["status"] == "ok" and a["max_rel_err"] <= 1e-4 and a["sha256"] == sha256(out / a["file"])
        assert (out / "manifest.json").stat().st_mtime_ns >= (out / a["file"]).stat().st_mtime_ns
    assert sorted(p.name for p in out.iterdir()) == ["decode.pt2", "manifest.json", "prefill.pt2"]  # no staging
    # the printed table says what its columns mean, the tolerance and where the artifacts are
    assert "max |artifact - eager| / max |eager|" in proc.stdout and "tolerance 0.0001" in proc.stdout
    assert f"artifacts and manifest.json in {out.resolve()}" in proc.stdout
    assert proc.stderr.strip() == "", proc.stderr                      # no foreign warnings


def test_interrupted_run_leaves_no_artifact_and_no_manifest(first_run, files, tmp_path):
    """Ctrl-C (simulated right after the first artifact is written, before it is renamed) in a used folder."""
    out = tmp_path / "export"
    shutil.copytree(first_run[0], out)
    (out / "notes.txt").write_text("mine")
    proc = tool("--tiny", "--formats", "pt2", "--seq-max", 20, "--batch-max", 2, "--out", out,
                env={export_tool.INTERRUPT_HOOK_ENV: "after-first-write"})
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "interrupted" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]     # nothing of either model, no staging


def test_second_run_replaces_the_previous_set(first_run, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(first_run[0], out)
    old = json.loads((out / "manifest.json").read_text())
    (out / "prefill.onnx").write_bytes(b"an artifact of an earlier run")     # a tool name, not in the manifest
    (out / "notes.txt").write_text("mine")
    proc = tool("--tiny", "--formats", "pt2", "--no-verify", "--seq-max", 20, "--batch-max", 2, "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["model"]["sha256"] != old["model"]["sha256"] and m["model"]["source"] == "tiny"
    assert m["complete"] is True and m["verified"] is None
    assert tool_files(out) == {a["file"] for a in m["artifacts"]} | {"manifest.json"}
    assert all(a["sha256"] == sha256(out / a["file"]) and a["sha256"] not in
               {b["sha256"] for b in old["artifacts"]} for a in m["artifacts"])
    assert (out / "notes.txt").read_text() == "mine"
