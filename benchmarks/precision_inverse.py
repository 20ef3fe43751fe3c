"""fp32 accuracy of the diagonal-block inverse D = (I + Ld)^-1: forward substitution against doubling.

    python benchmarks/precision_inverse.py

Ld is built as in the kernel (beta_i k_i . k_j exp(gam_i - gam_j), j < i, l2-normalised correlated keys,
K = 128) for 4096 random 16x16 blocks; both forms run in fp32 and are compared with the fp64 inverse by
relative Frobenius error. Doubling uses D = (I - Ld)(I + Ld^2)(I + Ld^4)(I + Ld^8) (Ld^16 = 0); the kernel
on branch next/fwd-intra-split-inv runs its dots as tf32x3, about as accurate as fp32. Measured on CPU
(2026-11-29): substitution 5e-8 to 1.4e-7, doubling 3.5e-7 to 4.8e-7 for beta <= 1 and 2.1e-5 to 2.2e-5 for
beta <= 2 (allow_neg_eigval); bf16 storage alone costs ~2e-3 downstream.
"""
import torch


def make(nb, beta_max, decay, K=128):
    k = torch.randn(nb, 16, K, dtype=torch.float64) + 2.0 * torch.randn(nb, 1, K, dtype=torch.float64)
    k = torch.nn.functional.normalize(k, dim=-1)
    gam = (-decay * torch.rand(nb, 16, K, dtype=torch.float64)).cumsum(1)
    beta = beta_max * torch.rand(nb, 16, 1, dtype=torch.float64)
    A = torch.einsum("bik,bjk->bij", k * torch.exp(gam), k * torch.exp(-gam)) * beta
    return torch.tril(A, -1)


def substitution(L):
    D = torch.eye(16, dtype=L.dtype).repeat(L.shape[0], 1, 1)
    for a in range(1, 16):
        D[:, a, :] -= (L[:, a, :, None] * D).sum(1)
    return D


def doubling(L):
    D, N = torch.eye(16, dtype=L.dtype) - L, L
    for _ in range(3):
        N = N @ N
        D = D + D @ N
    return D


if __name__ == "__main__":
    torch.manual_seed(0)
    for beta_max, decay in [(1, 0.0), (1, 0.05), (2, 0.0), (2, 0.01)]:
        L = make(4096, beta_max, decay)
        ref = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + L)
        for name, f in [("substitution", substitution), ("doubling", doubling)]:
            err = ((f(L.float()).double() - ref).norm() / ref.norm()).item()
            print(f"beta <= {beta_max}, decay {decay}: {name:12s} relative error {err:.2e}")
