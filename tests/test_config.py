"""The engine configuration is declared once: flags, LLM(...) keywords and YAML keys come from it."""

from __future__ import annotations

import argparse

import pytest

from tokenmill.config import EngineConfig, add_engine_args, config_from_args, engine_settings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_setting_has_a_flag_help_and_a_group() -> None:
    text = parser().format_help()
    for s in engine_settings():
        assert s.help and s.flag in text, s.name
    groups = {s.group for s in engine_settings()}
    assert groups == {"model", "quantization", "device", "cache", "scheduler", "parallel", "speculative"}
    names = [s.name for s in engine_settings()]
    assert len(names) == len(set(names)), "flat setting names must be unique across groups"


def test_flags_round_trip_to_the_config() -> None:
    args = parser().parse_args(["--dtype", "float32", "--kv-cache-memory", "1GiB", "--no-prefix-caching",
                                "--max-num-seqs", "3", "--no-native-kernels", "--model", "/x.gguf"])
    config = config_from_args(args)
    assert config.model.dtype == "float32" and config.model.model == "/x.gguf"
    assert config.cache.kv_cache_memory == 2**30 and config.cache.enable_prefix_caching is False
    assert config.scheduler.max_num_seqs == 3 and config.device.native_kernels is False
    assert config_from_args(parser().parse_args([])) == EngineConfig()


def test_flat_settings_replace_and_errors() -> None:
    config = EngineConfig.from_kwargs(max_num_batched_tokens=64, kv_cache_memory="512MiB")
    assert config.scheduler.max_num_batched_tokens == 64 and config.cache.kv_cache_memory == 512 * 2**20
    assert config.replace(max_num_seqs=2).flat() == {**config.flat(), "max_num_seqs": 2}
    with pytest.raises(TypeError, match=r"unknown engine setting\(s\) \['max_seqs'\]"):
        EngineConfig.from_kwargs(max_seqs=2)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig.from_kwargs(dtype="int3")
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        EngineConfig.from_kwargs(max_num_seqs=0)


def test_environment_overrides_are_field_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_KERNELS", "0")
    monkeypatch.setenv("TOKENMILL_PACK_WEIGHTS", "false")
    config = EngineConfig()
    assert config.device.native_kernels is False and config.device.pack_weights is False
    assert EngineConfig.from_kwargs(native_kernels=True).device.native_kernels is True  # an explicit value wins
    monkeypatch.delenv("TOKENMILL_KERNELS")
    assert EngineConfig().device.native_kernels is True


def test_llm_documents_every_setting() -> None:
    from tokenmill.llm import LLM

    for s in engine_settings():
        if s.name != "model":
            assert f"{s.name} (default" in LLM.__doc__


def test_scheduling_policy_flags_and_checks() -> None:
    from tokenmill.config import engine_args

    config = config_from_args(parser().parse_args(["--scheduling-policy", "priority", "--priority-aging", "30"]))
    assert (config.scheduler.scheduling_policy, config.scheduler.priority_aging) == ("priority", 30.0)
    assert engine_args(config) == ["--scheduling-policy", "priority", "--priority-aging", "30.0"]
    assert EngineConfig().scheduler.scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parser().parse_args(["--scheduling-policy", "lifo"])
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig.from_kwargs(scheduling_policy="sjf")
    with pytest.raises(ValueError, match="priority_aging must be a positive number of seconds"):
        EngineConfig.from_kwargs(scheduling_policy="priority", priority_aging=0)
    with pytest.raises(ValueError, match="priority_aging applies to --scheduling-policy priority only"):
        EngineConfig.from_kwargs(priority_aging=5)
    bound = config_from_args(parser().parse_args(["--scheduling-policy", "priority", "--priority-step-fraction", "0"]))
    assert bound.scheduler.priority_step_fraction == 0.0 and EngineConfig().scheduler.priority_step_fraction == 0.0
    assert config_from_args(parser().parse_args(["--priority-step-fraction", "0.25"])).scheduler.priority_step_fraction \
        == 0.25
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="priority_step_fraction must be a number >= 0"):
            EngineConfig.from_kwargs(scheduling_policy="priority", priority_step_fraction=bad)
    cut = config_from_args(parser().parse_args(["--scheduling-policy", "priority", "--priority-step-fraction", "0.25",
                                                "--priority-interrupt"]))
    assert cut.scheduler.priority_interrupt and not EngineConfig().scheduler.priority_interrupt
    assert "--priority-interrupt" in engine_args(cut)
    with pytest.raises(ValueError, match="priority_interrupt applies to --scheduling-policy priority only"):
        config_from_args(parser().parse_args(["--priority-interrupt"]))
    with pytest.raises(ValueError, match="priority_interrupt needs the step bound"):
        config_from_args(parser().parse_args(["--scheduling-policy", "priority", "--priority-interrupt"]))


def test_slo_targets_are_settings_of_either_policy() -> None:
    config = config_from_args(parser().parse_args(["--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--slo-reject"]))
    assert (config.scheduler.slo_ttft_ms, config.scheduler.slo_tpot_ms) == (1000.0, 100.0)
    assert config.scheduler.slo_reject and not EngineConfig.from_kwargs().scheduler.slo_reject
    with pytest.raises(ValueError, match="slo_tpot_ms must be a positive number of milliseconds"):
        EngineConfig.from_kwargs(slo_tpot_ms=0)
    config = EngineConfig.from_kwargs(slo_ttft_ms=500, scheduling_policy="priority")
    assert config.scheduler.slo_ttft_ms == 500
