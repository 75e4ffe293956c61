"""ZeRO-2/3 under a pipeline reduce-scatter once per round, as the planner times them (timing.py): torch's
PipelineStage runs an FSDP2 stage's backward without gradient sync, keeps it gathered after backward and
reduce-scatters at the round's end. Every collective of two steps (four microbatches each, one round) on
PP 2 × ZeRO-2 over 2 ranks is counted and set beside the planner's count (without a pipeline the same model
and microbatches issue 24 of each: three units, every microbatch); and what a stage holds mid-round, its
gradients whole and its parameters gathered, set beside the planner's memory."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from shardwise.config import parse_config
from shardwise.planner import cluster_preset, predict_memory, predict_step_time, resolve_model, spec_from_hf
from shardwise.testing import run_distributed
from shardwise.topology import Layout
from test_mics_traffic import CollectiveRecorder
from tiny_models import SEQ, tiny_gpt2, train_watched

STEPS, MICROBATCHES, ROWS = 2, 4, 4
CONFIG = {"pipeline_parallel_degree": 2, "zero_stage": 2, "sharded_data_parallel_degree": 2,
          "microbatches": MICROBATCHES}


def _count(config: dict) -> tuple[int, dict[str, int]]:
    """This rank's FSDP2 units and its collectives of two steps, by op."""
    recorder = CollectiveRecorder()
    model = train_watched("gpt2", config, STEPS, ROWS, lambda model: recorder)
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


def _held_mid_round(config: dict) -> dict[str, int]:
    """Bytes this rank's FSDP2 stage holds at the forward of each microbatch after its first backward, at most over
    two steps: gradients (unsharded accumulators, or the sharded gradients) and parameters gathered whole."""
    held = {"gradients": 0, "gathered": 0}

    def watch(model: nn.Module) -> ContextManager:
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        params = [p for m in units for group in [fully_shard.state(m)._fsdp_param_group] if group
                  for p in group.fsdp_params]

        def measure(*_):
            grads = gathered = 0
            for p in params:
                whole = p.unsharded_accumulated_grad
                whole = whole if whole is not None else p._unsharded_param.grad
                if whole is not None:  # a backward of this round reached it: kept gathered, its gradient whole
                    grads += whole.numel() * whole.element_size()
                    gathered += p._unsharded_param.untyped_storage().size()
            held["gradients"], held["gathered"] = max(held["gradients"], grads), max(held["gathered"], gathered)

        for unit in units:
            unit.register_forward_pre_hook(measure)
        return contextlib.nullcontext()

    train_watched("gpt2", config, STEPS, ROWS, watch)
    return held


@pytest.mark.parametrize("stage", [2, 3])
def test_a_stage_holds_its_gradients_and_parameters_whole_through_the_round(stage):
    """Between its first backward and the round's reduce-scatter a stage keeps every gradient unsharded in fp32
    (the reduction's dtype; FSDP2 accumulates the microbatches there) and every parameter gathered in bf16, under
    ZeRO-3 too: the planner's gradients and gathered parameters for the busiest rank, within 10 %."""
    config = {**CONFIG, "zero_stage": stage, "bf16": True}
    held = run_distributed(_held_mid_round, 4, config, nproc_per_node=4, timeout=300)
    spec = spec_from_hf(tiny_gpt2().config.to_dict(), "gpt2")
    parsed = parse_config(config)
    memory = predict_memory(spec, parsed, Layout(pp=2, dp_shard=2), 1, SEQ)
    most = {k: max(h[k] for h in held) for k in ("gradients", "gathered")}
    assert most["gradients"] == pytest.approx(memory.gradients, rel=0.10), (most, memory)
    assert most["gathered"] == pytest.approx(memory.gathered_params, rel=0.10), (most, memory)
