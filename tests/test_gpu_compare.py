"""gpu_compare.fla_first_configs on the CPU: an autotuner in an FLA module keeps only its first (pruned) config
inside the block, and its own configs and tuned keys after it."""
from __future__ import annotations

import sys
import types

import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from gpu_compare import fla_autotuners, fla_first_configs


@triton.jit
def _copy(x, y, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o, mask=o < N), mask=o < N)


def test_first_configs_inside_the_block_only(monkeypatch):
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32, 64) for w in (1, 2)]
    tuner = triton.autotune(configs=configs, key=["N"],
                            prune_configs_by={"early_config_prune": lambda cs, nargs, **kw: cs[2:]})(_copy)
    other = triton.autotune(configs=configs, key=["N"])(_copy)
    assert isinstance(tuner, Autotuner)
    fake = types.ModuleType("fla.ops.fake_for_test")
    fake.kernel, fake.wrapped = tuner, types.SimpleNamespace(fn=other)
    monkeypatch.setitem(sys.modules, "fla.ops.fake_for_test", fake)
    monkeypatch.setitem(sys.modules, "not_fla_fake", types.SimpleNamespace(kernel=_copy))
    assert {id(t) for t in fla_autotuners()} >= {id(tuner), id(other)}
    tuner.nargs = {}
    tuner.cache[(7,)] = configs[5]
    with fla_first_configs():
        assert tuner.prune_configs({}) == [configs[2]]      # the first that the kernel's own pruning keeps
        assert other.prune_configs({}) == [configs[0]]
        assert tuner.cache == {}                            # tuned again, on that config
        tuner.cache[(8,)] = configs[2]
    assert tuner.prune_configs({}) == configs[2:]
    assert other.prune_configs({}) == configs
    assert tuner.cache == {(7,): configs[5]}
    with fla_first_configs():                               # the block's own tuned keys come back
        assert tuner.cache == {(8,): configs[2]}
    assert "prune_configs" not in tuner.__dict__


def test_env_keeps_fla_tuning(monkeypatch):
    tuner = triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["N"])(_copy)
    tuner.nargs = {}
    fake = types.ModuleType("fla.ops.fake_for_test")
    fake.kernel = tuner
    monkeypatch.setitem(sys.modules, "fla.ops.fake_for_test", fake)
    monkeypatch.setenv("KDA_OPS_FLA_AUTOTUNE", "1")
    with fla_first_configs():
        assert len(tuner.prune_configs({})) == 2
