"""KDA speed (and memory) against FLA on one GPU: prints a table, writes JSON under benchmarks/results/.

    python benchmarks/bench_kda.py --mode fwd
    python benchmarks/bench_kda.py --mode fwdbwd
    python benchmarks/bench_kda.py --mode fwd --shapes 1,8192,32,128 --with-compiled

Providers: ``kda_ops`` (kda_ops.chunk_kda; in fwd mode falls back to kda_ops.kernels.chunk_kda_fwd_triton
when the public op is missing), ``fla`` (fla.ops.kda.chunk_kda), ``compiled`` (torch.compile of
kda_ops.reference.chunk_kda_fwd_torch, fwd only, only with --with-compiled and at most --compiled-max-chunks
chunks per sequence, else n/a), ``kda_ops_compiled`` (with --compile-op: kda_ops.chunk_kda under
torch.compile(fullgraph=True), fwd or fwd + bwd; printed in the compiled column). All with the gate, the q/k l2norm and the beta sigmoid inside the op, bf16.
Times are medians of triton.testing.do_bench (with --rounds N, the smallest of N interleaved medians); memory is
the peak allocated during one call minus before it.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import sys
import time
import traceback

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = [(1, 8192, 32, 128), (4, 4096, 32, 128), (8, 4096, 16, 128),
          (1, 32768, 32, 128), (2, 4096, 16, 64), (2, 4096, 8, 256)]


def make_inputs(B, T, H, D, dtype, requires_grad):
    torch.manual_seed(0)
    dev = "cuda"
    x = dict(
        q=torch.randn(B, T, H, D, device=dev, dtype=dtype),
        k=torch.randn(B, T, H, D, device=dev, dtype=dtype),
        v=torch.randn(B, T, H, D, device=dev, dtype=dtype),
        g=torch.randn(B, T, H, D, device=dev, dtype=dtype),
        beta=torch.randn(B, T, H, device=dev, dtype=dtype),
        A_log=torch.randn(H, device=dev) * 0.5,
        dt_bias=torch.randn(H * D, device=dev) * 0.5,
    )
    if requires_grad:
        for t in x.values():
            t.requires_grad_(True)
    return x


def fn_kda_ops(x, D, backward):
    import kda_ops
    if hasattr(kda_ops, "chunk_kda"):
        def f():
            o, _ = kda_ops.chunk_kda(
                x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, output_final_state=False,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=x["A_log"], dt_bias=x["dt_bias"])
            return o
    elif not backward:
        from kda_ops.kernels import chunk_kda_fwd_triton

        def f():
            o, *_ = chunk_kda_fwd_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                        None, None, D ** -0.5, None, True, True, True, False, False)
            return o
    else:
        return None
    return f


def fn_fla(x, D, backward):
    from fla.ops.kda import chunk_kda

    def f():
        o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, output_final_state=False,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         A_log=x["A_log"], dt_bias=x["dt_bias"])
        return o
    return f


def fn_compiled(x, D, backward):
    from kda_ops.reference import chunk_kda_fwd_torch
    ref = torch.compile(chunk_kda_fwd_torch)

    def f():
        o, _ = ref(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], None, None, D ** -0.5,
                   None, True, True, True, False, False)
        return o
    return f


def fn_kda_ops_compiled(x, D, backward):
    """The kda_ops call under torch.compile(fullgraph=True), as a compiled model runs it: Inductor launches our
    kernels from its own wrapper code (in fwdbwd the backward op runs from the compiled backward graph)."""
    return torch.compile(fn_kda_ops(x, D, backward), fullgraph=True)


def host_ms(f, iters=10):
    """CPU wall ms per call of `iters` calls of f issued back to back without a synchronisation (after three
    warm calls): the host's share of a call; at small shapes the GPU finishes first and this is what a timed
    benchmark measures."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    ms = (time.perf_counter() - t0) * 1000.0 / iters
    torch.cuda.synchronize()
    return ms


def make_step(f, x, backward):
    """One timed call of provider f: the forward under no_grad, or forward + backward (grads reset first)."""
    if backward:
        do = torch.randn_like(x["v"])

        def step():
            for t in x.values():
                t.grad = None
            f().backward(do)
    else:
        def step():
            with torch.no_grad():
                f()
    return step


def measure(make_fn, x, D, backward):
    """(median ms, peak extra MiB) or (None, None) when the provider is unavailable."""
    f = make_fn(x, D, backward)
    if f is None:
        return None, None
    step = make_step(f, x, backward)
    step()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=50, rep=200, return_mode="median")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    mib = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return ms, mib


def kernel_ms(step, iters=5):
    """({kernel name: GPU ms per call}, device launches per call) of `step` (torch.profiler over `iters` calls after
    one warm call). A kernel launched more than once per call shows its summed time (ours: the forward's kernels
    run in the forward and again in the backward's recompute)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    per, launches = collections.defaultdict(float), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total / 1000.0 / iters
            launches += 1
    return dict(per), launches / iters


def stage_ms(x, D, backward):
    """GPU ms per call of each of our kernels in one kda_ops call (fwd, or fwd + bwd through autograd), from the
    real op path: the stage split of a benchmark row."""
    per, _ = kernel_ms(make_step(fn_kda_ops(x, D, backward), x, backward))
    short = lambda n: n.replace("chunk_kda_", "").replace("_kernel", "")  # noqa: E731
    return {short(n): ms for n, ms in sorted(per.items(), key=lambda kv: -kv[1]) if n.startswith("chunk_kda")}


def versions():
    out = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version())
    try:
        import fla
        out["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        out["fla"] = f"unavailable ({type(e).__name__})"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwd")
    ap.add_argument("--shapes", nargs="*", default=None, help="B,T,H,D (K = V = D)")
    ap.add_argument("--providers", default="kda_ops,fla", help="comma list of kda_ops, fla")
    ap.add_argument("--stages", action="store_true",
                    help="also the GPU time of each of our kernels in the call (torch.profiler)")
    ap.add_argument("--fla-from", default=None,
                    help="results JSON of an earlier run of this script (same card and mode): take the FLA "
                         "times from it instead of timing FLA again (FLA autotunes for minutes on first use)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the providers this many times, interleaved (kda_ops, fla, kda_ops, fla, ...), and "
                         "report the smallest median of each (every round is kept in the JSON)")
    ap.add_argument("--with-compiled", action="store_true")
    ap.add_argument("--compile-op", action="store_true",
                    help="also time kda_ops under torch.compile(fullgraph=True), shown in the compiled column: at "
                         "small shapes an eager call is bound by the host (Python, dispatch, launches)")
    ap.add_argument("--compiled-max-chunks", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    backward = args.mode == "fwdbwd"
    card = torch.cuda.get_device_name()
    now = datetime.datetime.now(datetime.timezone.utc)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"kda_{args.mode}_{now.strftime('%Y%m%dT%H%M%S')}.json")
    result = dict(date=now.isoformat(timespec="seconds"), card=card, mode=args.mode, dtype="bfloat16",
                  versions=versions(), command=" ".join([os.path.basename(sys.executable)] + sys.argv), rows=[])

    fmt = lambda v, f="{:.3f}": "n/a" if v is None else f.format(v)  # noqa: E731
    head = f"{'B':>2} {'T':>6} {'H':>3} {'D':>4} | {'kda_ops ms':>10} {'fla ms':>8} {'compiled':>9} | " \
           f"{'kda_ops Mtok/s':>14} {'x FLA':>6}"
    if backward:
        head += f" | {'kda_ops MiB':>11} {'fla MiB':>8}"
    print(f"\nKDA {args.mode}, bf16, gate + l2norm + beta sigmoid in op, {card}")
    print(head)
    print("-" * len(head), flush=True)
    # Each row is printed and the JSON rewritten as soon as the row is measured: a run cut short by a time
    # limit still leaves every finished row behind.
    for (B, T, H, D) in shapes:
        x = make_inputs(B, T, H, D, torch.bfloat16, backward)
        row = dict(B=B, T=T, H=H, K=D, V=D)
        wanted = args.providers.split(",")
        if args.fla_from:
            wanted = [w for w in wanted if w != "fla"]
            with open(args.fla_from) as fh:
                old = [r for r in json.load(fh)["rows"] if (r["B"], r["T"], r["H"], r["K"]) == (B, T, H, D)]
            if old:
                row["fla_ms"] = old[0].get("fla_ms")
                row["fla_peak_mib"] = old[0].get("fla_peak_mib")
                row["fla_from"] = os.path.basename(args.fla_from)
        providers = [(n, f) for n, f in [("kda_ops", fn_kda_ops), ("fla", fn_fla)] if n in wanted]
        if args.with_compiled and not backward and T // 64 <= args.compiled_max_chunks:
            providers.append(("compiled", fn_compiled))
        if args.compile_op:
            providers.append(("kda_ops_compiled", fn_kda_ops_compiled))
        for rnd in range(args.rounds):
            for name, mk in providers:
                if f"{name}_error" in row:
                    continue
                try:
                    ms, mib = measure(mk, x, D, backward)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    ms, mib = None, None
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                row.setdefault(f"{name}_ms_rounds", []).append(ms)
                row[f"{name}_ms"] = min((m for m in row[f"{name}_ms_rounds"] if m is not None), default=None)
                if backward:
                    row[f"{name}_peak_mib"] = mib
        if args.stages:
            try:
                row["kernels_ms"] = stage_ms(x, D, backward)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["stages_error"] = f"{type(e).__name__}: {e}"[:300]
        for name in ("kda_ops", "fla", "compiled", "kda_ops_compiled"):
            ms = row.get(f"{name}_ms")
            row[f"{name}_tok_per_s"] = None if ms is None else B * T / (ms * 1e-3)
        if row.get("kda_ops_ms") and row.get("fla_ms"):
            row["speedup_vs_fla"] = row["fla_ms"] / row["kda_ops_ms"]
        del x
        torch.cuda.empty_cache()

        r = row
        line = (f"{r['B']:>2} {r['T']:>6} {r['H']:>3} {r['K']:>4} | {fmt(r.get('kda_ops_ms')):>10} "
                f"{fmt(r.get('fla_ms')):>8} {fmt(r.get('compiled_ms', r.get('kda_ops_compiled_ms'))):>9} | "
                f"{fmt(r['kda_ops_tok_per_s'] and r['kda_ops_tok_per_s'] / 1e6, '{:.1f}'):>14} "
                f"{fmt(r.get('speedup_vs_fla'), '{:.2f}'):>6}")
        if backward:
            line += f" | {fmt(r.get('kda_ops_peak_mib'), '{:.0f}'):>11} {fmt(r.get('fla_peak_mib'), '{:.0f}'):>8}"
        print(line, flush=True)
        if "kernels_ms" in r:
            print(f"{'':>20}   kernels: " + ", ".join(f"{n} {v:.3f}" for n, v in r["kernels_ms"].items()), flush=True)
        result["rows"].append(row)
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)

    if args.fla_from:
        print(f"(FLA times taken from {os.path.basename(args.fla_from)}, an earlier run of this script)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
