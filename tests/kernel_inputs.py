"""The launchers' bundles from a kda_case.Case's (inputs, kwargs): what ops.py passes to kda_ops.kernels; and the
kernels those launchers launch."""
from __future__ import annotations

import importlib
import pkgutil

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


def base_kernel(obj):
    """The jit function under a kernel's autotune / heuristics wrappers (an InterpretedFunction under
    TRITON_INTERPRET=1, else a JITFunction)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    while hasattr(obj, "fn") and not isinstance(obj, (JITFunction, InterpretedFunction)):
        obj = obj.fn
    return obj


def kernel_objects() -> dict:
    """{(module, name): object} for every launchable Triton kernel defined in a module of kda_ops.kernels: each
    @triton.jit or autotuned object whose name holds "kernel" (two autotuners over one jit function are two
    entries; the jit helpers they call are not kernels)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import kda_ops.kernels as pkg

    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"kda_ops.kernels.{info.name}")
        for name, obj in vars(mod).items():
            fn = base_kernel(obj)
            if isinstance(fn, (JITFunction, InterpretedFunction)) and "kernel" in name \
                    and fn.fn.__module__ == mod.__name__:
                found[(info.name, name)] = obj
    return found


def launcher_modules() -> list:
    """The modules of kda_ops.kernels that define a kernel of kernel_objects(): each launcher calls wrap_triton by
    name, so a test that intercepts the launches patches it in each of these."""
    return [importlib.import_module(f"kda_ops.kernels.{module}") for module in sorted({m for m, _ in kernel_objects()})]
