"""Settings: every EDGEINFER_* variable read in one place, flags on top, bad values named."""
from __future__ import annotations

import math

import pytest

from edgeinfer.settings import Settings, SettingsError, parse_duration


def test_environment_values_and_defaults():
    s = Settings.from_env({})
    assert s.backend == "cpu" and s.kv_budget_bytes == 1 << 30 and s.repack is None
    assert s.threads is None and s.batch_invariant is False and s.keep_alive == 300.0
    s = Settings.from_env({"EDGEINFER_KV_BUDGET_MB": "64", "EDGEINFER_THREADS": "2",
                           "EDGEINFER_REPACK": "0", "EDGEINFER_BATCH_INVARIANT": "1",
                           "EDGEINFER_KEEP_ALIVE": "1h30m", "EDGEINFER_HOME": "~/x",
                           "EDGEINFER_TORCH_DTYPE": "bfloat16", "HF_TOKEN": "t"})
    assert s.kv_budget_bytes == 64 << 20 and s.threads == 2 and s.repack is False
    assert s.batch_invariant is True and s.keep_alive == 5400.0 and s.home.name == "x"
    assert s.torch_dtype == "bfloat16" and s.hf_token == "t"


def test_flags_override_the_environment_and_none_means_not_given():
    s = Settings.from_env({"EDGEINFER_BACKEND": "llamacpp", "EDGEINFER_MAX_RUNNING_SEQS": "4"},
                          backend="torch", max_running_seqs=None)
    assert s.backend == "torch" and s.max_running_seqs == 4
    with pytest.raises(TypeError, match="unknown settings: nope"):
        Settings().with_overrides(nope=1)


@pytest.mark.parametrize("env, name", [
    ({"EDGEINFER_KV_BUDGET_MB": "lots"}, "EDGEINFER_KV_BUDGET_MB"),
    ({"EDGEINFER_THREADS": "-2"}, "EDGEINFER_THREADS"),
    ({"EDGEINFER_REPACK": "maybe"}, "EDGEINFER_REPACK"),
    ({"EDGEINFER_KEEP_ALIVE": "5 minutes"}, "EDGEINFER_KEEP_ALIVE"),
])
def test_bad_values_name_the_variable(env, name):
    with pytest.raises(SettingsError, match=name):
        Settings.from_env(env)


def test_durations():
    assert parse_duration("5m") == 300 and parse_duration(0) == 0
    assert parse_duration("-1") == math.inf and parse_duration("1h30m") == 5400
    with pytest.raises(ValueError):
        parse_duration(True)


def test_engine_config_carries_the_settings():
    from edgeinfer.engine.core import EngineConfig
    cfg = EngineConfig.from_settings(
        Settings.from_env({"EDGEINFER_REPACK": "1", "EDGEINFER_MAX_MODEL_LEN": "2048",
                           "EDGEINFER_THREADS": "1"}), "cpu")
    assert cfg.repack is True and cfg.max_model_len == 2048 and cfg.backend == "cpu"
    assert cfg.threads == 1 and cfg.torch_graphs is True
    off = EngineConfig.from_settings(Settings.from_env({"EDGEINFER_TORCH_GRAPHS": "0"}), "torch")
    assert off.torch_graphs is False


def test_torch_graphs_reach_the_ops():
    """EDGEINFER_TORCH_GRAPHS=0 -> make_ops(torch_graphs=False) -> TorchOps(graphs=False);
    on, the device decides (CUDA only)."""
    pytest.importorskip("torch")
    from edgeinfer.runners.native import make_ops
    assert make_ops("torch:cpu", torch_graphs=False).graphs is False
    assert make_ops("torch:cpu").graphs is False        # not on the CPU device
    with pytest.raises(SettingsError, match="EDGEINFER_TORCH_GRAPHS"):
        Settings.from_env({"EDGEINFER_TORCH_GRAPHS": "sometimes"})


def test_cli_reports_a_bad_setting_in_one_line(monkeypatch, capsys):
    from edgeinfer.cli.main import main
    monkeypatch.setenv("EDGEINFER_KV_BUDGET_MB", "lots")
    assert main(["list"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "edgeinfer: EDGEINFER_KV_BUDGET_MB='lots' is not a number"
