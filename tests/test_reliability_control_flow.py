"""Divergent control flow found at the @step boundary (`control_flow_check_interval`, runtime/control_flow.py).

TinyStack under DDP in a 2-rank gloo world, two microbatches per @step, AdamW;
DDP syncs gradients only after the last microbatch, so in both faults below the
collectives still pair up and, unchecked, training would go on summing different
work on each rank:

- rank 1 skips the model's forward (and backward) in one microbatch of step 1;
- rank 1 accumulates step 1 over two @step calls before its optimizer step.

With the check every call, both ranks stop with one line naming the count and the
ranks that differ; without faults, the checked run trains as one plain process on
the same global batches. An asynchronous checkpoint saved after step 0, still being
written when rank 1 diverges, is then complete and reads back as saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.runtime.control_flow import ControlFlowMismatchError
from shardwise.testing import run_distributed
from tiny_models import (assert_checkpoints_intact, build, dataset, loss_fn, make_optimizer, relative_error,
                         train_reference)

STEPS, ROWS, WORLD, MICROBATCHES = 3, 4, 2, 2
FAULTY = 1  # the step in which rank 1 diverges


def train(fault: str | None, checkpoints: str) -> dict:
    """STEPS steps with the check at every @step call; rank 1 commits `fault` in step FAULTY. Before it, an
    asynchronous save of checkpoint `step1` to `checkpoints` (`saved`: what it holds)."""
    sw.init({"microbatches": MICROBATCHES, "control_flow_check_interval": 1})
    model = sw.DistributedModel(build("stack"))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    data = dataset("stack", STEPS * ROWS * WORLD)
    diverge = {"now": False, "microbatches": 0}
    saved = {}

    @sw.step
    def train_step(model, inputs, targets):
        first = diverge["microbatches"] % MICROBATCHES == 0
        diverge["microbatches"] += 1
        if diverge["now"] and fault == "skip-forward" and first:
            return torch.zeros(())  # this microbatch never calls the model
        loss = loss_fn("stack", model, inputs, targets)
        model.backward(loss)
        return loss

    try:
        for index in range(STEPS):
            diverge["now"] = index == FAULTY and sw.rank() == 1
            start = (index * WORLD + sw.dp_rank()) * ROWS
            optimizer.zero_grad()
            train_step(model, *data[start:start + ROWS])
            if diverge["now"] and fault == "extra-call":
                train_step(model, *data[start:start + ROWS])
            optimizer.step()
            if index == FAULTY - 1:
                sw.save_checkpoint(checkpoints, "step1", async_save=True)
                saved["step1"] = {name: value.clone() for name, value in model.full_state_dict().items()}
    except ControlFlowMismatchError as error:
        return {"error": str(error), "at": index, "saved": saved}
    return {"error": None, "state": model.full_state_dict(), "saved": saved}


def train_and_check(fault: str | None, tmp_path: Path) -> list[dict]:
    """`train` on WORLD ranks; then the checkpoint saved before the fault must be intact."""
    ranks = run_distributed(train, WORLD, fault, str(tmp_path / "ckpt"), timeout=300)
    assert_checkpoints_intact(tmp_path / "ckpt", ranks[0]["saved"], tmp_path)
    return ranks


def test_checked_run_without_faults_trains_as_one_process(tmp_path):
    want = train_reference("stack", "adamw", STEPS, ROWS * WORLD)["state"]
    for result in train_and_check(None, tmp_path):
        assert result["error"] is None
        for name, value in want.items():
            assert relative_error(result["state"][name], value) < 1e-5, name


@pytest.mark.parametrize("fault, at, line", [
    ("skip-forward", [FAULTY, FAULTY], "@step train_step: ranks ran different work in call 2: model forward calls per rank "
                             "[2, 1] (ranks [1] differ from rank 0); fix: "),
    # rank 1's extra call meets rank 0's call in the next step
    ("extra-call", [FAULTY + 1, FAULTY], "@step train_step: ranks ran different work in call 3: optimizer steps taken per rank "
                               "[2, 1] (ranks [1] differ from rank 0); fix: "),
])
def test_a_rank_that_diverges_is_named_at_the_step_boundary(fault, at, line, tmp_path):
    ranks = train_and_check(fault, tmp_path)
    assert [result["at"] for result in ranks] == at
    for result in ranks:
        assert result["error"].startswith(line) and "\n" not in result["error"]
