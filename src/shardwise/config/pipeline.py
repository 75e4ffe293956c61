"""Pipeline rules that need only the config: stages per rank, split points and microbatch rounds.

They mirror what `torch.distributed.pipelining`'s schedules accept, so a config
that would fail inside torch on the first step fails here, before launch.
Rules that need the model (blocks per stage, the last split point) are checked
when the model is cut (parallel/pipeline/partition.py).
"""

from __future__ import annotations

from typing import Iterable

from ..errors import Problem
from .schema import SINGLE_STAGE_SCHEDULES as SINGLE_STAGE
from .schema import ShardwiseConfig

INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _stage_problems(c: ShardwiseConfig) -> Iterable[Problem]:
    v, schedule = c.virtual_stages, c.pipeline_schedule
    if v is not None and v > 1 and schedule in SINGLE_STAGE:
        yield Problem("virtual_stages", v, f"pipeline_schedule {schedule} runs one stage per rank",
                      "use pipeline_schedule interleaved_1f1b (or interleaved_zero_bubble), or drop virtual_stages")
    if v is not None and v != 2 and schedule == "zbv_zero_bubble":
        yield Problem("virtual_stages", v, "zbv_zero_bubble runs exactly two stages per rank (a V shape)",
                      "set virtual_stages to 2, or drop it")
    points, stages = c.pipeline_split_points, c.pipeline_parallel_degree * c.stages_per_rank
    if points is not None and (len(points) != stages - 1 or points != sorted(set(points)) or min(points or [1]) < 1):
        yield Problem("pipeline_split_points", points,
                      f"must be {stages - 1} increasing block indices ≥ 1, one per stage but the first "
                      f"({stages} stages = pipeline_parallel_degree {c.pipeline_parallel_degree} × "
                      f"{c.stages_per_rank} per rank)",
                      "give the index of the first block of every stage but the first")


def _round_problems(c: ShardwiseConfig) -> Iterable[Problem]:
    pp, m, r = c.pipeline_parallel_degree, c.microbatches, c.pipeline_round
    key = "active_microbatches" if r < m else "microbatches"
    if r < m and m % r:
        yield Problem(key, r, f"must divide microbatches ({m}): the pipeline runs them in rounds of "
                      "active_microbatches", f"use a divisor of {m}: {_divisors(m)}")
    elif c.pipeline_schedule in INTERLEAVED and r % max(1, r // pp):
        yield Problem(key, r, f"{c.pipeline_schedule} runs microbatches in rounds of pipeline_parallel_degree "
                      f"({pp}): {r} is neither below {2 * pp} nor a multiple of {pp}",
                      f"use a multiple of {pp}")


def pipeline_problems(c: ShardwiseConfig) -> Iterable[Problem]:
    """Every broken pipeline rule; none when pipeline_parallel_degree is 1."""
    if c.pipeline_parallel_degree == 1:
        return
    yield from _stage_problems(c)
    yield from _round_problems(c)
