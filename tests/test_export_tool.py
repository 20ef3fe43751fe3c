"""The kda-export command line end to end on the tiny LM, generation through its artifacts, and its errors."""
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from export import __main__ as cli
from export import runtime

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ["prefill.pt2", "decode.pt2", "prefill.aoti.pt2", "prefill.onnx", "decode.onnx",
             "prefill.la.onnx", "decode.la.onnx"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    proc = subprocess.run([sys.executable, "-m", "export", "--tiny", "--out", str(out), "--batch-max", "4",
                           "--seq-max", "40"], cwd=ROOT, capture_output=True, text=True)
    return out, proc


def test_cli_writes_and_verifies_every_artifact(exported):
    out, proc = exported
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout[proc.stdout.index("artifact"):]
    for name in ARTIFACTS:
        assert (out / name).is_file()
        row = next(line for line in table.splitlines() if line.startswith(name + " "))
        assert row.rstrip().endswith("ok"), row


def test_greedy_generation_through_exported_graphs(exported):
    out, _ = exported
    model = cli.load_model(cli.parse_args(["--tiny"]))      # the same seeded weights the CLI exported
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    eager = model.generate(prompt, max_new_tokens=20)
    prefill, step = runtime.load(out / "prefill.pt2"), runtime.load(out / "decode.pt2")
    assert torch.equal(runtime.greedy_generate(prefill, step, prompt, 20), eager)
    prefill_onnx, step_onnx = runtime.load(out / "prefill.onnx"), runtime.load(out / "decode.onnx")
    assert torch.equal(runtime.greedy_generate(prefill_onnx, step_onnx, prompt, 20), eager)


def small_lm():
    """A --model factory (MODULE:FACTORY = test_export_tool:small_lm)."""
    from kda_ops.layers import KDAConfig, KDALanguageModel
    return KDALanguageModel(KDAConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, head_dim=8,
                                      lower_bound=-2.0))


@pytest.mark.parametrize("source", ["checkpoint", "model"])
def test_checkpoint_and_factory_inputs(source, tmp_path, capsys):
    """A checkpoint in the train_compiled.py format, and a user factory, export and verify (pt2 only: fast)."""
    if source == "checkpoint":
        model = small_lm()
        torch.save({"config": asdict(model.config), "model": model.state_dict(), "step": 0}, tmp_path / "ckpt.pt")
        argv = ["--checkpoint", str(tmp_path / "ckpt.pt")]
    else:
        argv = ["--model", "test_export_tool:small_lm", "--no-verify"]   # the loading is what differs
    rc = cli.main(argv + ["--formats", "pt2", "--out", str(tmp_path), "--seq-max", "20"])
    assert rc == 0, capsys.readouterr().out
    assert (tmp_path / "decode.pt2").is_file()


@pytest.mark.parametrize("argv,message", [
    (["--checkpoint", "/nonexistent/ckpt.pt"], "checkpoint not found: /nonexistent/ckpt.pt"),
    (["--tiny", "--formats", "pt2,tflite"], "unknown format tflite"),
    (["--tiny", "--batch-max", "0"], "--batch-max must be >= 1"),
    (["--tiny", "--seq-max", "1"], "--seq-max must be >= 2"),
    (["--model", "no_colon"], "--model must be MODULE:FACTORY"),
], ids=["missing-checkpoint", "unknown-format", "bad-batch", "bad-seq", "bad-model"])
def test_bad_arguments(argv, message, tmp_path, capsys):
    assert cli.main(argv + ["--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
