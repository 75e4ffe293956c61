"""`deepspeed.comm`: DeepSpeed's collectives module, which mirrors torch.distributed.

The collectives are torch.distributed's own (DeepSpeed's are thin wrappers too); `init_distributed` is
the front end's, and `get_local_rank` reads the launcher's LOCAL_RANK as DeepSpeed does.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from .initialization import init_distributed

__all__ = ["init_distributed", "get_local_rank", "log_summary"]

# torch.distributed's names that DeepSpeed's comm module offers under the same name and meaning.
_TORCH_NAMES = frozenset({
    "is_initialized", "is_available", "get_rank", "get_world_size", "get_global_rank", "get_world_group",
    "new_group", "barrier", "monitored_barrier", "all_reduce", "broadcast", "broadcast_object_list", "all_gather",
    "all_gather_object", "all_gather_into_tensor", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "ReduceOp",
    "get_backend", "destroy_process_group", "ProcessGroup",
})


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed's comms-logger summary: shardwise's comms log (`comms_logger` in the config) is in the
    metrics records instead; this prints nothing."""


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(dist, name)
    raise AttributeError(f"module 'shardwise.deepspeed.comm' has no attribute {name!r}")
