"""The `torch.distributed.pipelining` schedule named by `pipeline_schedule`, and where its stages run.

| name                    | torch class                   | stages per rank | placement |
|-------------------------|-------------------------------|-----------------|-----------|
| gpipe                   | ScheduleGPipe                 | 1               | -         |
| 1f1b                    | Schedule1F1B                  | 1               | -         |
| interleaved_1f1b        | ScheduleInterleaved1F1B       | virtual_stages  | looped    |
| interleaved_zero_bubble | ScheduleInterleavedZeroBubble | virtual_stages  | looped    |
| zbv_zero_bubble         | ScheduleZBVZeroBubble         | 2               | V-shaped  |

Looped: stage s runs on pp rank s % pp. V-shaped: rank r runs stages r and
2·pp-1-r, so the first and the last stage share rank 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule

SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
}
_SINGLE = ("gpipe", "1f1b")


def stage_ranks(name: str, pp: int, stages: int) -> list[int]:
    """The pp rank of every stage."""
    if name == "zbv_zero_bubble":
        return [s if s < pp else 2 * pp - 1 - s for s in range(stages)]
    return [s % pp for s in range(stages)]


def build_schedule(name: str, stages: list[PipelineStage], microbatches: int,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> _PipelineSchedule:
    """Gradients are not rescaled by the schedule: the loss arrives already divided by the microbatches."""
    target = stages[0] if name in _SINGLE else stages
    return SCHEDULES[name](target, microbatches, loss_fn=loss_fn, scale_grads=False)


def run(schedule: _PipelineSchedule, train: bool, target: Any, kwargs: dict[str, Any]) -> None:
    """One pass over a round of microbatches; outputs go to `loss_fn`, none are merged or returned.

    Evaluation flips the schedule's backward flag itself, as `schedule.eval()` does,
    because `eval()` also merges the last stage's outputs, which fails for scalar
    outputs (a loss computed from `labels=`) and keeps every microbatch's logits.
    """
    saved = schedule._has_backward
    schedule._has_backward = saved and train
    try:
        schedule.step(target=target, return_outputs=False, **kwargs)
    finally:
        schedule._has_backward = saved
