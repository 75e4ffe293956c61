"""ZeRO-1: the owners' updated parameters reach the other replicas while the next forward pass runs.

After `optimizer.step()` every rank must broadcast the parameters it stepped.
Waiting for them there would leave the whole transfer exposed; instead they are
issued at once, asynchronously, in the order forward uses the parameters, and each
module waits only for what it is about to read — as FSDP2 waits for a block's
all-gather. Forward order is the modules' registration order (the same on every
rank, as it must be: every rank issues the broadcasts in one order); tensors are
grouped into buckets of about `shares.BUCKET_BYTES` of consecutive ones, and a
forward pre-hook on each module that holds parameters waits for the buckets
holding them. Each tensor is broadcast straight into its parameter: no staging
buffer, so the overlap costs no memory.

Under FSDP2's `replicate` (fp32 ZeRO-1 with tensor or pipeline parallelism) the
step waits for them instead: FSDP2 copies the parameters whenever it unshards a
module — in its own pre-forward hook, or before forward when a pipeline schedule
unshards a stage itself (torch's runtime schedules do) — so only the step is sure
to come before that copy.

Anything that reads or writes parameters outside forward must call `wait_all`
first; DistributedOptimizer and DistributedModel do (docs/sharding.md lists where).
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..local import local_tensor
from . import shares


def _forward_order(called: nn.Module, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """`params` in the order the modules registering them come under `called` (any none registers last)."""
    wanted = dict.fromkeys(params)
    order: dict[nn.Parameter, None] = {}
    for module in called.modules():
        order.update((p, None) for p in module.parameters(recurse=False) if p in wanted)
    return list(order) + [p for p in wanted if p not in order]


class ParameterBroadcasts:
    """Broadcasts each parameter of `owner_of` from its owner over `group`; forward waits for them module by module.

    `called` is the module forward calls (a DDP or pipeline wrapper included): hooks go on every module under
    it, so a pipeline's stage views, which copy the modules above their blocks, get them too.
    """

    def __init__(self, owner_of: dict[nn.Parameter, int], group: dist.ProcessGroup, called: nn.Module):
        self.owner_of, self.group = owner_of, group
        order = _forward_order(called, owner_of)
        sizes = [local_tensor(p).nbytes for p in order]
        self.buckets = [[order[i] for i in indices]
                        for indices in shares.consecutive_buckets(sizes, shares.BUCKET_BYTES)]
        self._pending: dict[int, list[dist.Work]] = {}  # bucket index -> its broadcasts, in issue order
        self.overlapped = not any(isinstance(module, FSDPModule) for module in called.modules())
        if self.overlapped:
            self._install(called)

    def _install(self, called: nn.Module) -> None:
        bucket_of = {p: index for index, bucket in enumerate(self.buckets) for p in bucket}
        for module in called.modules():
            needed = tuple(sorted({bucket_of[p] for p in module.parameters(recurse=False) if p in bucket_of}))
            if needed:
                module.register_forward_pre_hook(functools.partial(self._before_forward, needed))

    def _before_forward(self, needed: tuple[int, ...], module: nn.Module, args: tuple) -> None:
        self.wait(needed)

    @property
    def pending(self) -> tuple[int, ...]:
        """Indices of the buckets issued and not yet waited for."""
        return tuple(self._pending)

    @torch.no_grad()
    def start(self) -> None:
        """Issue every bucket's broadcasts in forward order (once any still pending have arrived); wait for them
        here only if forward cannot."""
        self.wait_all()
        for index, bucket in enumerate(self.buckets):
            self._pending[index] = [dist.broadcast(local_tensor(p), src=self.owner_of[p], group=self.group,
                                                   async_op=True) for p in bucket]
        if not self.overlapped:
            self.wait_all()

    def wait(self, buckets: Iterable[int]) -> None:
        """Wait for the broadcasts of `buckets` (those already waited for are skipped)."""
        for index in buckets:
            for work in self._pending.pop(index, ()):
                work.wait()

    def wait_all(self) -> None:
        self.wait(list(self._pending))
