"""ZeRO-2/3 and MiCS as FSDP2 leaves them: gradients reduce-scattered every microbatch so they stay sharded, the
cross-group reduction only after the last one."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..strategy import Strategy
from .mics import CrossGroupReduction


class Sharded(Strategy):
    """FSDP2 (ZeRO-2/3, MiCS): gradients reduce-scattered every microbatch so they stay sharded,
    the cross-group all-reduce (`cross_group`, or FSDP2's own in a hybrid mesh) only after the last one."""

    def __init__(self, module: FSDPModule, cross_group: Optional[CrossGroupReduction], hybrid: bool, **options: Any):
        """`options`: the `Strategy`'s (autocast, binding)."""
        super().__init__(module, module, **options)
        self.cross_group, self.hybrid = cross_group, hybrid

    @contextlib.contextmanager
    def microbatch_context(self, last: bool) -> Iterator[None]:
        if self.cross_group is not None:
            self.cross_group.final = last
        if self.hybrid:
            self.module.set_requires_all_reduce(last)
        self.module.set_is_last_backward(last)
        with self.loss_context():
            yield
        if last and not torch.is_grad_enabled():
            reshard_gathered(self.module)


def reshard_gathered(module: nn.Module) -> None:
    """Free the parameters FSDP2's forward gathered in `module`. Training's backward does it; an evaluation
    step has no backward, and ZeRO-2 blocks (and the root in every stage) would stay whole until the next."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
