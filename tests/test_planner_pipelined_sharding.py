"""ZeRO-2/3 under a pipeline reduce-scatter once per round, as the planner times them (timing.py): torch's
PipelineStage runs an FSDP2 stage's backward without gradient sync, keeps it gathered after backward and
reduce-scatters at the round's end. Every collective of two steps (four microbatches each, one round) on
PP 2 × ZeRO-2 over 2 ranks is counted and set beside the planner's count (without a pipeline the same model
and microbatches issue 24 of each: three units, every microbatch)."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import FSDPModule

import shardwise as sw
from shardwise.config import parse_config
from shardwise.planner import cluster_preset, predict_step_time, resolve_model
from shardwise.testing import run_distributed
from shardwise.topology import Layout
from test_mics_traffic import CollectiveRecorder
from tiny_models import build, dataset, loss_fn, make_optimizer

STEPS, MICROBATCHES, ROWS = 2, 4, 4
CONFIG = {"pipeline_parallel_degree": 2, "zero_stage": 2, "sharded_data_parallel_degree": 2,
          "microbatches": MICROBATCHES}


def _count(config: dict) -> tuple[int, dict[str, int]]:
    """This rank's FSDP2 units and its collectives of two steps, by op."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2"))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))

    @sw.step
    def train_step(model, inputs, targets):
        loss = loss_fn("gpt2", model, inputs, targets)
        model.backward(loss)
        return loss

    loader = sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS)
    with CollectiveRecorder() as recorder:
        for inputs, targets in loader:
            optimizer.zero_grad()
            train_step(model, inputs, targets)
            optimizer.step()
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    by_op: dict[str, int] = {}
    for (op, _), n in recorder.counts.items():
        by_op[op] = by_op.get(op, 0) + n
    return units, by_op


@pytest.fixture(scope="module")
def counted() -> list[tuple[int, dict[str, int]]]:
    return run_distributed(_count, 4, CONFIG, nproc_per_node=4, timeout=300)


def test_each_unit_gathers_and_reduce_scatters_once_a_step(counted):
    """Not once per microbatch (4 a step): a stage is one FSDP2 unit, which reduce-scatters once a step and gathers
    once a step (the first step once more)."""
    for units, by_op in counted:
        assert by_op.get("reduce_scatter_base", 0) == STEPS * units, by_op
        assert STEPS * units <= by_op.get("allgather_base", 0) <= STEPS * units + 1, by_op


def test_the_planner_counts_the_same_bytes_once_a_step():
    """The planner's reduce-scatter moves the stage's fp32 gradients once, its all-gather the parameters once."""
    spec = resolve_model("gpt2")
    config = parse_config(CONFIG)
    t = predict_step_time(spec, config, Layout(pp=2, dp_shard=2), cluster_preset("p4d.24xlarge", devices_per_node=4),
                          1, 64)
    params = spec.stage_parameters(2)
    moved = {c.name.split(" (")[0]: c.bytes_per_step for c in t.collectives}
    assert moved["gradient reduce-scatter"] == pytest.approx(4 * params)
    assert moved["parameter all-gather"] == pytest.approx(4 * params)
