"""Global gradient-norm clipping over every shard of every parameter.

Gradients may be plain tensors (DDP, ZeRO-1: identical on every rank) or
DTensors (FSDP and TP shards). Local squared norms are summed per
(mesh, placements) group, then all-reduced over just the mesh axes the group
is sharded on — one small collective per axis, not one per parameter. Every
placement but Replicate shards (`Shard`, and the `_StridedShard` of packed
Q/K/V, which is no `Shard`); a pending sum (`Partial`) is reduced first, since
squares of partial values do not add up to the square of their sum.

The norm is agreed by every rank, so `recording_norms` hands it to the check of
non-finite gradients (runtime/non_finite.py), which then needs no collective of its own.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from contextvars import ContextVar
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from .local import local_tensor


_recorded: ContextVar[Optional[list[torch.Tensor]]] = ContextVar("shardwise_clip_norms", default=None)


@contextlib.contextmanager
def recording_norms() -> Iterator[list[torch.Tensor]]:
    """A list that collects the norm of every `clip_grad_norm_` run inside the block."""
    norms: list[torch.Tensor] = []
    token = _recorded.set(norms)
    try:
        yield norms
    finally:
        _recorded.reset(token)


def _without_partial(grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
    return grad


def _local_square_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    local = [local_tensor(g) for g in grads]
    return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in local]).sum()


def global_grad_norm(parameters: Iterable[torch.Tensor], device: torch.device,
                     across: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """`across`: ranks holding other parameters (pipeline stages), whose squares are summed in too.
    `device`: where the sum lives, so that a rank without gradients still joins the collective."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            g = _without_partial(p.grad)
            groups[(g.device_mesh, g.placements) if isinstance(g, DTensor) else None].append(g)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, grads in groups.items():
        squares = _local_square_sum(grads)
        if key is not None:
            mesh, placements = key
            for axis, placement in enumerate(placements):
                if not placement.is_replicate():
                    dist.all_reduce(squares, group=mesh.get_group(axis))
        total = total + squares.to(device)
    if across is not None:
        dist.all_reduce(total, group=across)
    return total.sqrt()


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, device: torch.device,
                    across: Optional[dist.ProcessGroup] = None,
                    counted: Optional[Callable[[torch.Tensor], bool]] = None) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most `max_norm`; return the norm before clipping.

    `counted` picks the parameters the norm is taken over (all by default; copies of
    one tied weight count once); every parameter is scaled. A non-finite norm scales
    nothing, so the gradients still show where inf/nan arose (runtime/non_finite.py names it).
    """
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm([p for p in params if counted is None or counted(p)], device, across)
    recorded = _recorded.get()
    if recorded is not None:
        recorded.append(norm)
    value = float(norm)
    coef = min(1.0, max_norm / (value + 1e-6)) if math.isfinite(value) else 1.0
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return norm
