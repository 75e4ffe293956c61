"""Seed 003's DeepSpeed samples (examples/seed_deepspeed/, only the import changed) run under shardwise.

Each runs on 2 gloo ranks as `shardwise run --nproc-per-node 2` would start it. The data-parallel sample
feeds the same rows on every rank (seeded here), so its one step equals one process's; the pipeline sample
runs its 100 `train_batch()` calls on 2 stages with its fp16 (and asks for the 'hccl' backend: the device's
is used, with a warning); the scheduler sample steps WarmupLR twice per step, as it does under DeepSpeed.
"""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch

from shardwise.testing import run_distributed

SEEDS = Path(__file__).resolve().parents[1] / "examples" / "seed_deepspeed"


def run_seed(name: str) -> dict:
    torch.manual_seed(0)  # the samples draw their data unseeded: the same rows on every rank
    found = runpy.run_path(str(SEEDS / name), run_name="__main__")
    engine = found["model_engine"]
    scheduler = found.get("lr_scheduler")
    return {"loss": float(found["loss"]), "state": engine.module_state_dict(), "steps": engine.global_steps,
            "lr": engine.get_lr()[0], "schedule_steps": scheduler.last_epoch if scheduler is not None else None}


def test_data_parallel_sample_steps_as_one_process():
    want = run_distributed(run_seed, 1, "data_parallel.py")[0]
    ranks = run_distributed(run_seed, 2, "data_parallel.py")
    for got in ranks:
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6) and got["steps"] == 1
        for name, value in want["state"].items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6)


def test_pipeline_sample_trains_on_two_stages():
    ranks = run_distributed(run_seed, 2, "pipeline.py", timeout=300)
    assert [got["steps"] for got in ranks] == [100, 100]
    assert ranks[0]["loss"] == ranks[1]["loss"] and math.isfinite(ranks[0]["loss"])


def test_scheduler_sample_steps_the_schedule_twice_as_deepspeed_does():
    ranks = run_distributed(run_seed, 2, "scheduler.py")
    for got in ranks:
        assert got["steps"] == 1 and got["schedule_steps"] == 2
        # WarmupLR (log) from 0.001 to 0.01 over 100 steps, at DeepSpeed's iteration 1
        assert got["lr"] == pytest.approx(0.001 + 0.009 * math.log(2) / math.log(100))
