"""The control-flow check at the @step boundary (`control_flow_check_interval`).

Every rank must run the same @step calls, each with the same microbatches and the
same number of calls to each model: collectives pair up by order, so a rank that
skips a forward or runs one microbatch more either hangs its peers or, where the
collectives happen to pair up (DDP syncs gradients only after the last
microbatch), trains on gradients summed over different work. At the end of every
N-th call of a @step function each rank all-gathers four ints (its call count,
the microbatches and model forward calls of this call, the optimizer steps taken
so far: a rank that accumulates over more @step calls than the others differs
there) and every rank stops with one line naming the ranks and counts that
differ. Costs one all-gather of 32 bytes per rank.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

COUNTS = ("calls of it", "microbatches run", "model forward calls", "optimizer steps taken")


class ControlFlowMismatchError(RuntimeError):
    """Ranks ran different work in one @step."""


def forward_calls(models: Iterable[object]) -> int:
    """Forward calls counted so far by the models a @step runs (a pipeline's schedule is not counted: its
    stages call different modules by design)."""
    return sum(model.forward_calls for model in models if not model.runs_whole_step)


class ControlFlowCheck:
    """Counts one @step function's calls and compares each call's work across ranks every `interval` calls."""

    def __init__(self, name: str):
        self.name = name
        self.calls = 0

    def after_call(self, interval: int | None, device: torch.device, microbatches: int, forwards: int,
                   optimizer_steps: int) -> None:
        self.calls += 1
        if interval is None or self.calls % interval:
            return
        mine = torch.tensor([self.calls, microbatches, forwards, optimizer_steps], dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).tolist()
        for column, what in enumerate(COUNTS):
            values = [row[column] for row in table]
            odd = [rank for rank, value in enumerate(values) if value != values[0]]
            if odd:
                raise ControlFlowMismatchError(
                    f"@step {self.name}: ranks ran different work in call {self.calls}: {what} per rank {values} "
                    f"(ranks {odd} differ from rank 0); fix: every rank must run the same @step calls with the "
                    "same microbatches config and call each model as often, else collectives pair up wrongly "
                    "and hang")
