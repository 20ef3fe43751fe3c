"""CPU: forward + backward time of the chunked torch implementation (the CPU path of the ops) per chunk size.

    python benchmarks/bench_cpu.py          # the numbers behind ops.TORCH_CHUNK_SIZE

Prints min-of-3 milliseconds per (shape, chunk size); the result is the same for every chunk size.
"""
import time

import torch

from kda_ops.reference import chunk_kda_bwd_torch, chunk_kda_fwd_torch

SHAPES = [(32, 16, 2, 16), (8, 256, 4, 64), (2, 1024, 4, 64)]   # (B, T, H, K = V)


def main():
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'B':>3} {'T':>5} {'H':>2} {'K':>3} | " + " ".join(f"C={c:<3}ms" for c in (16, 32, 64)))
    for B, T, H, K in SHAPES:
        q, k, v, g = (torch.randn(B, T, H, K) for _ in range(4))
        beta = torch.randn(B, T, H)
        args = (q, k, v, g, beta, torch.ones(H), torch.zeros(H * K), None, None, K ** -0.5, None,
                True, True, True, False)
        times = []
        for C in (16, 32, 64):
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                o, _ = chunk_kda_fwd_torch(*args, True, chunk_size=C)
                chunk_kda_bwd_torch(torch.randn_like(o), None, *args, chunk_size=C)
                best = min(best, time.perf_counter() - t0)
            times.append(best * 1e3)
        print(f"{B:>3} {T:>5} {H:>2} {K:>3} | " + " ".join(f"{t:>8.1f}" for t in times))


if __name__ == "__main__":
    main()
