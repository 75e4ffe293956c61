"""`deepspeed.runtime.pipe.engine`."""

from ...pipeline_engine import PipelineEngine

__all__ = ["PipelineEngine"]
