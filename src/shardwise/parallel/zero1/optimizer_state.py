"""ZeRO-1: each data-parallel replica keeps optimizer state for its share of the parameters only.

Parameters are dealt whole to the ranks of the replica group, largest first to
the least-loaded rank (shares.py), so every rank's share is about 1/n of the
bytes. The user's own optimizer object keeps only its share in `param_groups` (so Adam's
two fp32 moments exist for 1/n of the model; in bf16/fp16 so do the fp32 master
copies, see master_weights.py); after each step every owner broadcasts its
updated parameters to the other replicas, overlapping the next forward
(parameter_broadcasts.py).

Written here rather than taken from `torch.distributed.optim.ZeroRedundancyOptimizer`
because that one rebuilds the optimizer from its class and arguments and cannot
broadcast tensor-parallel DTensor parameters; this one keeps the user's
optimizer and moves only each parameter's local tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..local import local_tensor
from .shares import assign_owners


class OptimizerStateSharding:
    """Keeps `optimizer` to this rank's share of its parameters; `owner_of` says who steps each one."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup):
        if optimizer.state:
            raise ValueError("DistributedOptimizer must wrap a fresh optimizer (it already has state); "
                             "create it right after DistributedModel and before the first step")
        self.group = group
        params = [p for g in optimizer.param_groups for p in g["params"]]
        owners = assign_owners([local_tensor(p).numel() for p in params], dist.get_world_size(group))
        self.owner_of = {p: dist.get_global_rank(group, owner) for p, owner in zip(params, owners)}
        me = dist.get_rank()
        for param_group in optimizer.param_groups:
            param_group["params"] = [p for p in param_group["params"] if self.owner_of[p] == me]
