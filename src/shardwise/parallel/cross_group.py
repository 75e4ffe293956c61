"""MiCS's cross-group gradient all-reduce, overlapped with the backward pass.

FSDP2's own hybrid sharding (a 2-D mesh) all-reduces each unit's gradient shard
across partition groups inside the unit's post-backward, right after its
reduce-scatter: with gloo the backward pass waits there for the slow link,
block after block. Here FSDP2 shards over the partition group only (`dp_shard`),
and this takes each unit's gradient shard as soon as FSDP2 has reduce-scattered
it (a post-accumulate-grad hook on the sharded parameters, which FSDP2 calls
once the shard is in `.grad`), copies it into one flat buffer and all-reduces
that across groups (`dp_replicate`) asynchronously while backward computes the
next units. Every rank issues the units in one fixed order (backward's: the
last block first, the root last), so one that finishes early waits for those
before it. At most `IN_FLIGHT` are pending (one on the link, one queued), which
bounds the buffers to two units' shards; the oldest is waited for and its average
written into the gradients, in place, before another goes, and the rest when the
backward pass ends. Until then a unit's `.grad` holds its partition group's
average only: hooks on the sharded parameters see that one.

With microbatches FSDP2 still reduce-scatters every microbatch (gradients stay
sharded); only the last one's delivery is sent, once its shard holds the sum of
all of them. Each parameter travels with a flag saying whether this rank had
its gradient, so one that no replica produced stays without a gradient, as in
one process. `dtype`: the all-reduce's; bf16 halves the bytes on the link while
the reduce-scatter, the master weights and the optimizer stay fp32 (each
replica's shard and their sum are rounded to bf16's 8 bits, the average is
taken in fp32). On an accelerator the copies and all-reduces run on a stream of
their own.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..torch_internals import at_backward_end
from .zero1.shares import IN_FLIGHT


class _Unit:
    """One FSDP2 unit's trainable parameters: one all-reduce."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.shapes = [p.to_local().shape for p in params]
        self.sizes = [shape.numel() for shape in self.shapes]
        self.delivered = 0  # parameters whose shard FSDP2 has handed over on the final pass


class CrossGroupReduction:
    """All-reduces the gradient shards of `units` (FSDP2 units' parameters, in the order backward finishes
    them) over `group` in `dtype`, overlapping backward. `final` is False on microbatches before the last."""

    def __init__(self, units: list[list[nn.Parameter]], group: dist.ProcessGroup, dtype: torch.dtype):
        self.group, self.dtype = group, dtype
        self.units = [_Unit(params) for params in units if params]
        self._unit_of = {p: unit for unit in self.units for p in unit.params}
        self.final = True
        self._next = 0  # the next unit to send, in the order every rank follows
        self._in_flight: deque[tuple[_Unit, torch.Tensor, dist.Work]] = deque()
        self._round_open = False
        device = self.units[0].params[0].device if self.units else torch.device("cpu")
        self._accelerator = None if device.type == "cpu" else torch.get_device_module(device.type)
        self._stream = self._accelerator and self._accelerator.Stream()
        for param in self._unit_of:
            param.register_post_accumulate_grad_hook(self._delivered)

    @property
    def pending(self) -> int:
        """All-reduces issued and not yet waited for."""
        return len(self._in_flight)

    @torch.no_grad()
    def _delivered(self, param: nn.Parameter) -> None:
        if not self.final:
            return
        if not self._round_open:
            self._round_open = True
            at_backward_end(self.finish)
        self._unit_of[param].delivered += 1
        while self._next < len(self.units) and self._full(self.units[self._next]):
            self._send(self.units[self._next])

    @staticmethod
    def _full(unit: _Unit) -> bool:
        return unit.delivered == len(unit.params)

    @contextlib.contextmanager
    def _on_own_stream(self) -> Iterator[None]:
        """On an accelerator, after what the compute stream has queued (the gradients), on a stream of its own."""
        if self._accelerator is None:
            yield
            return
        self._stream.wait_stream(self._accelerator.current_stream())
        with self._accelerator.stream(self._stream):
            yield

    def _send(self, unit: _Unit) -> None:
        """Copy the unit's gradient shards (zeros where this rank has none) and presence flags into one buffer
        and start its all-reduce, once fewer than `IN_FLIGHT` are pending (which bounds the buffers)."""
        while len(self._in_flight) >= IN_FLIGHT:
            self._receive(*self._in_flight.popleft())
        with self._on_own_stream():
            flat = torch.empty(sum(unit.sizes) + len(unit.params), dtype=self.dtype, device=unit.params[0].device)
            *pieces, flags = flat.split(unit.sizes + [len(unit.params)])
            flags.copy_(torch.tensor([p.grad is not None for p in unit.params]))
            for param, piece in zip(unit.params, pieces):
                if param.grad is None:
                    piece.zero_()
                else:
                    piece.copy_(param.grad.to_local().reshape(-1))
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._in_flight.append((unit, flat, work))
        self._next += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Send what is left and wait for every all-reduce; the next round starts afresh."""
        while self._next < len(self.units):
            self._send(self.units[self._next])
        while self._in_flight:
            self._receive(*self._in_flight.popleft())
        self._next, self._round_open = 0, False
        for unit in self.units:
            unit.delivered = 0

    def _receive(self, unit: _Unit, flat: torch.Tensor, work: dist.Work) -> None:
        """Wait for the unit's all-reduce and write the average into its gradients, in place (a parameter only
        another replica had a gradient for gets one)."""
        work.wait()
        if self._accelerator is not None:
            self._accelerator.current_stream().wait_stream(self._stream)
        *pieces, flags = flat.split(unit.sizes + [len(unit.params)])
        for param, piece, shape, present in zip(unit.params, pieces, unit.shapes, flags.tolist()):
            average = piece.view(shape).div(self.group.size())
            if param.grad is not None:
                param.grad.to_local().copy_(average)
            elif present:
                param.grad = DTensor.from_local(average.to(param.dtype), param.device_mesh, param.placements,
                                                run_check=False, shape=param.shape, stride=param.stride())


def unit_parameters(units: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Each unit's trainable parameters that no unit before it holds: what FSDP2 manages in each when the
    units were sharded in this order (blocks, then the root)."""
    seen: set[int] = set()
    managed = []
    for unit in units:
        params = [p for p in unit.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        managed.append(params)
    return managed
