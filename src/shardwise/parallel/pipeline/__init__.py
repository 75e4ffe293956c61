"""Pipeline parallelism: the model's blocks cut into stages over the `pp` mesh axis.

    runner = apply_pipeline(model, mesh, settings, ...)   # model reduced in place to this rank's stages
    results = runner.run_step(distributed_model, step_fn, microbatches)   # what @step does

Stages are built from the user's own module (its forward runs unchanged), the
schedules are torch.distributed.pipelining's. A model without a list of blocks is
cut from its module graph at the first @step instead (graph.py). See docs/pipeline.md.

What runs stages loads with its module on first use: torch.distributed.pipelining takes about a second to
import, which a run without a pipeline never pays.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..stage_split import stage_ranks
from .partition import Partition, find_blocks, has_block_list, partition
from .settings import PipelineSettings

_EXPORTS = {"apply_pipeline": "apply", "GraphPipeline": "graph", "PipelineParallel": "runner",
            "SCHEDULES": "schedule"}

__all__ = ["GraphPipeline", "Partition", "PipelineParallel", "PipelineSettings", "SCHEDULES", "apply_pipeline",
           "find_blocks", "has_block_list", "partition", "stage_ranks"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
