"""DeepSpeed configs (config/deepspeed.py) and what they build (api/configured.py).

- Seed 003's DeepSpeed configs (bf16 for fp16 on CPU) train TinyStack in a 2-rank world to the same losses
  as the equivalent shardwise config with a hand-built torch optimizer and schedule;
- the batch triple's missing value is worked out where the data-parallel degree is known (run, init,
  check-config), as DeepSpeed does; an inconsistent or indivisible one is one ConfigError naming
  train_batch_size with the arithmetic;
- the fp16 loss-scale keys set the scaler of a hand-built sw.DistributedOptimizer (its own arguments win),
  and are named as without effect without fp16;
- every key the translation cannot honour is listed (check-config's section, a warning at run);
- the schedules give DeepSpeed's learning rates after k steps.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import shardwise as sw
from shardwise.api.configured import (build_scheduler, configured_batch_size, configured_optimizer,
                                      configured_scheduler)
from shardwise.cli import main
from shardwise.config import ConfigError, IneffectiveSettingsWarning, ineffective_settings, load_dict, parse_config
from shardwise.config.deepspeed import is_deepspeed, translate
from shardwise.config.schema import SchedulerBlock
from shardwise.parallel.precision import ScalingRule
from shardwise.runtime import state
from shardwise.testing import run_distributed
from shardwise.topology import Cluster
from shardwise.config.layout import validate
from tiny_models import build, dataset, seed_step

WORLD, STEPS = 2, 4
ADAMW = {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.01}
# Seed 003's "模型配置" config, with bf16 for fp16 (CPU), and its scheduler example.
SEED_CONFIG = {
    "train_batch_size": 32, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": ADAMW},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 100}},
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "reduce_scatter": True,
                          "allgather_partitions": True},
}
SCHEDULER_EXAMPLE = {
    "train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                 "warmup_num_steps": 100}},
}
# The same runs in shardwise's own keys; the optimizer and schedule are built by hand in `train`.
EQUIVALENT = [({"train_batch_size": 32, "microbatches": 2, "bf16": True, "zero_stage": 2},
               dict(ADAMW, betas=(0.9, 0.999)), (0.0, 0.001)),
              ({"train_batch_size": 8}, {"lr": 0.01, "weight_decay": 0.0}, (0.001, 0.01))]


def _warmup_log(k: int, low: float, high: float, steps: int = 100) -> float:
    """DeepSpeed's WarmupLR after k steps (its iteration k - 1; before any step, warmup_min_lr)."""
    return low + (high - low) * math.log(max(k, 1)) / math.log(steps)


def train(config: dict, hand_built: tuple | None) -> dict:
    """STEPS steps of TinyStack on consecutive global batches; the optimizer and schedule from the config,
    or `hand_built` (AdamW arguments, warm-up range) with torch's AdamW and a LambdaLR of the same formula."""
    sw.init(config)
    try:
        model = sw.DistributedModel(build("stack"))
        if hand_built is None:
            optimizer = configured_optimizer(model)
            scheduler = configured_scheduler(optimizer)
        else:
            args, (low, high) = hand_built
            optimizer = sw.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **args))
            base = args["lr"]
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: _warmup_log(k, low, high) / base)
        batch = configured_batch_size()
        data = dataset("stack", STEPS * batch * sw.dp_size())
        train_step, losses = seed_step("stack"), []
        for step in range(STEPS):
            first = (step * sw.dp_size() + sw.dp_rank()) * batch
            optimizer.zero_grad()
            losses.append(train_step(model, *data[first:first + batch]).reduce_mean().item())
            optimizer.step()
            scheduler.step()
        return {"losses": losses, "lr": optimizer.param_groups[0]["lr"], "batch": batch}
    finally:
        state.set_current(None)  # the next config starts afresh on the same process group


def _runs(configs: list) -> list:
    return [train(config, hand_built) for config, hand_built in configs]


def test_seed_configs_train_as_their_shardwise_equivalents():
    configs = [(SEED_CONFIG, None), (EQUIVALENT[0][0], EQUIVALENT[0][1:]),
               (SCHEDULER_EXAMPLE, None), (EQUIVALENT[1][0], EQUIVALENT[1][1:])]
    ranks = run_distributed(_runs, WORLD, configs, timeout=240)
    for rank in ranks:
        seed, seed_same, example, example_same = rank
        assert seed["batch"] == 32 // WORLD and example["batch"] == 8 // WORLD
        for got, want in ((seed, seed_same), (example, example_same)):
            torch.testing.assert_close(got["losses"], want["losses"])
            assert got["lr"] == pytest.approx(want["lr"])
        assert example["lr"] == pytest.approx(_warmup_log(STEPS, 0.001, 0.01))
        assert example["losses"][-1] < example["losses"][0]  # it trains: the schedule's lr is not 0 there


# DeepSpeed's config -> (train_batch_size, train_micro_batch_size_per_gpu, microbatches) on 2 data-parallel ranks.
WORKED_OUT = {
    "accumulation": ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 4)),
    "micro batch": ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (32, 8, 2)),
    "total": ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (16, 4, 2)),
    "total alone": ({"train_batch_size": 32}, (32, 16, 1)),
    "micro alone": ({"train_micro_batch_size_per_gpu": 4}, (8, 4, 1)),
    "all three": ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                  (16, 4, 2)),
}


@pytest.mark.parametrize("case", WORKED_OUT)
def test_batch_triple_missing_value_is_worked_out(case):
    given, want = WORKED_OUT[case]
    config, _ = validate(load_dict(given), Cluster(1, 2))
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.microbatches) == want
    # still the user's keys alone, as the run directory records them: each rank works them out for its own world
    assert config.model_dump(exclude_unset=True) == load_dict(given)


# DeepSpeed's config on 2 data-parallel ranks -> the problem (path=value: rule; fix).
BATCH_ERRORS = {
    "inconsistent": ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                     "train_batch_size=32: train_batch_size 32 != micro 4 x gradient_accumulation_steps 2 x "
                     "data-parallel ranks 2 = 16; fix: set train_batch_size to 16"),
    "micro batch": ({"train_batch_size": 30, "gradient_accumulation_steps": 2},
                    "train_batch_size=30: train_batch_size 30 is not divisible by gradient_accumulation_steps 2 x "
                    "data-parallel ranks 2 = 4; fix: use a multiple of 4, or change gradient_accumulation_steps"),
    "accumulation": ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
                     "train_batch_size=30: train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 "
                     "x data-parallel ranks 2 = 8; fix: use a multiple of 8, or change train_micro_batch_size_per_gpu"),
    "total alone": ({"train_batch_size": 31},
                    "train_batch_size=31: train_batch_size 31 is not divisible by gradient_accumulation_steps 1 x "
                    "data-parallel ranks 2 = 2; fix: use a multiple of 2"),
}


@pytest.mark.parametrize("case", BATCH_ERRORS)
def test_batch_triple_that_does_not_divide_shows_the_arithmetic(case):
    given, message = BATCH_ERRORS[case]
    with pytest.raises(ConfigError) as error:
        validate(load_dict(given), Cluster(1, 2))
    assert message in str(error.value)


def test_worked_out_accumulation_meets_the_pipeline_rules():
    config = {"train_batch_size": 20, "train_micro_batch_size_per_gpu": 2, "pipeline_parallel_degree": 2,
              "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2}  # 20 / (2 x 2 dp ranks) = 5 microbatches
    with pytest.raises(ConfigError, match="microbatches=5: interleaved_1f1b runs microbatches in rounds of "
                                          "pipeline_parallel_degree"):
        validate(load_dict(config), Cluster(1, 4))
    assert validate(load_dict({**config, "train_batch_size": 16}), Cluster(1, 4))[0].microbatches == 4


def loss_scales(cases: list) -> list[dict]:
    """For each (config, DistributedOptimizer arguments): the loss scaler's rule and its scale after each of
    STEPS fp16 steps of TinyStack, the world's @step batch and microbatches, and the notes the optimizer gave."""
    results = []
    for config, args in cases:
        sw.init(config)
        try:
            model = sw.DistributedModel(build("stack"))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), **args)
            batch = configured_batch_size()
            data, train_step, scales = dataset("stack", STEPS * batch * sw.dp_size()), seed_step("stack"), []
            for step in range(STEPS):
                first = (step * sw.dp_size() + sw.dp_rank()) * batch
                optimizer.zero_grad()
                train_step(model, *data[first:first + batch])
                optimizer.step()
                scales.append(optimizer.loss_scale)
            results.append({"rule": model.loss_scaler.rule, "scales": scales, "batch": batch,
                            "microbatches": state.current().config.microbatches,
                            "notes": [str(w.message) for w in caught
                                      if issubclass(w.category, IneffectiveSettingsWarning)]})
        finally:
            state.set_current(None)
    return results


def test_fp16_loss_scale_keys_set_a_hand_built_distributed_optimizer():
    dynamic = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
               "fp16": {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 2}}
    static = {"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 128}}
    own_args = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 64}}
    ranks = run_distributed(loss_scales, WORLD, [(dynamic, {}), (static, {}), (static, own_args)], timeout=240)
    for from_dynamic, from_static, own in ranks:
        # DeepSpeed's defaults for the keys unset: hysteresis 2, min_loss_scale 1; growth after 2 finite steps
        assert from_dynamic["rule"] == ScalingRule(init_scale=1024.0, growth_interval=2, min_scale=1.0, hysteresis=2)
        assert from_dynamic["scales"] == [1024.0, 2048.0, 2048.0, 4096.0]
        assert (from_dynamic["batch"], from_dynamic["microbatches"]) == (4, 2)  # 8 = 2 x 2 worked out x 2 ranks
        assert from_static["scales"] == [128.0] * STEPS and from_static["rule"].static and not from_static["notes"]
        assert own["rule"].init_scale == 64.0 and not own["rule"].static  # the script's own arguments win
    assert ranks[0][2]["notes"] == ["these settings have no effect in this layout: loss_scale (the script's "
                                    "DistributedOptimizer arguments (dynamic_loss_scale, dynamic_loss_args) replace "
                                    "it); fix: remove them, or set what they need"]


def test_loss_scale_keys_without_fp16_are_named():
    config = {"loss_scale": 128, "dynamic_loss_args": {"scale_window": 2}}
    assert ineffective_settings(parse_config(config)) == [("loss_scale", "needs fp16"),
                                                          ("dynamic_loss_args", "needs fp16")]
    assert ineffective_settings(parse_config({**config, "fp16": True})) == [
        ("dynamic_loss_args", "loss_scale > 0 keeps the scale fixed")]
    assert ineffective_settings(parse_config({"fp16": True, "dynamic_loss_args": {"scale_window": 2}})) == []


# Each key seed 003 shows that shardwise cannot honour, as it is written there.
UNHONOURED = {
    "pipeline": {"pipeline": {"activation_checkpoint_interval": 1}},
    "flops_profiler.module_depth": {"flops_profiler": {"enabled": True, "module_depth": -1}},
    "flops_profiler.top_modules": {"flops_profiler": {"enabled": True, "top_modules": 3}},
    "comms_logger.verbose": {"comms_logger": {"enabled": True, "verbose": False}},
    "wandb.team": {"wandb": {"enabled": True, "team": "my_team", "project": "my_project"}},
    "activation_checkpointing.profile": {"activation_checkpointing": {"profile": True}},
    "zero_optimization.overlap_comm": {"zero_optimization": {"stage": 3, "overlap_comm": False}},
    "zero_optimization.reduce_bucket_size": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}},
    "fp16.auto_cast": {"fp16": {"enabled": True, "auto_cast": True}},
}


@pytest.mark.parametrize("key", sorted(UNHONOURED))
def test_each_untranslatable_key_is_listed(key):
    data = UNHONOURED[key]
    assert is_deepspeed(data)
    assert key in dict(translate(data).ignored)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_dict(data)
    assert any(key in str(w.message) for w in caught if issubclass(w.category, IneffectiveSettingsWarning))


def test_check_config_prints_the_translation(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**SEED_CONFIG, "fp16": {"enabled": True, "loss_scale_window": 500, "hysteresis": 2},
                                "bf16": {"enabled": False}, **UNHONOURED["pipeline"],
                                "autotuning": {"enabled": True, "metric": "throughput",
                                               "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"}}}))
    assert main(["check-config", "--config", str(path), "--nproc-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "microbatches = 2    <- gradient_accumulation_steps" in out
    assert "zero_stage = 2    <- zero_optimization.stage" in out
    assert "'scale_window': 500" in out and "'init_scale': 65536.0" in out and "'delayed_shift': 2" in out
    assert "autotuning.metric: read by shardwise tune --config as --metric" in out
    assert "autotuning.arg_mappings: read by shardwise tune --config as --arg-mapping" in out
    assert "not honoured:\n  pipeline" in out
    assert "data parallel: ZeRO-2; precision: fp16; microbatches: 2" in out
    path.write_text(json.dumps({**SEED_CONFIG, "train_micro_batch_size_per_gpu": 4}))
    assert main(["check-config", "--config", str(path), "--nproc-per-node", "2"]) == 2
    assert "train_batch_size 32 != micro 4 x gradient_accumulation_steps 2 x data-parallel ranks 2 = 16" in \
        capsys.readouterr().err


def _lrs(block: dict, ks: list[int], optimizer: str = "SGD") -> list[tuple[float, object]]:
    """(lr, betas) after each k in `ks` steps of the schedule `block`."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.5) if optimizer == "SGD" else torch.optim.Adam([param], lr=0.5)
    scheduler = build_scheduler(SchedulerBlock(**block), opt)
    seen, done = [], 0
    for k in ks:
        for _ in range(k - done):
            opt.step()
            scheduler.step()
        done = k
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0].get("betas")))
    return seen


def test_schedules_follow_deepspeeds_formulas():
    warmup = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 100}}
    # lr = min + (max - min) log(i + 1) / log(100) at DeepSpeed's iteration i = k - 1; min before the first step
    assert [lr for lr, _ in _lrs(warmup, [0, 1, 10, 100, 200])] == pytest.approx(
        [0.001, 0.001, 0.001 + 0.009 * 0.5, 0.01, 0.01])
    decay = {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_min_lr": 0.0, "warmup_max_lr": 1.0,
                                                 "warmup_num_steps": 10, "warmup_type": "linear"}}
    # i / 10 while warming up, then (20 - i) / (20 - 10), never below 0
    assert [lr for lr, _ in _lrs(decay, [5, 11, 16, 25])] == pytest.approx([0.4, 1.0, 0.5, 0.0])
    cycle = {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4,
                                            "decay_step_size": 2, "decay_lr_rate": 0.5}}
    # a triangle over 8 iterations (scale from (i + 1) / 8), then min / (1 + 0.5 (i - 8 + 1) / 2);
    # beta1 runs from 0.9 down to 0.8 and back as the lr rises and falls, beta2 is 0.99
    got = _lrs(cycle, [0, 2, 4, 6, 8, 12], optimizer="Adam")
    assert [lr for lr, _ in got] == pytest.approx([0.1, 0.55, 1.0, 0.55, 0.1, 0.05])
    assert [betas for _, betas in got[:3]] == [(0.8, 0.99), pytest.approx((0.85, 0.99)), pytest.approx((0.8, 0.99))]
    assert _lrs(cycle, [3])[0][1] is None  # SGD has no betas: its momentum is left alone, as DeepSpeed does
