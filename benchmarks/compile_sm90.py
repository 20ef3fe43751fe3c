"""Offline sm_90 (H100 / H200) compile of the chunk kernels, no GPU needed: registers, spills, shared memory.

    python benchmarks/compile_sm90.py [intra] [wu] [state] [state_bwd] [inter] [intra_bwd] [--sass] [--paths]
                                      [--tree DIR]
    PYTHONPATH=<site-packages with another triton> python benchmarks/compile_sm90.py ...

(--tree DIR: compile the kda_ops of another checkout, e.g. a `git worktree` of a branch, instead of this one's.)

(state_bwd, inter: the backward's state pass and inter kernel at K = V = 128 with bf16 inputs, every autotune
config; intra_bwd: the backward's row-block kernel at every config, also in its bounded-gate form, and its gate
kernel.) --sass adds a line per build
with its SASS instruction count and the counts of the opcodes that show a recomputation (global loads LDG,
special-function MUFU, FFMA), spills (LDL, STL), elementwise work such as masking dot outputs (FADD, FSEL), the
tensor-core dots (HGMMA) or synchronisation (SHFL, BAR), the libdevice functions inlined into it (from the PTX),
and the same counts for each loop of the build; the last line names the folder of the cubins, whose full listing
`cuobjdump -sass` prints. --paths (with --sass) adds, under each loop, the instruction and
HGMMA counts of the paths through one iteration (sass_paths): a loop whose body branches on the data, such as the
forward intra kernel's K loop (fast path, exact path), shows one count per path.

Use the Triton version of the GPU machine (3.6.0 there) for numbers that match it. Pointer arguments get
tt.divisibility = 16 as the JIT gives them at run time (without it every load is scalar and the report
shows spills the GPU build does not have). Registers and spills come from the cuobjdump in the triton wheel.
This is how the register counts and the shared-memory notes in the comments of kda_ops/kernels/ (e.g.
bwd_intra.py, fwd_state.py) are read.
"""
import os
import re
import subprocess
import sys
import tempfile
import time

TREE = sys.argv[sys.argv.index('--tree') + 1] if '--tree' in sys.argv else os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(TREE))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kda_ops.kernels.bwd_gate import chunk_kda_bwd_kernel_gate  # noqa: E402
from kda_ops.kernels.bwd_inter import chunk_kda_bwd_kernel_inter  # noqa: E402
from kda_ops.kernels.bwd_intra import chunk_kda_bwd_kernel_intra  # noqa: E402
from kda_ops.kernels.bwd_state import chunk_kda_bwd_kernel_state  # noqa: E402
from kda_ops.kernels.common import G_MIN, G_MIN_16BIT  # noqa: E402
from kda_ops.kernels.fwd_intra import chunk_kda_fwd_kernel_intra, chunk_kda_fwd_kernel_intra_rerun  # noqa: E402
from kda_ops.kernels.fwd_state import chunk_kda_fwd_kernel_state  # noqa: E402
from kda_ops.kernels.fwd_wu import chunk_kda_fwd_kernel_wu  # noqa: E402

OUT = None   # the folder of the cubins, made at the first build
target = GPUTarget("cuda", 90, 32)
cuobj = os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump')

def args(ty, names):
    """{name: ty} for each of the space-separated names: a piece of comp's types."""
    return dict.fromkeys(names.split(), ty)


def comp(jf, types, consts, num_warps, num_stages, tag, maxnreg=None):
    """Compile jf for sm_90 and print one line: types maps each runtime argument of jf's signature to its Triton
    type (a name jf does not take is ignored), consts its constexprs."""
    fn = jf
    while not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = fn.fn
    sig = {nm: 'constexpr' if nm in consts else types[nm] for nm in fn.arg_names}
    attrs = {(fn.arg_names.index(nm),): [['tt.divisibility', 16]] for nm, ty in sig.items() if ty.startswith('*')}
    t = time.time()
    try:
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=target,
                           options=dict(num_warps=num_warps, num_stages=num_stages,
                                        **({} if maxnreg is None else dict(maxnreg=maxnreg))))
    except Exception as e:
        root = e
        while root.__cause__ is not None:     # a jit function's error comes wrapped once per call level
            root = root.__cause__
        cause = f"\n    from {type(root).__name__}: ...{str(root)[-600:]}" if root is not e else ""
        print(f"  {tag}: FAIL {type(e).__name__}: {str(e)[:2000]}{cause}"); return
    global OUT
    OUT = OUT or tempfile.mkdtemp(prefix="kda_sm90_")
    path = os.path.join(OUT, f'{tag}.cubin')
    open(path, 'wb').write(k.asm['cubin'])
    out = subprocess.run([cuobj, '-res-usage', path], capture_output=True, text=True).stdout
    res = [l.strip() for l in out.splitlines() if 'REG' in l]
    print(f"  {tag}: shared {k.metadata.shared} {res} mnA16 {mn_a16(k.asm['ttgir'])} ({time.time()-t:.1f}s)",
          flush=True)
    if SASS:
        insts = sass_insts(subprocess.run([cuobj, '-sass', path], capture_output=True, text=True).stdout)
        print(f"    sass {sass_counts(insts)}; {libdevice_calls(k.asm['ptx'])}", flush=True)
        for lo, hi in sass_loops(insts):
            print(f"      loop {lo:#x}-{hi:#x}: {sass_counts([i for i in insts if lo <= i[0] <= hi])}", flush=True)
            if PATHS:
                print("        paths: " + ", ".join(f"{n:,} ({h} HGMMA)" if n >= 0 else "(walk cut short)"
                                                 for n, h in sass_paths(insts, lo, hi)), flush=True)


def libdevice_calls(ptx):
    """'libdevice: name xN, ...' of the libdevice functions inlined into a PTX listing, or 'libdevice: none'.
    Counted from the basic blocks LLVM names after an inlined call (e.g. __nv_logf.exit): a count is of such
    blocks, about one per call. logf is a long polynomial with a branch; exp2f compiles to ex2.approx."""
    found = re.findall(r'^\$\w+:\s+// %(__nv_\w+?)\.exit', ptx, re.M)
    counts = [f"{n[5:]} x{found.count(n)}" for n in sorted(set(found))]
    return "libdevice: " + (", ".join(counts) if counts else "none")


def sass_insts(sass):
    """[(address, predicate ('' or e.g. '@!P0'), opcode without modifiers, branch target or None)] of a
    cuobjdump -sass listing."""
    insts = re.findall(r'^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_]+)([^;]*);', sass, re.M)
    return [(int(a, 16), pred.strip(), op,
             int(m.group(1), 16) if op == 'BRA' and (m := re.search(r'0x([0-9a-f]+)', rest)) else None)
            for a, pred, op, rest in insts]


def sass_counts(insts, ops=('LDG', 'STG', 'LDL', 'STL', 'MUFU', 'FFMA', 'FADD', 'FSEL', 'HGMMA', 'SHFL', 'BAR')):
    """'N instructions, LDG n, ...' of sass_insts' list."""
    names = [i[2] for i in insts]
    return f"{len(names)} instructions, " + ", ".join(f"{op} {names.count(op)}" for op in ops)


def sass_loops(insts):
    """[(lo, hi)]: the address range of each loop of sass_insts' list (a backward branch at hi and the code from its
    target lo; an outer loop's range holds its inner loops)."""
    return [(tgt, a) for a, _, _, tgt in insts if tgt is not None and tgt < a]


def sass_paths(insts, lo, hi, limit=12, budget=10 ** 6):
    """[(instructions, HGMMA)] of the paths through one iteration of the loop at [lo, hi] (sass_loops) of
    sass_insts' list: from its first instruction to its backward branch, or out of the range, taking each basic
    block at most once (so an inner loop's body counts at most once), distinct, fewest instructions first, at most
    `limit`. A branch predicated on PT is always taken, on !PT never; any other predicate gives both ways. Some
    paths may be ones the data never takes. The walk stops after `budget` blocks visited (a loop body with many
    branches has too many paths to walk them all); a list it cut short ends with (-1, -1)."""
    insts = [i for i in insts if lo <= i[0] <= hi]

    def exits(k):
        """Successor addresses of instruction k (None: the iteration ends there)."""
        _, pred, op, tgt = insts[k]
        nxt = insts[k + 1][0] if k + 1 < len(insts) else None
        always, never = pred in ('', '@PT'), pred == '@!PT'
        if op == 'EXIT':
            return [None] if always else [nxt] if never else [None, nxt]
        if op != 'BRA' or never:
            return [nxt]
        tgt = tgt if tgt is not None and lo < tgt <= hi else None      # the backward branch, or out of the loop
        return [tgt] if always else [tgt, nxt]
    ends = [k for k, i in enumerate(insts) if i[2] in ('BRA', 'EXIT')]
    starts = sorted(({lo} | {t for k in ends for t in exits(k) if t is not None}
                     | {insts[k + 1][0] for k in ends if k + 1 < len(insts)}) & {i[0] for i in insts})
    index = {i[0]: k for k, i in enumerate(insts)}
    blocks = {}   # first address -> (instructions, HGMMA, successors (None: the iteration ends))
    for b, e in zip(starts, starts[1:] + [None]):
        ks = range(index[b], index[e] if e is not None else len(insts))
        blocks[b] = (len(ks), sum(insts[k][2] == 'HGMMA' for k in ks), exits(ks[-1]))
    found, left, cut = set(), budget, False

    def walk(b, seen, n, h):
        nonlocal left, cut
        if b is None:
            found.add((n, h))
        elif b in seen:
            return
        elif left == 0:
            cut = True
        else:
            left -= 1
            nb, hb, succ = blocks[b]
            for s in succ:
                walk(s, seen | {b}, n + nb, h + hb)
    walk(lo, frozenset(), 0, 0)
    return sorted(found)[:limit] + ([(-1, -1)] if cut else [])


def mn_a16(ttgir):
    """How many wgmma dots take a 16-bit FIRST operand transposed in shared memory (memdesc_trans): the pattern
    behind faults with triton 3.6 on the H200 (a bf16 kd^T tile in the state pass, 'Invalid __shared__ read'
    under compute-sanitizer; kernels/fwd_state.py, bwd_state.py). Our kernels show 0. Transposed SECOND operands
    (the inter kernel has five) are the usual wgmma B layout and run fine."""
    trans16 = set()
    n = 0
    for line in ttgir.splitlines():
        m = re.match(r'\s*(%[\w.#]+) = ttg\.memdesc_trans .*-> !ttg\.memdesc<\w*x(bf16|f16)', line)
        if m:
            trans16.add(m.group(1))
        m = re.match(r'\s*%[\w.#]+ = ttng\.warp_group_dot (%[\w.#]+),', line)
        if m and m.group(1) in trans16:
            n += 1
    return n

def intra(dt='bf16', K=128, w=4, BK=32, wdt=None, maxnreg=None, **flags):
    """The Aqk / inverse kernel. wdt: storage dtype of Aqk (bf16: the forward's lowp mode; fp32: the recompute)."""
    wdt = wdt or dt
    types = {**args(f'*{dt}', 'q k g beta'), **args('*fp32', 'A_log dt_bias gam beta_act rq rk'),
             **args(f'*{wdt}', 'Aqk Tm kd qg kbg'), **args('*i32', 'cu_seqlens chunk_indices'),
             **args('fp32', 'scale lower_bound'), **args('i32', 'T N H HV TUNE_SIZE')}
    c = dict(K=K, BT=64, BC=16, BK=BK,
             USE_GATE=True, HAS_A_LOG=True, HAS_DT_BIAS=True, HAS_LOWER_BOUND=False, USE_L2NORM=True,
             USE_BETA_SIGMOID=True, ALLOW_NEG_EIGVAL=False, IS_VARLEN=False, PREC='ieee' if dt=='fp32' else 'tf32',
             LOWP_DOT=dt!='fp32', INV_PREC='ieee' if dt=='fp32' else 'tf32x3', KD_T=wdt == 'bf16', SAVED_A=False,
             BOUNDED=False, DIAG=16,
             # 16-bit inputs with the in-op gate and l2norm: the gate's floor bounds the 16-row blocks (no exact path)
             EXACT=dt == 'fp32', G_FLOOR=G_MIN.value if dt == 'fp32' else G_MIN_16BIT.value)
    c.update(flags)
    tag = ('_saved' if c['SAVED_A'] else '') + ('_bounded' if c['BOUNDED'] else '') + f"_diag{c['DIAG']}"
    tag += '_exact' if c['EXACT'] and dt != 'fp32' else ''
    tag += f'_r{maxnreg}' if maxnreg else ''
    comp(chunk_kda_fwd_kernel_intra, types, c, w, 1, f"intra_{dt}_{wdt}_K{K}_bk{BK}_w{w}{tag}", maxnreg)


def wu(dt='bf16', K=128, V=128, w=4, s=1, BK=32, wdt=None):
    """The W / U kernel. wdt as for intra."""
    wdt = wdt or dt
    types = {**args(f'*{dt}', 'v beta'), **args('*fp32', 'beta_act gam'), **args(f'*{wdt}', 'Tm kbg W U qg kd'),
             **args('*i32', 'cu_seqlens chunk_indices'), **args('i32', 'T N HV TUNE_SIZE')}
    c = dict(K=K, V=V, BT=64, BK=BK, IS_VARLEN=False, USE_BETA_SIGMOID=True,
             ALLOW_NEG_EIGVAL=False, PREC='ieee' if dt=='fp32' else 'tf32', LOWP_DOT=wdt == 'bf16', KD_T=wdt == 'bf16')
    comp(chunk_kda_fwd_kernel_wu, types, c, w, s, f"wu_{dt}_{wdt}_K{K}_bk{BK}_w{w}_s{s}")


def state(dt='bf16', wdt='bf16', K=128, V=128, BV=32, w=8, s=2, **flags):
    """wdt: dtype of W, U, kd, qg, Aqk (bf16: the forward's lowp mode, kd^T per chunk (KD_T); fp32: the recompute)."""
    types = {**args(f'*{wdt}', 'W U kd qg Aqk'), **args('*fp32', 'gam h0 ht'), **args(f'*{dt}', 'o h vn'),
             **args('*i32', 'cu_seqlens chunk_offsets'), **args('i32', 's_h0n s_h0h s_h0k T HV TUNE_SIZE')}
    c = dict(K=K, V=V, BT=64, BK=max(16, triton.next_power_of_2(K)), BV=BV, USE_H0=True, STORE_O=True, STORE_H=False,
             STORE_VN=False, STORE_HT=True, IS_VARLEN=False, UPCAST=False, PREC='ieee' if dt=='fp32' else 'tf32',
             KD_T=wdt == 'bf16', s_h0v=1)   # a contiguous h0: the JIT specialises its unit stride
    c.update(flags)
    comp(chunk_kda_fwd_kernel_state, types, c, w, s,
         f"state_{wdt}_K{K}_bv{BV}_w{w}_s{s}" + ("_h" if c['STORE_H'] else ""))


def state_bwd(wdt='fp32', K=128, BV=32, w=8, s=1):
    """The reverse state pass; wdt: dtype of qg, kd, W, Aqk (bf16: the recompute of a bf16 forward; fp32 otherwise)."""
    types = {**args(f'*{wdt}', 'qg kd W Aqk'), **args('*fp32', 'gam dht dh0'), **args('*bf16', 'do dh dvn'),
             **args('*i32', 'cu_seqlens chunk_offsets'), **args('i32', 's_dhn s_dhh s_dhk T HV TUNE_SIZE')}
    c = dict(K=K, V=K, BT=64, BK=max(16, triton.next_power_of_2(K)), BV=BV, USE_DHT=True, STORE_DH0=True,
             IS_VARLEN=False, PREC='tf32', LOWP_DOT=True, s_dhv=1)
    c['KD_T'] = wdt == 'bf16'
    comp(chunk_kda_bwd_kernel_state, types, c, w, s, f"state_bwd_{wdt}_K{K}_bv{BV}_w{w}_s{s}")


def inter(wdt='fp32', K=128, BK=64, BV=32, w=4, s=3):
    """The backward's inter kernel; wdt: dtype of Tm (bf16: the recompute in the forward's storage)."""
    types = {**args('*bf16', 'q k v h vn do dh dvn dv'), **args('*fp32', 'rq rk gam beta dq dk dgam dAqk dM dbeta'),
             **args(f'*{wdt}', 'Tm'), **args('*i32', 'cu_seqlens chunk_indices'), **args('fp32', 'scale'),
             **args('i32', 'T N H HV TUNE_SIZE')}
    c = dict(K=K, V=K, BT=64, BK=BK, BV=BV, USE_L2NORM=True, IS_VARLEN=False, PREC='tf32', LOWP_DOT=True)
    comp(chunk_kda_bwd_kernel_inter, types, c, w, s, f"inter_{wdt}_K{K}_bk{BK}_bv{BV}_w{w}_s{s}")


def intra_bwd(dt='bf16', K=128, BK=32, w=4, s=1, maxnreg=None, **flags):
    """The backward row-block kernel (q, k in dt; gam, dAqk, dM, dq, dk, dgam fp32)."""
    types = {**args(f'*{dt}', 'q k beta beta_raw dbeta'), **args('*fp32', 'rq rk gam dAqk dM dq dk dgam dbeta_p'),
             **args('*i32', 'cu_seqlens chunk_indices'), **args('i32', 'T N H HV TUNE_SIZE')}
    c = dict(K=K, BT=64, BC=16, BK=BK, USE_L2NORM=True, USE_BETA_SIGMOID=True, ALLOW_NEG_EIGVAL=False, IS_VARLEN=False,
             PREC='ieee' if dt=='fp32' else 'tf32', BOUNDED=False)
    c.update(flags)
    comp(chunk_kda_bwd_kernel_intra, types, c, w, s,
         f"intra_bwd_{dt}_K{K}_bk{BK}_w{w}_s{s}" + ('_bounded' if c['BOUNDED'] else ''), maxnreg)


def gate_bwd(dt='bf16', K=128, w=4, **flags):
    """The backward cumsum / gate kernel (its launcher's BK and num_warps; lower_bound form with USE_LOWER_BOUND)."""
    types = {**args('*fp32', 'dgam A_log dt_bias dA_log_p ddt_bias_p'), **args(f'*{dt}', 'g_raw dg'),
             **args('*i32', 'cu_seqlens chunk_indices'), **args('fp32', 'lower_bound'), **args('i32', 'T N HV')}
    c = dict(K=K, BT=64, BK=min(32, max(16, triton.next_power_of_2(K))), USE_GATE=True, USE_LOWER_BOUND=False,
             HAS_ALOG=True, HAS_BIAS=True, IS_VARLEN=False, G_FLOOR=G_MIN_16BIT.value)
    c.update(flags)
    comp(chunk_kda_bwd_kernel_gate, types, c, w, 1,
         f"gate_bwd_{dt}_K{K}_bk{c['BK']}_w{w}" + ('_lb' if c['USE_LOWER_BOUND'] else ''))


def configs(kernel):
    """(BV, num_warps, num_stages) of every autotune config of the state kernel (KDA_OPS_AUTOTUNE must not be 0)."""
    return [(cf.kwargs['BV'], cf.num_warps, cf.num_stages) for cf in kernel.configs]

PATHS = '--paths' in sys.argv
SASS = '--sass' in sys.argv or PATHS

if __name__ == '__main__':
    argv = sys.argv[1:]
    if '--tree' in argv:
        del argv[argv.index('--tree'):argv.index('--tree') + 2]
    what = [w for w in argv if w not in ('--sass', '--paths')] or ['intra', 'wu', 'state']
    print(f"kda_ops from {os.path.dirname(os.path.dirname(sys.modules['kda_ops'].__file__))}")
    if 'intra' in what:
        intra(); intra(w=8); intra(wdt='fp32'); intra(K=256); intra(K=100); intra('fp32', K=100)
        # with the exact path (16-bit inputs without the in-op gate or l2norm)
        intra(EXACT=True, G_FLOOR=G_MIN.value)
        # the backward's recompute with the forward's Aqk, Tm: its own autotuner's configs, and BK 64 / 8 warps
        # without the register cap
        for cf in chunk_kda_fwd_kernel_intra_rerun.configs:
            intra(BK=cf.kwargs['BK'], w=cf.num_warps, maxnreg=cf.maxnreg, SAVED_A=True)
        intra(BK=64, w=8, SAVED_A=True)
        intra(K=256, SAVED_A=True); intra('fp32', K=100, SAVED_A=True)
        # the safe gate: lower_bound = -5 (32-row halves, fwd_intra.diagonal_rows), -5.1 (16-row blocks)
        for diag in (32, 16):
            for w in (4, 8):
                intra(w=w, HAS_LOWER_BOUND=True, BOUNDED=True, DIAG=diag)
    if 'wu' in what:
        for (BK, w, st) in [(cf.kwargs['BK'], cf.num_warps, cf.num_stages) for cf in chunk_kda_fwd_kernel_wu.configs]:
            for K in (128, 256, 100):
                wu(K=K, V=K, BK=BK, w=w, s=st)
            wu(wdt='fp32', BK=BK, w=w, s=st)
    if 'state_bwd' in what:
        for K in (128, 100, 256):
            for (BV, w, s) in configs(chunk_kda_bwd_kernel_state):
                for wdt in ('fp32', 'bf16'):
                    state_bwd(wdt, K=K, BV=BV, w=w, s=s)
    if 'inter' in what:
        for cf in chunk_kda_bwd_kernel_inter.configs:      # BK and BV autotuned
            for wdt in ('bf16', 'fp32'):
                inter(wdt, BK=cf.kwargs['BK'], BV=cf.kwargs['BV'], w=cf.num_warps, s=cf.num_stages)
    if 'intra_bwd' in what:
        for cf in chunk_kda_bwd_kernel_intra.configs:
            for dt, K in (('bf16', 128), ('bf16', 256), ('fp32', 128), ('bf16', 80)):
                intra_bwd(dt, K=K, BK=cf.kwargs['BK'], w=cf.num_warps, s=cf.num_stages, maxnreg=cf.maxnreg)
            intra_bwd(BK=cf.kwargs['BK'], w=cf.num_warps, s=cf.num_stages, maxnreg=cf.maxnreg, BOUNDED=True)
        gate_bwd(); gate_bwd(USE_LOWER_BOUND=True); gate_bwd(K=256)
    if 'state' in what:
        for K in (128, 256, 64, 100):
            for (BV, w, s) in configs(chunk_kda_fwd_kernel_state):
                state(K=K, V=K, BV=BV, w=w, s=s)
        state(wdt='fp32', STORE_O=False, STORE_H=True, STORE_VN=True, s=1)
        # the same pass on the forward's bf16 storage (the backward's recompute)
        state(wdt='bf16', STORE_O=False, STORE_H=True, STORE_VN=True, s=1)
        state(wdt='bf16', STORE_O=False, STORE_H=True, STORE_VN=True, BV=64, s=1)
        state(wdt='fp32', STORE_O=False, STORE_H=True, STORE_VN=True, BV=64, s=1)
        state(wdt='fp32', STORE_O=False, STORE_H=True, STORE_VN=True, BV=16, s=1)
        state(wdt='fp32', STORE_O=False, STORE_H=True, STORE_VN=True, s=2)
    if OUT:
        print(f"cubins (for cuobjdump -sass): {OUT}")
