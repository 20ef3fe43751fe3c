"""Train a tiny KDA language model, export it, and generate with the exported graphs.

    python examples/export_and_run.py                 # smoke training (CPU is fine), export, generate
    python examples/export_and_run.py --checkpoint ckpt.pt --tokens 32

Steps: (1) ``examples/train_compiled.py --smoke --out DIR`` writes a checkpoint (skipped with --checkpoint);
(2) ``python -m export --checkpoint ... --formats pt2,onnx`` writes and verifies the prefill/decode graphs;
(3) greedy generation from the same prompt with eager PyTorch, the exported decode program (.pt2) and
onnxruntime (.onnx), printed side by side.
"""
import argparse
import glob
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from export import __main__ as kda_export  # noqa: E402
from export import runtime  # noqa: E402
from kda_ops.layers import load_checkpoint  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--out", default=os.path.join(ROOT, "out", "export_and_run"))
p.add_argument("--checkpoint", help="skip training and export this checkpoint")
p.add_argument("--tokens", type=int, default=20)
args = p.parse_args()

ckpt = args.checkpoint
if ckpt is None:
    train_dir = os.path.join(args.out, "train")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_compiled.py"), "--smoke",
                    "--out", train_dir], check=True)
    ckpt = sorted(glob.glob(os.path.join(train_dir, "*.pt")), key=os.path.getmtime)[-1]

export_dir = os.path.join(args.out, "export")
rc = kda_export.main(["--checkpoint", ckpt, "--formats", "pt2,onnx", "--out", export_dir, "--seq-max", "128"])
if rc != 0:
    sys.exit(rc)

model = load_checkpoint(ckpt)
prompt = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
results = {"eager": model.generate(prompt, args.tokens)}
for name, suffix in (("torch.export .pt2", ".pt2"), ("onnxruntime", ".onnx")):
    prefill = runtime.load(os.path.join(export_dir, "prefill" + suffix))
    step = runtime.load(os.path.join(export_dir, "decode" + suffix))
    results[name] = runtime.greedy_generate(prefill, step, prompt, args.tokens)

print(f"\nprompt {prompt.shape[1]} tokens, then {args.tokens} greedy tokens (new tokens shown):")
for b in range(prompt.shape[0]):
    for name, ids in results.items():
        print(f"  seq {b} {name:>17}: {ids[b, prompt.shape[1]:].tolist()}")
same = all(torch.equal(ids, results["eager"]) for ids in results.values())
print("all runtimes agree" if same else "RUNTIMES DISAGREE")
sys.exit(0 if same else 1)
