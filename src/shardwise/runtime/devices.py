"""Device and backend choice through torch's own accelerator API (CUDA, XPU, … or CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_device(local_rank: int) -> torch.device:
    """This rank's device: accelerator `local_rank` when one exists, else the CPU."""
    if torch.accelerator.is_available():
        accel = torch.accelerator.current_accelerator()
        index = local_rank % torch.accelerator.device_count()
        torch.accelerator.set_device_index(index)
        return torch.device(accel.type, index)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return dist.get_default_backend_for_device(device)
