"""DDP, FSDP2's `replicate` and lone replicas: full copies of the model whose gradients are synchronised once per
step (ZeRO-1's optimizer reduces them itself, `zero1/`)."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional

from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ..strategy import Strategy


class Replicated(Strategy):
    """DDP, FSDP2's `replicate`, one replica alone, or ZeRO-1's half-precision replicas: full copies whose
    gradients are synchronised once per step (ZeRO-1's optimizer reduces them in bf16/fp16).

    Tensor-parallel parameters are DTensors, which `DistributedDataParallel`
    cannot bucket, and a pipeline stage's backward runs piecewise under its
    schedule, which DDP's reducer cannot follow; there the module is replicated
    with FSDP2's `replicate` (same all-reduce, DTensor-aware) instead.
    """

    @contextlib.contextmanager
    def microbatch_context(self, last: bool) -> Iterator[None]:
        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(last)
        skip_sync = not last and isinstance(self.module, DistributedDataParallel)
        self.gradient_sync = last
        try:
            with self.module.no_sync() if skip_sync else contextlib.nullcontext(), self.loss_context():
                yield
        finally:
            self.gradient_sync = True

    @property
    def reduces_in_forward(self) -> bool:
        return isinstance(self.module, DistributedDataParallel)

    def join(self, divide_by_initial_world_size: bool, enable: bool) -> Optional[ContextManager]:
        if not self.reduces_in_forward:
            return None
        return self.module.join(divide_by_initial_world_size=divide_by_initial_world_size, enable=enable)

    def register_comm_hook(self, state: object, hook: Callable) -> bool:
        if self.reduces_in_forward:
            self.module.register_comm_hook(state, hook)
        return self.reduces_in_forward
