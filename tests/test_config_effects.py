"""Settings that change nothing in the chosen layout are named: in one warning at `init` (rank 0) and in
the same notice from `check-config`, each with what it needs."""

from __future__ import annotations

import warnings

import pytest

import shardwise as sw
from shardwise.cli import main
from shardwise.config import IneffectiveSettingsWarning, ineffective_notice, ineffective_settings, parse_config

HEAD = "these settings have no effect in this layout: "
FIX = "; fix: remove them, or set what they need"

CASES = {
    "pipeline keys without pipeline stages": (
        {"pipeline_schedule": "gpipe", "virtual_stages": 1, "pipeline_balance": "compute",
         "pipeline_split_points": [2], "microbatches": 2, "active_microbatches": 1, "auto_partition": False},
        [(key, "needs pipeline_parallel_degree > 1") for key in
         ("pipeline_schedule", "virtual_stages", "pipeline_balance", "pipeline_split_points", "active_microbatches",
          "auto_partition")]),
    "balance with a manual cut": (
        {"pipeline_parallel_degree": 2, "pipeline_split_points": [2], "pipeline_balance": "compute"},
        [("pipeline_balance", "pipeline_split_points fixes the cut")]),
    "balance with every block placed by hand": (
        {"pipeline_parallel_degree": 2, "auto_partition": False, "pipeline_balance": "compute"},
        [("pipeline_balance", "auto_partition false places every block by hand or on default_partition")]),
    "default partition under the automatic cut": (
        {"pipeline_parallel_degree": 2, "default_partition": 1},
        [("default_partition", "places the modules not placed by hand only when auto_partition is false")]),
    "1f1b already bounds what is in flight": (
        {"pipeline_parallel_degree": 2, "microbatches": 4, "active_microbatches": 2},
        [("active_microbatches", "1f1b runs rounds of 4 microbatches with or without it")]),
    "prescaled batch without tensor parallelism": (
        {"prescaled_batch": True}, [("prescaled_batch", "needs tensor_parallel_degree > 1")]),
    "loading horizon without offload": (
        {"activation_loading_horizon": 2}, [("activation_loading_horizon", "needs offload_activations")]),
    "wrap size without ZeRO-2/3": (
        {"shard_optimizer_state": True, "auto_wrap_min_params": 1000},
        [("auto_wrap_min_params", "sizes ZeRO-2/3 sharding units; needs zero_stage 2 or 3")]),
    "MiCS's cross-group options without partition groups": (
        {"cross_group_reduce_dtype": "bf16", "cross_group_overlap": "forward"},
        [(key, "needs MiCS without a pipeline: sharded_data_parallel_degree > 1 and smaller than the data-parallel "
               "degree, pipeline_parallel_degree 1") for key in ("cross_group_reduce_dtype", "cross_group_overlap")]),
}

EFFECTIVE = [
    {},
    {"zero_stage": 0},
    {"pipeline_schedule": "1f1b", "pipeline_balance": "parameters", "activation_loading_horizon": 4},  # defaults
    {"pipeline_parallel_degree": 2, "microbatches": 8, "active_microbatches": 2, "pipeline_schedule": "gpipe",
     "pipeline_balance": "compute"},  # 2 in flight, where SMP's default (pp + 2) holds 4
    {"pipeline_parallel_degree": 4, "microbatches": 4, "active_microbatches": 2},
    {"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 1},  # SMP's manual placement
    {"tensor_parallel_degree": 2, "prescaled_batch": True},
    {"sharded_data_parallel_degree": 2, "auto_wrap_min_params": 1000},
    {"sharded_data_parallel_degree": 2, "cross_group_reduce_dtype": "bf16", "cross_group_overlap": "forward"},
]


@pytest.mark.parametrize("case", CASES)
def test_each_setting_without_effect_is_named_with_what_it_needs(case):
    config, expected = CASES[case]
    assert ineffective_settings(parse_config(config)) == expected


@pytest.mark.parametrize("config", EFFECTIVE)
def test_settings_that_act_are_not_named(config):
    assert ineffective_settings(parse_config(config)) == []
    assert ineffective_notice(parse_config(config)) is None


def test_the_notice_is_one_line_naming_every_key():
    notice = ineffective_notice(parse_config({"prescaled_batch": True, "activation_loading_horizon": 2}))
    assert notice == (HEAD + "prescaled_batch (needs tensor_parallel_degree > 1), "
                      "activation_loading_horizon (needs offload_activations)" + FIX)


def test_init_warns_once_with_the_notice(monkeypatch):
    for name in ("WORLD_SIZE", "MASTER_ADDR", "SHARDWISE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    try:
        with pytest.warns(IneffectiveSettingsWarning) as caught:
            sw.init({"prescaled_batch": True})
    finally:
        sw.shutdown()
    assert [str(w.message) for w in caught] == [HEAD + "prescaled_batch (needs tensor_parallel_degree > 1)" + FIX]
    assert caught[0].filename == __file__  # points at the user's init() call


def test_init_is_quiet_when_every_setting_acts(monkeypatch):
    for name in ("WORLD_SIZE", "MASTER_ADDR", "SHARDWISE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", IneffectiveSettingsWarning)
            sw.init({"microbatches": 2})
    finally:
        sw.shutdown()


def test_check_config_prints_the_same_notice_and_exits_0(capsys):
    code = main(["check-config", "--nproc-per-node", "4", "--set", "prescaled_batch=true",
                 "--set", "pipeline_schedule=gpipe"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "layout: pp=1 × dp_replicate=4 × dp_shard=1 × tp=1" in out
    assert err == ("shardwise check-config: warning: " + HEAD + "pipeline_schedule (needs pipeline_parallel_degree "
                   "> 1), prescaled_batch (needs tensor_parallel_degree > 1)" + FIX + "\n")


def wrapped_warnings(monkeypatch, config: dict, build) -> list[str]:
    """The IneffectiveSettingsWarnings `DistributedModel` gives for the model `build()` returns, in one process."""
    for name in ("WORLD_SIZE", "MASTER_ADDR", "SHARDWISE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    sw.init(config)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", IneffectiveSettingsWarning)
            sw.DistributedModel(build())
    finally:
        sw.shutdown()
    return [str(w.message) for w in caught if w.category is IneffectiveSettingsWarning]


def test_the_model_names_what_only_it_makes_ineffective(monkeypatch):
    """delayed_parameter_initialization for a model built on a real device; auto_wrap_min_params for a model
    whose own blocks are its sharding units (the size threshold is for models without)."""
    from tiny_models import tiny_gpt2

    got = wrapped_warnings(monkeypatch, {"zero_stage": 3, "auto_wrap_min_params": 1000,
                                         "delayed_parameter_initialization": True}, tiny_gpt2)
    assert got == [HEAD + "delayed_parameter_initialization (needs the model built inside "
                   "sw.delay_param_initialization()), auto_wrap_min_params (GPT2LMHeadModel is sharded by its own "
                   "blocks)" + FIX]


def test_the_size_threshold_acts_on_a_model_without_blocks(monkeypatch):
    from torch import nn

    build = lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))  # noqa: E731
    assert wrapped_warnings(monkeypatch, {"zero_stage": 3, "auto_wrap_min_params": 16}, build) == []
