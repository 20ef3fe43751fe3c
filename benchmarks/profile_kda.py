"""One forward + backward of kda_ops.chunk_kda at one shape, for Nsight Compute (no timing of its own).

    ncu --clock-control none --set full -k regex:chunk_kda python3 benchmarks/profile_kda.py [B,T,H,D]

bf16, gate + l2norm + beta sigmoid in the op, like bench_kda.py. A first call compiles (and autotunes unless
KDA_OPS_AUTOTUNE=0); ncu profiles every matching launch, so filter with --launch-skip / --launch-count.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_kda import make_inputs  # noqa: E402

import kda_ops  # noqa: E402

B, T, H, D = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,8192,32,128").split(","))
x = make_inputs(B, T, H, D, torch.bfloat16, requires_grad=True)
for _ in range(2):
    o, _ = kda_ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D ** -0.5, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=x["A_log"],
                             dt_bias=x["dt_bias"])
    o.backward(torch.randn_like(o))
torch.cuda.synchronize()
print("done")
