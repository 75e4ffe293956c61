"""Pipeline parallelism: the model's blocks cut into stages over the `pp` mesh axis.

    runner = apply_pipeline(model, mesh, config)   # model reduced in place to this rank's stages
    results = runner.run_step(distributed_model, step_fn, microbatches)   # what @step does

Stages are built from the user's own module (its forward runs unchanged), the
schedules are torch.distributed.pipelining's. See docs/pipeline.md.
"""

from .apply import apply_pipeline
from .partition import Partition, find_blocks, partition
from .runner import PipelineParallel
from .schedule import SCHEDULES, stage_ranks

__all__ = ["SCHEDULES", "Partition", "PipelineParallel", "apply_pipeline", "find_blocks", "partition", "stage_ranks"]
