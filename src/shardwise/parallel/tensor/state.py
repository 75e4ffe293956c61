"""Whole-model views of a tensor-parallel model, for comparisons and export."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every DTensor gathered to its full tensor, under the unsplit names.

    Costs a whole model's memory on every rank and one all-gather per split
    tensor (every rank must call it); use `torch.distributed.checkpoint` to save.
    """
    return {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach()
            for name, value in module.state_dict().items()}
