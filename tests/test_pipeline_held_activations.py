"""What each pipeline rank holds at its peak, measured, against what the planner counts.

A tiny Llama of 8 blocks runs one training step on 4 pipeline ranks under each schedule, 8 microbatches. On every
rank a saved-tensors hook counts the bytes autograd keeps inside the blocks (saved_tensors.py) at their peak; one block's bytes for one microbatch, measured the same way in one process, turn
that into block-microbatches held. The planner's count for the same cut and schedule (`pipeline_stages`: the
runtime's cut, pp − r microbatches under 1F1B, interleaved 1F1B's warm-up) must be what was measured, rank by
rank; for the zero-bubble schedules, which it counts as their whole round, a bound on it.
"""

from __future__ import annotations

import pytest

import shardwise as sw
from shardwise.config import parse_config
from shardwise.planner.families import spec_from_hf
from shardwise.planner.memory import pipeline_stages
from shardwise.testing import run_distributed
from shardwise.topology import Layout
from saved_tensors import peak_saved_in_blocks
from tiny_models import build, dataset, seed_step

LAYERS, PP, MICROBATCHES, ROWS = 8, 4, 8, 8


def _one_block_microbatch() -> int:
    """Bytes one block keeps for one microbatch (ROWS / MICROBATCHES rows), in one plain process."""
    model = build("llama", layers=1)
    inputs, _ = dataset("llama", ROWS // MICROBATCHES)[:]
    return peak_saved_in_blocks(model, lambda: model(input_ids=inputs).logits.sum().backward())


def _rank_peak(config: dict) -> tuple[int, int]:
    sw.init(config)
    model = sw.DistributedModel(build("llama", layers=LAYERS))
    step = seed_step("llama")
    inputs, targets = next(iter(sw.data_loader(dataset("llama", ROWS), batch_size=ROWS, shuffle=False)))
    step(model, inputs, targets)   # the first step also infers the stages' shapes: measured is the second
    peak = peak_saved_in_blocks(model.get_module(), lambda: step(model, inputs, targets))
    return sw.pp_rank(), peak


def _held_and_counted(schedule: str, virtual: int) -> tuple[list[float], list[float]]:
    """Block-microbatches each rank held at its peak, measured, and as the planner counts them."""
    config = {"pipeline_parallel_degree": PP, "microbatches": MICROBATCHES, "active_microbatches": MICROBATCHES,
              "pipeline_schedule": schedule, **({"virtual_stages": virtual} if virtual > 1 else {})}
    measured = dict(run_distributed(_rank_peak, PP, config, timeout=300))
    per_block = _one_block_microbatch()
    spec = spec_from_hf(build("llama", layers=LAYERS).config.to_dict(), "tiny llama")
    counted = pipeline_stages(spec, parse_config(config), Layout(pp=PP))
    return [measured[rank] / per_block for rank in range(PP)], [blocks * held for blocks, held, _, _ in counted]


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_each_rank_holds_what_the_planner_counts(schedule, virtual):
    """GPipe: the whole round on every rank (16 block-microbatches); 1F1B: pp − r microbatches of 2 blocks (8, 6, 4,
    2); interleaved 1F1B: its warm-up, (v − 1)·pp + 2·(pp − 1 − r) + 1 chunks of 1 block (11, 9, 7, 5)."""
    held, counted = _held_and_counted(schedule, virtual)
    assert held == pytest.approx(counted, rel=0.02)


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble"])
def test_zero_bubble_ranks_hold_no_more_than_their_round(schedule):
    """The zero-bubble schedules keep a microbatch's activations until its deferred weight-gradient step: the
    planner counts the whole round, which bounds every rank's peak and is within a third of the busiest."""
    held, counted = _held_and_counted(schedule, 2)
    assert all(h <= c * 1.02 for h, c in zip(held, counted)), (held, counted)
    assert max(held) >= 0.75 * max(counted), (held, counted)
