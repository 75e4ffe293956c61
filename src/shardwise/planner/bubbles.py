"""The pipeline's share of a step: which blocks the busiest rank runs, and the idle time its schedule leaves.

A rank runs `virtual_stages` chunks of the model (stages r, r + pp, ...); the split is the runtime's:
`pipeline_split_points` by hand, else the cut parallel/pipeline/partition.py makes, the same min-max split
(parallel/stage_split.py) over the blocks' costs with the embedding on the first stage and the head on the
last, by `pipeline_balance` (parameters; or compute, where embedding lookups are free). Per round of
microbatches the bubble is the fill and drain the schedule leaves idle, in the papers' own terms, with F, B and W
one microbatch's forward, input-gradient and weight-gradient time on the busiest rank:

- `gpipe`, `1f1b`: (pp − 1)(F + B + W) (Narayanan et al., 2021);
- `interleaved_1f1b`: the same divided by the chunks a rank runs, v (ibid.);
- `interleaved_zero_bubble`: weight gradients fill the drain, (pp − 1)(F + B − W) / v (ZB-H1 of Qi et al.,
  "Zero Bubble Pipeline Parallelism", 2023, per chunk);
- `zbv_zero_bubble`: the V-shaped schedule of two chunks, (pp − 1)(F + B − 2W) / v, at least 0 (ZB-V, ibid.).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..config.schema import ShardwiseConfig
from ..parallel.stage_split import min_max_split, stage_ranks
from .spec import ModelSpec


@dataclass(frozen=True)
class RankBlocks:
    """The blocks the busiest pipeline rank runs, and whether it holds the model's last stage (the head)."""

    blocks: int
    holds_head: bool


def stage_sizes(spec: ModelSpec, stages: int, config: ShardwiseConfig) -> list[int]:
    """Blocks of every pipeline stage as the runtime cuts them: at the configured split points, else balanced."""
    points = config.pipeline_split_points
    if points and len(points) == stages - 1:
        bounds = [0, *points, spec.layers]
        return [b - a for a, b in zip(bounds, bounds[1:])]
    # By compute, token and position lookups are free; a ViT's patch projection and position table are not.
    lookups = config.pipeline_balance == "compute" and not spec.input_elements_per_token
    first = 0 if lookups else spec.embedding_parameters
    last = spec.head_parameters + (spec.vocab * spec.hidden if spec.tied_head else 0)
    return list(_balanced(spec.layers, spec.layer_parameters, stages, first, last))


@lru_cache(maxsize=1024)
def _balanced(layers: int, block: int, stages: int, first: int, last: int) -> tuple[int, ...]:
    return tuple(min_max_split([block] * layers, stages, first, last, [None] * layers))


def rank_blocks(spec: ModelSpec, config: ShardwiseConfig, pp: int) -> list[int]:
    """Blocks each pipeline rank runs over its chunks, the stages placed as the schedule places them (looped, or
    V-shaped)."""
    stages = pp * config.stages_per_rank
    per_rank = [0] * pp
    for rank, blocks in zip(stage_ranks(config.pipeline_schedule, pp, stages), stage_sizes(spec, stages, config)):
        per_rank[rank] += blocks
    return per_rank


def busiest_rank(spec: ModelSpec, config: ShardwiseConfig, pp: int) -> RankBlocks:
    """The rank whose chunks hold the most blocks (ties: the one holding the head)."""
    if pp == 1:
        return RankBlocks(spec.layers, True)
    per_rank = rank_blocks(spec, config, pp)
    most = max(per_rank)
    last = stage_ranks(config.pipeline_schedule, pp, pp * config.stages_per_rank)[-1]
    return RankBlocks(most, per_rank[last] == most)


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
