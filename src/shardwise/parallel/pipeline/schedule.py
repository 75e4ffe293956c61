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

torch's 1F1B needs at least as many microbatches per round as stages; a round
of fewer (`active_microbatches` < pipeline_parallel_degree) runs as GPipe, whose
first stage then holds exactly that round in flight, as 1F1B's would.
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
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from ...config.schema import SINGLE_STAGE_SCHEDULES as SINGLE_STAGE
from ...config.schema import SPLIT_BACKWARD_SCHEDULES as SPLIT_BACKWARD  # input-gradient, then weight-gradient pass
Schedule = PipelineScheduleSingle | PipelineScheduleMulti  # the public bases of every schedule below
SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
}


class EvalSafeStage(PipelineStage):
    """torch's `PipelineStage`, able to run a V-shaped schedule's evaluation pass.

    A V-shaped schedule hands gradients between a rank's two stages directly, and
    torch (2.13) asserts a backward pass in that hand-over even under `eval()`.
    The members overridden here are torch internals (listed in `shardwise.torch_internals`).
    """

    def get_local_bwd_output(self, mb_index: int) -> Any:
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


def build_schedule(name: str, stages: list[PipelineStage], microbatches: int,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> Schedule:
    """Gradients are not rescaled by the schedule: the loss arrives already divided by the microbatches."""
    if name not in SINGLE_STAGE:
        return SCHEDULES[name](stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    if name == "1f1b" and microbatches < stages[0].num_stages:
        name = "gpipe"
    return SCHEDULES[name](stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)


def run(schedule: Schedule, train: bool, target: Any, kwargs: dict[str, Any]) -> None:
    """One pass over a round of microbatches; outputs go to `loss_fn`, none are merged or returned
    (merging fails for scalar outputs, such as a loss computed from `labels=`, and keeps every logit)."""
    if train:
        schedule.step(target=target, return_outputs=False, **kwargs)
    else:
        schedule.eval(target=target, return_outputs=False, **kwargs)
