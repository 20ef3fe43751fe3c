"""benchmarks/kernel_times.py's --pin: a config named as tune_sweep.py names it, parsed back and made the kernel's only
config (CPU)."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def load(name):
    spec = importlib.util.spec_from_file_location(f"kda_bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("spec", ["fwd_intra=BK16,w8,s1,r128", "fwd_state=BV64,w8,s3", "bwd_intra=BK128,w8,s1"])
def test_pin_round_trips_config_names(spec, monkeypatch):
    times, sweep = load("kernel_times"), load("tune_sweep")
    module, attr = sweep.TUNED[spec.partition("=")[0]]
    monkeypatch.setattr(getattr(module, attr), "configs", getattr(module, attr).configs)    # restored after
    kernel, config = times.pin(spec)
    assert kernel is getattr(module, attr)
    assert kernel.configs == [config]
    assert sweep.config_name(config) == spec.partition("=")[2]


@pytest.mark.parametrize("spec", ["nope=BK16,w4,s1", "fwd_intra=BK16,warps", "fwd_intra=BK16,w4,1"])
def test_pin_rejects_bad_specs(spec):
    with pytest.raises(SystemExit):
        load("kernel_times").pin(spec)
