"""ZeRO++ hpZ rules that need only the config (`zero_hpz_partition_size`).

hpZ runs on FSDP2's `fully_shard(..., reshard_after_forward=<int>)`; these rules
mirror what FSDP2 and shardwise's composition accept, so a config that would fail
inside torch at the first forward fails here. The rules that need the layout (the
size divides the sharding group and the ranks per node) are in `config/layout.py`.
"""

from __future__ import annotations

from typing import Iterable

from ..errors import Problem
from .schema import ShardwiseConfig

KEY = "zero_hpz_partition_size"


def hpz_problems(c: ShardwiseConfig) -> Iterable[Problem]:
    """Every broken hpZ rule; none when zero_hpz_partition_size is 1."""
    size = c.zero_hpz_partition_size
    if size == 1:
        return
    stage = c.effective_zero_stage
    if stage != 3:
        yield Problem(KEY, size, f"needs ZeRO-3, which shards parameters (this config runs ZeRO-{stage}): hpZ "
                      "decides how far parameters are re-sharded after forward",
                      "set zero_stage to 3 (with sharded_data_parallel_degree > 1, or alone for the whole "
                      "data-parallel group), or set zero_hpz_partition_size to 1")
    if c.tensor_parallel_degree > 1:
        yield Problem(KEY, size, "cannot be used with tensor_parallel_degree > 1: FSDP2 cannot re-shard "
                      "tensor-parallel (DTensor) parameters to a secondary group (torch 2.13)",
                      "set zero_hpz_partition_size to 1, or tensor_parallel_degree to 1")
    if c.pipeline_parallel_degree > 1:
        yield Problem(KEY, size, "is not available with pipeline_parallel_degree > 1 yet",
                      "set zero_hpz_partition_size to 1, or pipeline_parallel_degree to 1")
