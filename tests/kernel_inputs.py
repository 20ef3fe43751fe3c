"""The launchers' bundles from a kda_case.Case's (inputs, kwargs): what ops.py passes to kda_ops.kernels."""
from __future__ import annotations

from kda_ops.options import KDAInputs, KDAOptions


def bundles(inputs, kw, scale=None, **over):
    """(KDAInputs, KDAOptions) for inputs [q, k, v, g, beta] and kda_case.Case.make's kwargs; over replaces
    KDAInputs fields (e.g. initial_state=h0.transpose(-1, -2).contiguous().transpose(-1, -2))."""
    q, k, v, g, beta = inputs
    x = KDAInputs(q, k, v, g, beta, kw.get("A_log"), kw.get("dt_bias"), kw.get("initial_state"),
                  kw.get("cu_seqlens"))._replace(**over)
    opts = KDAOptions(
        scale=q.shape[-1] ** -0.5 if scale is None else scale, lower_bound=kw.get("lower_bound"),
        use_qk_l2norm=kw.get("use_qk_l2norm_in_kernel", False), use_gate=kw.get("use_gate_in_kernel", False),
        use_beta_sigmoid=kw.get("use_beta_sigmoid_in_kernel", False),
        allow_neg_eigval=kw.get("allow_neg_eigval", False))
    return x, opts
