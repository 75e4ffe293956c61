"""The pipeline's share of a step: which blocks the busiest rank runs, and the idle time its schedule leaves.

A rank runs `virtual_stages` chunks of the model (stages r, r + pp, ...); the split is the runtime's
(`pipeline_split_points` by hand, else ⌈blocks / stages⌉ per stage). Per round of microbatches the bubble is
the fill and drain the schedule leaves idle, in the papers' own terms, with F, B and W one microbatch's
forward, input-gradient and weight-gradient time on the busiest rank:

- `gpipe`, `1f1b`: (pp − 1)(F + B + W) (Narayanan et al., 2021);
- `interleaved_1f1b`: the same divided by the chunks a rank runs, v (ibid.);
- `interleaved_zero_bubble`: weight gradients fill the drain, (pp − 1)(F + B − W) / v (ZB-H1 of Qi et al.,
  "Zero Bubble Pipeline Parallelism", 2023, per chunk);
- `zbv_zero_bubble`: the V-shaped schedule of two chunks, (pp − 1)(F + B − 2W) / v, at least 0 (ZB-V, ibid.).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.schema import ShardwiseConfig
from .spec import ModelSpec


@dataclass(frozen=True)
class RankBlocks:
    """The blocks the busiest pipeline rank runs, and whether it holds the model's last stage (the head)."""

    blocks: int
    holds_head: bool


def stage_sizes(layers: int, stages: int, split_points: list[int] | None) -> list[int]:
    """Blocks of every pipeline stage: at the configured split points, else ⌈layers / stages⌉ each, the
    last stages taking what is left."""
    if split_points:
        bounds = [0, *split_points, layers]
        return [b - a for a, b in zip(bounds, bounds[1:])]
    per = math.ceil(layers / stages)
    return [max(0, min(per, layers - i * per)) for i in range(stages)]


def busiest_rank(spec: ModelSpec, config: ShardwiseConfig, pp: int) -> RankBlocks:
    """The rank whose chunks hold the most blocks (ties: the one holding the head)."""
    if pp == 1:
        return RankBlocks(spec.layers, True)
    v = config.stages_per_rank
    sizes = stage_sizes(spec.layers, pp * v, config.pipeline_split_points)
    if len(sizes) != pp * v:     # split points given for another stage count: validation refuses it first
        sizes = stage_sizes(spec.layers, pp * v, None)
    per_rank = [sum(sizes[r::pp]) for r in range(pp)]
    most = max(per_rank)
    return RankBlocks(most, per_rank[(pp * v - 1) % pp] == most)


def bubble_share(schedule: str, pp: int, virtual: int, forward: float, input_grad: float,
                 weight_grad: float) -> float:
    """Idle seconds per round on the busiest rank, from one microbatch's F, B and W there."""
    if pp == 1:
        return 0.0
    if schedule == "interleaved_zero_bubble":
        return (pp - 1) * max(0.0, forward + input_grad - weight_grad) / virtual
    if schedule == "zbv_zero_bubble":
        return (pp - 1) * max(0.0, forward + input_grad - 2 * weight_grad) / virtual
    chunks = virtual if schedule == "interleaved_1f1b" else 1
    return (pp - 1) * (forward + input_grad + weight_grad) / chunks
