"""Data parallelism: DDP and FSDP2's replicate (replicated.py), ZeRO-2/3 (fully_sharded.py), MiCS's partition groups
and their cross-group reduction (mics.py, mics_step.py), the sharding units (units.py) and optimizer-state offload
(optimizer_offload.py); `apply_data_parallel` builds one as the decisions say. ZeRO-1's optimizer side is zero1/."""

from .apply import apply_data_parallel
from .optimizer_offload import HostOffload

__all__ = ["HostOffload", "apply_data_parallel"]
