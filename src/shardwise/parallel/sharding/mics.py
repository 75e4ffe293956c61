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

Deferred (`cross_group_overlap: forward`, `forward_modules` given), the backward
pass does not wait: the all-reduces go on through the optimizer step and the
next forward, which waits in each unit's forward pre-hook for that unit's
shard only. Half the units go as backward finishes them, the rest in the order
that forward needs them (`send_order`). Each lands when something waits for it
or finds it done (`advance`, and every delivery in backward): its average is
written into the gradients unless they changed since backward delivered them
(`optimizer.zero_grad()` after the step), in which case it is handed aside to
the listeners (the optimizer update, mics_step.py, steps the shard as
it lands).
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...torch_internals import at_backward_end, version
from ..hooks import post_accumulate_grad_hook
from ..zero1.shares import IN_FLIGHT


class _Unit:
    """One FSDP2 unit's trainable parameters: one all-reduce."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.shapes = [p.to_local().shape for p in params]
        self.sizes = [shape.numel() for shape in self.shapes]
        self.delivered = 0  # parameters whose shard FSDP2 has handed over on the final pass
        self.landed = False  # its all-reduce has been waited for, this round
        self.sent: list[tuple[Optional[torch.Tensor], Optional[int]]] = []  # each gradient and its version, sent
        self.aside: dict[nn.Parameter, Optional[torch.Tensor]] = {}  # averages whose gradient changed since sent


def _held(param: nn.Parameter) -> tuple[Optional[torch.Tensor], Optional[int]]:
    return param.grad, None if param.grad is None else version(param.grad)


def _changed(param: nn.Parameter, sent: tuple[Optional[torch.Tensor], Optional[int]]) -> bool:
    """Whether the parameter's gradient was replaced or written since it was `sent` (`_held` then)."""
    grad, written = _held(param)
    return grad is not sent[0] or written != sent[1]


def _as_grad(param: nn.Parameter, local: torch.Tensor) -> DTensor:
    """`local` (this rank's shard) as a gradient of `param`."""
    return DTensor.from_local(local.to(param.dtype), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def send_order(units: list) -> list:
    """Units (in the order backward finishes them, the root last) in the order a deferred reduction sends them:
    the first half (at least `IN_FLIGHT`) as backward finishes them, to keep the link busy while it runs; the
    rest, which backward finishes last and the next forward needs first, in the order that forward needs them.
    (The sweep of that split in docs/benchmarks.md: fewer ahead leave the link idle in backward, more make the
    next forward wait longer.)"""
    ahead = max(IN_FLIGHT, len(units) // 2)
    return units[:ahead] + units[ahead:][::-1]


def _done(work: dist.Work) -> bool:
    """Whether an all-reduce has finished, without waiting for it."""
    return work.is_completed()


class CrossGroupReduction:
    """All-reduces the gradient shards of `units` (FSDP2 units' parameters, in the order backward finishes
    them) over `group` in `dtype`, overlapping backward. `final` is False on microbatches before the last.
    Given the units' `forward_modules`, deferred: also the optimizer step and the next forward, whose hook on
    each unit waits for that unit's all-reduce; `listeners` hear of each unit as it lands."""

    def __init__(self, units: list[list[nn.Parameter]], group: dist.ProcessGroup, dtype: torch.dtype,
                 forward_modules: Optional[list[nn.Module]] = None):
        self.group, self.dtype = group, dtype
        self.units = [_Unit(params) for params in units if params]
        self._unit_of = {p: unit for unit in self.units for p in unit.params}
        self.final = True
        self.deferred = forward_modules is not None
        # every rank sends in this order
        self._order = send_order(self.units) if self.deferred else self.units
        self._next = 0  # the next unit of `_order` to send
        self._in_flight: deque[tuple[_Unit, torch.Tensor, dist.Work]] = deque()
        self._round_open = False
        self._backward_ended = False
        # called with each unit's parameters as it lands (deferred): the optimizer update steps them
        self.listeners: list[Callable[[list[nn.Parameter], dict], None]] = []
        for module, params in zip(forward_modules or [], units):
            if params:
                module.register_forward_pre_hook(functools.partial(self._before_forward, self._unit_of[params[0]]),
                                                 prepend=True)  # before FSDP2 gathers the unit's parameters
        device = self.units[0].params[0].device if self.units else torch.device("cpu")
        self._accelerator = None if device.type == "cpu" else torch.get_device_module(device.type)
        self._stream = self._accelerator and self._accelerator.Stream()
        for param in self._unit_of:
            post_accumulate_grad_hook(param, self._delivered)

    @property
    def pending(self) -> int:
        """All-reduces issued and not yet waited for."""
        return len(self._in_flight)

    @property
    def landing(self) -> bool:
        """A round's all-reduces outlived its backward pass and some are still to land (deferred)."""
        return self._round_open and self._backward_ended

    def landed_params(self) -> list[nn.Parameter]:
        """The parameters of the units landed so far in this round."""
        return [p for unit in self.units if unit.landed for p in unit.params]

    @torch.no_grad()
    def _delivered(self, param: nn.Parameter) -> None:
        if self.landing:  # a unit no forward reached since the last round (outside every forward): land it first
            self.drain()
        if not self.final:
            return
        if not self._round_open:
            self._round_open, self._backward_ended = True, False
            at_backward_end(self._backward_end if self.deferred else self.finish)
        self._unit_of[param].delivered += 1
        if self.deferred:
            self._poll()  # backward goes on whether or not a slot is free
            return
        while self._next < len(self._order) and self._full(self._order[self._next]):
            self._send(self._order[self._next])

    def _full(self, unit: _Unit) -> bool:
        return self._backward_ended or unit.delivered == len(unit.params)

    def _backward_end(self) -> None:
        """Deferred: every unit may go now (one without gradients sends zeros), with the gradients backward
        left, whatever replaces them before it goes; nothing is waited for."""
        self._backward_ended = True
        for unit in self._order[self._next:]:
            unit.sent = [_held(p) for p in unit.params]
        self.advance()

    def keep_unsent(self) -> None:
        """Before gradients are zeroed in place: the units still to be sent keep theirs, the parameters get
        zeros of their own."""
        for unit in self._order[self._next:] if self.landing else []:
            for param, (grad, _) in zip(unit.params, unit.sent):
                if grad is not None and param.grad is grad:
                    param.grad = torch.zeros_like(grad)

    @torch.no_grad()
    def advance(self, until: Optional[_Unit] = None) -> None:
        """Deferred: land the all-reduces that are done and send the next units while a slot is free; with
        `until`, wait for that unit to land (and those sent before it)."""
        while self.landing:
            self._poll()
            if until is None or until.landed or not self._in_flight:
                break
            self._receive(*self._in_flight.popleft())
        if self._round_open and self._backward_ended and all(unit.landed for unit in self.units):
            self._close()

    def _poll(self) -> None:
        """Deferred: land the all-reduces that are done, send what may go while a slot is free."""
        while self._in_flight and _done(self._in_flight[0][2]):
            self._receive(*self._in_flight.popleft())
        while (len(self._in_flight) < IN_FLIGHT and self._next < len(self._order)
               and self._full(self._order[self._next])):
            self._send(self._order[self._next])

    def drain(self) -> None:
        """Deferred: wait for every all-reduce of the round."""
        while self.landing:
            self.advance(self._order[-1])

    def _before_forward(self, unit: _Unit, module: nn.Module, args: tuple) -> None:
        if self.landing and not unit.landed:
            self.advance(unit)

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
        unit.sent = unit.sent or [_held(p) for p in unit.params]
        with self._on_own_stream():
            flat = torch.empty(sum(unit.sizes) + len(unit.params), dtype=self.dtype, device=unit.params[0].device)
            *pieces, flags = flat.split(unit.sizes + [len(unit.params)])
            flags.copy_(torch.tensor([grad is not None for grad, _ in unit.sent]))
            for param, piece, (grad, written) in zip(unit.params, pieces, unit.sent):
                if grad is None:
                    piece.zero_()
                elif version(grad) != written:
                    raise RuntimeError(
                        f"MiCS: a gradient of {tuple(param.shape)} was written in place after backward, before its "
                        "cross-group all-reduce was sent (cross_group_overlap: forward); fix: clear gradients with "
                        "optimizer.zero_grad() only, or set cross_group_overlap: backward")
                else:
                    piece.copy_(grad.to_local().reshape(-1))
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._in_flight.append((unit, flat, work))
        self._next += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Send what is left and wait for every all-reduce; the next round starts afresh."""
        while self._next < len(self._order):
            self._send(self._order[self._next])
        while self._in_flight:
            self._receive(*self._in_flight.popleft())
        self._close()

    def _close(self) -> None:
        self._next, self._round_open, self._backward_ended = 0, False, False
        for unit in self.units:
            unit.delivered, unit.landed, unit.sent, unit.aside = 0, False, [], {}

    def _receive(self, unit: _Unit, flat: torch.Tensor, work: dist.Work) -> None:
        """Wait for the unit's all-reduce and write the average into its gradients, in place (a parameter only
        another replica had a gradient for gets one), or aside where they changed since it was sent."""
        work.wait()
        if self._accelerator is not None:
            self._accelerator.current_stream().wait_stream(self._stream)
        *pieces, flags = flat.split(unit.sizes + [len(unit.params)])
        for param, piece, shape, present, sent in zip(unit.params, pieces, unit.shapes, flags.tolist(), unit.sent):
            average = piece.view(shape).div(self.group.size())
            if _changed(param, sent):
                unit.aside[param] = _as_grad(param, average) if present else None
            elif param.grad is not None:
                param.grad.to_local().copy_(average)
            elif present:
                param.grad = _as_grad(param, average)
        unit.landed = True
        for listener in self.listeners:
            listener(unit.params, unit.aside)


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
