"""What a pipeline is built with, as plain values: `compose` reads them from the config, nothing here does."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch


@dataclass(frozen=True)
class PipelineSettings:
    stages_per_rank: int                  # virtual stages: more than 1 for interleaved schedules
    balance: Optional[list[float]]        # SMP's pipeline_balance: a share of the blocks per stage
    split_points: Optional[list[str]]     # modules that begin a stage
    auto_partition: bool
    default_partition: Optional[int]
    schedule: str                         # torch.distributed.pipelining's schedule name (config's pipeline_schedule)
    round: int                            # microbatches each run of the schedule takes (config's pipeline_round)
    tensor_parallel_degree: int
    prescaled_batch: bool
    memory_weight: float                  # the module-graph cut's weight of memory against compute
    compute_dtype: Optional[torch.dtype]  # mixed precision's, else None
    stage_dtype: Optional[torch.dtype]    # the dtype a stage's parameters are held in (captured so), else None
    group_timeout: timedelta              # the collective timeout of the groups tied weights are summed in
