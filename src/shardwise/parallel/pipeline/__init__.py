"""Pipeline parallelism: the model's blocks cut into stages over the `pp` mesh axis.

    runner = apply_pipeline(model, mesh, settings, ...)   # model reduced in place to this rank's stages
    results = runner.run_step(distributed_model, step_fn, microbatches)   # what @step does

Stages are built from the user's own module (its forward runs unchanged), the
schedules are torch.distributed.pipelining's. A model without a list of blocks is
cut from its module graph at the first @step instead (graph.py). See docs/pipeline.md.
"""

from .apply import apply_pipeline
from .graph import GraphPipeline
from .partition import Partition, find_blocks, has_block_list, partition
from .runner import PipelineParallel
from .schedule import SCHEDULES, stage_ranks
from .settings import PipelineSettings

__all__ = ["SCHEDULES", "GraphPipeline", "Partition", "PipelineParallel", "PipelineSettings", "apply_pipeline", "find_blocks",
           "has_block_list", "partition", "stage_ranks"]
