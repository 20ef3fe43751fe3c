"""Seconds of the first chunk_kda call (forward + backward) at each new length, in one process.

    python benchmarks/first_call.py [--lengths 1000 1200 1216 777 4096 1] [--shape-rest 1,4,128] [--varlen]
    python benchmarks/first_call.py --provider fla --lengths 4096 --shape-rest 2,16,128
    python benchmarks/first_call.py --compile --lengths 4096 3000 1000 8192 777 --shape-rest 2,16,128

The first length pays the compile (and the autotune, unless KDA_OPS_AUTOTUNE=0); a later length should cost
about what a warm call costs (target: < 1 s), whatever its divisibility by 16. Each row: length, seconds of the
first call, milliseconds of a second call at the same length. bf16, gate + l2norm + beta sigmoid in the op.
``--provider fla`` times FLA's chunk_kda the same way (FLA autotunes always). ``--compile`` calls it through
torch.compile(fullgraph=True, dynamic=True) and also prints how many graphs Dynamo has compiled so far (one for
the forward, whatever the lengths, when nothing recompiles). For a first use, point
TRITON_CACHE_DIR at an empty folder: Triton's on-disk cache otherwise skips the compile.
"""
from __future__ import annotations

import argparse
import time

import torch

import kda_ops
from kda_ops.testing import make_inputs


def chunk_fla(**kw):
    from fla.ops.kda import chunk_kda
    return chunk_kda(**kw, safe_gate=kw.get("lower_bound") is not None)


PROVIDERS = {"kda_ops": kda_ops.chunk_kda, "fla": chunk_fla}


def loss(f, kw):
    o, ht = f(**kw, output_final_state=True)
    return o.float().sum() + ht.sum()


def call(f, kw, compiled=None):
    (loss(f, kw) if compiled is None else compiled(kw)).backward()
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 1200, 1216, 777, 4096, 1])
    ap.add_argument("--shape-rest", default="1,4,128", help="B,H,D (K = V = D)")
    ap.add_argument("--varlen", action="store_true", help="B = 1 and two sequences of lengths T // 3, T - T // 3")
    ap.add_argument("--provider", choices=sorted(PROVIDERS), default="kda_ops")
    ap.add_argument("--compile", action="store_true", help="through torch.compile(fullgraph=True, dynamic=True)")
    a = ap.parse_args()
    f = PROVIDERS[a.provider]
    compiled = torch.compile(lambda kw: loss(f, kw), fullgraph=True, dynamic=True) if a.compile else None
    B, H, D = (int(x) for x in a.shape_rest.split(","))
    print(f"{a.provider}: first call per length, (B, H, K=V) = ({B}, {H}, {D}){' varlen' if a.varlen else ''}"
          f"{' compiled' if a.compile else ''}")
    for T in a.lengths:
        cu = [0, T // 3, T] if a.varlen else None
        kw = make_inputs(1 if a.varlen else B, T, H, D, device="cuda", cu_seqlens=cu, initial_state=True,
                         requires_grad=True)
        t0 = time.perf_counter()
        call(f, kw, compiled)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        call(f, kw, compiled)
        graphs = f"  graphs {torch._dynamo.utils.counters['stats']['unique_graphs']}" if a.compile else ""
        print(f"  T={T:6d}  first {first:8.3f} s  again {1e3 * (time.perf_counter() - t0):8.2f} ms{graphs}",
              flush=True)


if __name__ == "__main__":
    main()
