"""`deepspeed.checkpointing`: DeepSpeed's activation-checkpointing calls (Megatron-style scripts use them).

`checkpoint(function, *args)` recomputes `function` in backward with shardwise's activation checkpointing
(torch's non-reentrant checkpoint, the random state replayed). `configure` takes DeepSpeed's arguments: the
config's `activation_checkpointing.cpu_checkpointing` (`offload_activations`) is what moves kept inputs to the
host; partitioning activations across model-parallel ranks is not done.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..api.recompute import checkpointed_call

__all__ = ["checkpoint", "configure", "is_configured", "reset"]

_configured = False


def checkpoint(function: Callable, *args: Any) -> Any:
    """DeepSpeed's `checkpoint(function, *args)` over shardwise's activation checkpoint: `function(*args)` as one
    region recomputed in backward (torch's non-reentrant checkpoint, the random state replayed, the kept inputs
    offloaded when the config says so). Also the default `activation_checkpoint_func` of a PipelineModule."""
    return checkpointed_call(function, *args)


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """Accepted as DeepSpeed's; the recomputation itself needs no configuring here (see the module's docstring
    for what decides offloading)."""
    global _configured
    if partition_activations:
        raise ValueError("deepspeed.checkpointing.configure(partition_activations=True): activations are not "
                         "partitioned across model-parallel ranks here; pass False (sequence_parallel shards "
                         "what tensor parallelism leaves whole)")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed frees its checkpointing buffers here; shardwise keeps none."""
