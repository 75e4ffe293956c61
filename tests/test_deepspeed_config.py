"""DeepSpeed configs (config/deepspeed.py) and what they build (api/configured.py).

- Seed 003's DeepSpeed configs (bf16 for fp16 on CPU) train TinyStack in a 2-rank world to the same losses
  as the equivalent shardwise config with a hand-built torch optimizer and schedule;
- an inconsistent batch triple is one ConfigError naming train_batch_size with the arithmetic, found
  where the data-parallel degree is known (run, init, check-config);
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
from shardwise.config import ConfigError, IneffectiveSettingsWarning, load_dict
from shardwise.config.deepspeed import is_deepspeed, translate
from shardwise.config.schema import SchedulerBlock
from shardwise.runtime import state
from shardwise.testing import run_distributed
from shardwise.topology import Cluster
from shardwise.topology.layout import validate
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


def test_inconsistent_batch_triple_shows_the_arithmetic():
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError) as error:
        validate(load_dict(config), Cluster(1, 2))
    assert ("train_batch_size=32: train_batch_size 32 != micro 4 x gradient_accumulation_steps 2 x "
            "data-parallel ranks 2 = 16; fix: set train_batch_size to 16") in str(error.value)
    validate(load_dict(config), Cluster(1, 4))  # 4 x 2 x 4 = 32
    with pytest.raises(ConfigError, match="train_batch_size 30 is not divisible by gradient_accumulation_steps 2 x "
                                          "data-parallel ranks 2 = 4"):
        validate(load_dict({"train_batch_size": 30, "gradient_accumulation_steps": 2}), Cluster(1, 2))


# Each key seed 003 shows that shardwise cannot honour, as it is written there.
UNHONOURED = {
    "autotuning": {"autotuning": {"enabled": True, "metric": "throughput"}},
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
                                "bf16": {"enabled": False}, **UNHONOURED["autotuning"]}))
    assert main(["check-config", "--config", str(path), "--nproc-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "microbatches = 2    <- gradient_accumulation_steps" in out
    assert "zero_stage = 2    <- zero_optimization.stage" in out
    assert "'scale_window': 500" in out and "'init_scale': 65536.0" in out and "'delayed_shift': 2" in out
    assert "not honoured:\n  autotuning: `shardwise plan`" in out
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
