"""Decode step (T = 1) of KDA against FLA on one GPU: prints a table (and, with --json, writes it).

    python benchmarks/bench_decode.py
    python benchmarks/bench_decode.py --shapes 64,32,128 --regime strong --json out/bench_decode.json
    python benchmarks/bench_decode.py --sweep

--sweep times our decode kernel alone (CUDA graph) at each of SWEEP_CONFIGS (BV, warps) over SWEEP_SHAPES
(or --shapes) and prints one row per shape: how the fixed launch config (kernels/recurrent.py DECODE_BV,
DECODE_WARPS) compares with the others.

Providers: ``kda_ops`` (kda_ops.recurrent_kda: our Triton decode kernel) and ``fla``
(fla.ops.kda.fused_recurrent_kda, output_final_state=True, the state not updated in place). Inputs from
kda_ops.testing.make_inputs (--regime). Both with the gate, the q/k l2norm and the beta sigmoid inside the op,
bf16 q/k/v/g/beta, fp32 state [B, H, K, V] read and a new one written. Times are medians of
triton.testing.do_bench; "GB/s" counts the state read and written (the bytes that bound this op) plus the inputs
and output. "graph us" replays the call from a CUDA graph (triton.testing.do_bench_cudagraph): the GPU time
without the Python launch cost, which dominates at small batch. "speedup" is fla / kda_ops on the eager-call
medians, "graph" on the CUDA-graph ones.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = [(64, 32, 128), (1, 32, 128), (256, 32, 128), (64, 16, 256)]   # (B, H, K = V)
SWEEP_CONFIGS = [(32, 4), (16, 2), (32, 2), (64, 4), (64, 8), (16, 1), (8, 1), (16, 4)]   # (BV, num_warps)
SWEEP_SHAPES = [(B, H, D) for (H, D) in [(32, 128), (16, 256), (32, 64), (8, 128)] for B in (1, 4, 16, 64, 256)]


def make_inputs(B, H, D, regime="weak"):
    """kda_ops.testing.make_inputs at T = 1 with an initial state (bf16 inputs, fp32 state)."""
    from kda_ops.testing import make_inputs as draw
    return draw(B, 1, H, D, regime=regime, dtype=torch.bfloat16, device="cuda", seed=0, initial_state=True)


def step_kda_ops(x):
    import kda_ops
    return lambda: kda_ops.recurrent_kda(**x)


def step_fla(x):
    from fla.ops.kda import fused_recurrent_kda
    return lambda: fused_recurrent_kda(**x, output_final_state=True)


PROVIDERS = {"kda_ops": step_kda_ops, "fla": step_fla}


def bytes_moved(x) -> int:
    inputs = sum(t.numel() * t.element_size() for t in x.values() if isinstance(t, torch.Tensor))
    return inputs + x["v"].numel() * x["v"].element_size() + x["initial_state"].numel() * 4


def sweep(shapes, regime) -> int:
    """Our decode kernel at each (BV, warps) of SWEEP_CONFIGS, us from a CUDA graph; the fixed config marked."""
    import kda_ops
    from kda_ops.kernels import recurrent
    fixed = (recurrent.DECODE_BV, recurrent.DECODE_WARPS)
    print(f"decode kernel, us per call from a CUDA graph, on {torch.cuda.get_device_name()}; * = the launch config")
    print(f"{'B':>4} {'H':>3} {'K=V':>4} | " + " ".join(f"{'%d/%d' % c + ('*' if c == fixed else ''):>7}"
                                                    for c in SWEEP_CONFIGS) + " | fixed / best")
    try:
        for B, H, D in shapes:
            x = make_inputs(B, H, D, regime)
            us = []
            for bv, w in SWEEP_CONFIGS:
                recurrent.DECODE_BV, recurrent.DECODE_WARPS = bv, w
                fn = lambda: kda_ops.recurrent_kda(**x)  # noqa: E731
                fn()
                us.append(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3)
            ratio = us[SWEEP_CONFIGS.index(fixed)] / min(us) if fixed in SWEEP_CONFIGS else float("nan")
            print(f"{B:>4} {H:>3} {D:>4} | " + " ".join(f"{u:7.1f}" for u in us) + f" | {ratio:.3f}", flush=True)
    finally:
        recurrent.DECODE_BV, recurrent.DECODE_WARPS = fixed
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", default=None, help="B,H,D triples (default: %s)" % SHAPES)
    p.add_argument("--regime", default="weak", help="gate regime of kda_ops.testing (default: weak)")
    p.add_argument("--json", default=None, help="also write the rows, versions and command to this path")
    p.add_argument("--sweep", action="store_true", help="time the decode kernel at each of SWEEP_CONFIGS instead")
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    if args.sweep:
        return sweep(shapes if args.shapes else SWEEP_SHAPES, args.regime)
    card = torch.cuda.get_device_name()
    rows = []
    for B, H, D in shapes:
        x = make_inputs(B, H, D, args.regime)
        outs, row = {}, dict(B=B, T=1, H=H, HV=H, K=D, V=D, dtype="bfloat16")
        for name, make in PROVIDERS.items():
            try:
                fn = make(x)
                outs[name] = fn()
                triton.testing.do_bench(fn, warmup=200, rep=200)      # warm-up: clocks, allocator, first calls
                us = triton.testing.do_bench(fn, return_mode="median") * 1e3
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_GBps"] = round(bytes_moved(x) / us / 1e3, 1)
                # replayed from a CUDA graph: the kernel time without the Python launch cost
                try:
                    graph_ms = triton.testing.do_bench_cudagraph(fn, return_mode="median")
                    row[f"{name}_graph_us"] = round(graph_ms * 1e3, 2)
                except Exception as e:
                    row[f"{name}_graph_us"] = None
                    row[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"[:200]
            except Exception as e:   # a missing peer is reported, not fatal
                row[f"{name}_us"] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        if len(outs) == 2:   # the two agree (o in bf16, the state in fp32)
            (o1, h1), (o2, h2) = outs["kda_ops"], outs["fla"]
            row["max_rel_diff_o"] = float((o1.float() - o2.float()).abs().max() / o2.float().abs().max())
            row["max_rel_diff_state"] = float((h1 - h2).abs().max() / h2.abs().max())
        if row.get("kda_ops_us") and row.get("fla_us"):
            row["speedup_vs_fla"] = round(row["fla_us"] / row["kda_ops_us"], 2)
        if row.get("kda_ops_graph_us") and row.get("fla_graph_us"):
            row["speedup_vs_fla_graph"] = round(row["fla_graph_us"] / row["kda_ops_graph_us"], 2)
        rows.append(row)

    head = (f"{'B':>4} {'H':>3} {'K=V':>4} | {'kda_ops us':>10} {'GB/s':>6} {'graph us':>8} | {'fla us':>8} "
            f"{'GB/s':>6} {'graph us':>8} | {'speedup':>7} {'graph':>5} | rel diff o / state")
    print(f"KDA decode step (T=1, bf16, gate/l2norm/sigmoid in op) on {card}")
    print(head)
    print("-" * len(head))
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        print(f"{r['B']:>4} {r['H']:>3} {r['K']:>4} | {fmt(r.get('kda_ops_us'), '10.1f')} "
              f"{fmt(r.get('kda_ops_GBps'), '6.0f')} {fmt(r.get('kda_ops_graph_us'), '8.1f')} | "
              f"{fmt(r.get('fla_us'), '8.1f')} {fmt(r.get('fla_GBps'), '6.0f')} {fmt(r.get('fla_graph_us'), '8.1f')} | "
              f"{fmt(r.get('speedup_vs_fla'), '7.2f')} {fmt(r.get('speedup_vs_fla_graph'), '5.2f')} | "
              f"{fmt(r.get('max_rel_diff_o'), '.1e')} / "
              f"{fmt(r.get('max_rel_diff_state'), '.1e')}")
        for name in PROVIDERS:
            if f"{name}_error" in r:
                print(f"     {name}: {r[name + '_error']}")

    try:
        import fla
        fla_version = fla.__version__
    except Exception:
        fla_version = None
    record = dict(
        benchmark="decode", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        card=card, versions=dict(torch=torch.__version__, triton=triton.__version__, fla=fla_version,
                                 python=platform.python_version(), cuda=torch.version.cuda),
        command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + (argv if argv is not None else sys.argv[1:])),
        rows=rows)
    if not args.json:
        return 0
    path = args.json
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
