"""This rank's memory at a recorded step: what it holds by category, and what the allocators measured.

Categories count this rank's own pieces (a DTensor's local shard), so they add up across ranks to the
whole. Device figures come from `torch.accelerator`'s allocator statistics (null on a CPU device, which has
none); the peak is reset after each record, so it is the peak since the last one; host RSS through psutil.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional

import psutil
import torch
from torch.distributed.tensor import DTensor


def _local_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


@functools.cache
def _this_process() -> psutil.Process:
    return psutil.Process()


def memory_record(models: Iterable[Any], optimizers: Iterable[Any], device: torch.device) -> dict[str, Optional[int]]:
    """parameters, gradients and optimizer-state bytes of this rank, device peak/allocated and host RSS."""
    # sizes only: the module's own parameters, without waiting for updates still in flight (model.parameters())
    params = [p for model in models for p in model.get_module().parameters()]
    states = [value for optimizer in optimizers for entry in optimizer.state.values()
              for value in entry.values() if isinstance(value, torch.Tensor)]
    on_device = device.type != "cpu"
    record = {"parameters_bytes": _local_bytes(params),
              "gradients_bytes": _local_bytes(p.grad for p in params),
              "optimizer_state_bytes": _local_bytes(states),
              "device_peak_bytes": torch.accelerator.max_memory_allocated(device) if on_device else None,
              "device_allocated_bytes": torch.accelerator.memory_allocated(device) if on_device else None,
              "host_rss_bytes": _this_process().memory_info().rss}
    if on_device:
        torch.accelerator.reset_peak_memory_stats(device)
    return record
