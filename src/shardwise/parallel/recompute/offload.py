"""Activation offloading (SMP v1's `offload_activations`, `activation_loading_horizon`).

A checkpointed region keeps only its inputs for backward; torch's non-reentrant
checkpoint saves them as saved tensors before the region runs, so a
`saved_tensors_hooks` pair around the checkpoint call sees exactly them (what the
region computes inside is packed by checkpoint's own, innermost hooks).

Two parts, so the order of moves can be tested where nothing moves:

- `OffloadSchedule` is the bookkeeping: it numbers regions in forward order, has
  the mover store each kept input, and when backward reaches a region (its first
  unpack) fetches that region and the `horizon` regions packed just before it
  that still live (the ones backward reaches next in a plain step; under a
  pipeline, other microbatches' regions may sit between them).
- A mover does the copies: `ToHost` (pinned host buffers, a side stream, events)
  on an accelerator; `StayOnDevice` on a CPU device, whose memory is the host's.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, ContextManager, Iterator, NamedTuple, Optional, Protocol

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import noop_context_fn


ContextFn = Callable[[], tuple[ContextManager, ContextManager]]  # checkpoint's context_fn


class Mover(Protocol):
    """Stores a tensor away from the device and brings it back: `take(fetch(store(t)))` equals `t`."""

    def store(self, tensor: torch.Tensor) -> Any: ...

    def fetch(self, stored: Any) -> Any: ...

    def take(self, fetched: Any) -> torch.Tensor: ...


class StayOnDevice:
    """A CPU device: host and device memory are the same, so every tensor stays where it is."""

    def store(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def fetch(self, stored: torch.Tensor) -> torch.Tensor:
        return stored

    def take(self, fetched: torch.Tensor) -> torch.Tensor:
        return fetched


class _OnHost(NamedTuple):
    host: torch.Tensor


class _Arriving(NamedTuple):
    tensor: torch.Tensor
    copied: torch.Event


class ToHost:
    """An accelerator: copies to pinned host buffers and back on a side stream, so the copies overlap compute.

    Tensors not on `device`, and tensor subclasses (DTensor), stay where they are."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.Stream(device)

    def _after_current_work(self) -> None:
        """The side stream waits for what the compute stream queued (the tensor to copy, the memory's last use)."""
        self.side.wait_stream(torch.accelerator.current_stream(self.device))

    def store(self, tensor: torch.Tensor) -> Any:
        if tensor.device != self.device or type(tensor) is not torch.Tensor:
            return tensor
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        self._after_current_work()
        with self.side:
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.side)  # its device memory is not reused before the copy has read it
        return _OnHost(host)

    def fetch(self, stored: Any) -> Any:
        if not isinstance(stored, _OnHost):
            return stored
        tensor = torch.empty_like(stored.host, device=self.device)
        self._after_current_work()
        with self.side:
            tensor.copy_(stored.host, non_blocking=True)
        tensor.record_stream(self.side)
        return _Arriving(tensor, self.side.record_event())

    def take(self, fetched: Any) -> torch.Tensor:
        if not isinstance(fetched, _Arriving):
            return fetched
        torch.accelerator.current_stream(self.device).wait_event(fetched.copied)
        return fetched.tensor


class _Region:
    """One checkpointed call's kept inputs, as the mover stored them; `arriving` while fetched to the device,
    `reached` once backward has come to it."""

    def __init__(self) -> None:
        self.number: Optional[int] = None  # forward order, given at its first pack
        self.stored: list[Any] = []
        self.arriving: Optional[list[Any]] = None
        self.reached = False
        self.taken = 0


class _Kept(NamedTuple):
    """What autograd holds for one kept input (it keeps the region alive as long as its graph lives)."""
    region: _Region
    index: int


class OffloadSchedule:
    """Which region's kept inputs are stored, fetched and taken, and when (see the module docstring)."""

    def __init__(self, mover: Mover, horizon: int):
        self.mover = mover
        self.horizon = horizon
        self.regions_packed = 0
        self.first_step_checked = False
        self._regions: weakref.WeakValueDictionary[int, _Region] = weakref.WeakValueDictionary()  # pack order
        self._depth = 0  # > 0 inside a region's forward or recomputation

    @contextlib.contextmanager
    def region(self) -> Iterator[ContextFn]:
        """Around one checkpoint call; yields the `context_fn` to give it. A region nested in another keeps
        nothing of its own (the outer region recomputes it), so it is left to checkpoint alone."""
        if self._depth:
            yield noop_context_fn
            return
        with saved_tensors_hooks(functools.partial(self._pack, _Region()), self._unpack):
            yield self._inside_twice

    @contextlib.contextmanager
    def _inside(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _inside_twice(self) -> tuple[ContextManager, ContextManager]:
        """checkpoint's context_fn: one context for the region's forward, one for its recomputation."""
        return self._inside(), self._inside()

    def _pack(self, region: _Region, tensor: torch.Tensor) -> _Kept:
        if region.number is None:
            region.number = self.regions_packed
            self.regions_packed += 1
            self._regions[region.number] = region
        region.stored.append(self.mover.store(tensor))
        return _Kept(region, len(region.stored) - 1)

    def _unpack(self, kept: _Kept) -> torch.Tensor:
        region = kept.region
        if not region.reached:
            self._reached(region)
        tensor = self.mover.take(region.arriving[kept.index])
        region.arriving[kept.index] = None  # the device copy lives no longer than backward needs it
        region.taken += 1
        if region.taken == len(region.stored):  # back to stored only: a retained graph's next backward fetches anew
            region.arriving, region.reached, region.taken = None, False, 0
        return tensor

    def _reached(self, region: _Region) -> None:
        """Backward reached `region`: fetch it, then the `horizon` live regions packed just before it."""
        region.reached = True
        earlier = [other for number, other in self._regions.items() if number < region.number]
        for other in [region, *reversed(earlier[max(0, len(earlier) - self.horizon):])]:
            if other.arriving is None:
                other.arriving = [self.mover.fetch(stored) for stored in other.stored]


def schedule_for_device(device: torch.device, horizon: int) -> OffloadSchedule:
    """A schedule whose mover copies to host memory, or keeps tensors where they are on a CPU device (whose
    memory is the host's: `runtime/init.py` says at `init` that nothing moves)."""
    return OffloadSchedule(StayOnDevice() if device.type == "cpu" else ToHost(device), horizon)


def offloaded_region(schedule: Optional[OffloadSchedule]) -> ContextManager[ContextFn]:
    """Around a checkpoint call: its kept inputs go where `schedule` stores them (None: they stay)."""
    return schedule.region() if schedule is not None else contextlib.nullcontext(noop_context_fn)


@contextlib.contextmanager
def first_step_check(schedule: Optional[OffloadSchedule], warn: Callable[[list[tuple[str, str]]], None]
                     ) -> Iterator[None]:
    """Around a @step: after the first training step, `warn` names offloading that found nothing to move."""
    if schedule is None or schedule.first_step_checked or not torch.is_grad_enabled():
        yield
        return
    before = schedule.regions_packed
    yield
    schedule.first_step_checked = True
    if schedule.regions_packed == before:
        warn([("offload_activations", ("no activation-checkpointed region ran in the first training "
                                       "step, and only what checkpointed regions keep is offloaded; "
                                       "checkpoint modules with sw.set_activation_checkpointing"))])
