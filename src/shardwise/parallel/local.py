"""This rank's piece of a tensor: what collectives, fingerprints and foreach kernels work on."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (tensor parallelism, FSDP2), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
