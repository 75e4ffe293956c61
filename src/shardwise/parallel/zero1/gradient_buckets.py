"""ZeRO-1 in bf16/fp16: gradients travel to their owners in fp32 while backward still runs.

As DDP's buckets do: each owner's parameters are grouped, in reverse
registration order (about the order backward produces their gradients), into
buckets of about `shares.BUCKET_BYTES` of fp32. A hook on each parameter notes when
its gradient is complete; when a bucket's last one is, its half-precision
gradients are copied into one fp32 buffer, freed, and `reduce`d to the owner
asynchronously, while backward computes the next ones. Every rank issues the
buckets in the same order — one that fills early waits for those before it —
and at most `shares.IN_FLIGHT` reduces are pending, which bounds the fp32 buffers.

A *round* ends with a backward pass (or, under a pipeline, with the @step's
schedule): the buckets still unsent go then, a parameter without a gradient as
zeros, and every reduce is waited for and handed to the owner. Each parameter
travels with a flag saying whether this rank had its gradient, so the owner can
tell a gradient no replica produced (which the optimizer must skip, as in one
process) from a zero one.

With local accumulation (`accumulate_gradients_locally`: Megatron-LM's
distributed optimizer, DeepSpeed's BF16_Optimizer) the gradients of every
microbatch but a step's last are added into each bucket's fp32 buffer on this
rank instead (4 bytes a parameter of the whole model, while the step runs), and
the buffers travel once, with the last microbatch's gradients added, during its
backward: a reduce per step instead of per microbatch. Weights tied across
pipeline stages add up in those buffers through every pass, and the pipeline sums
their copies across stages there (`local_sum`) before the round ends and sends them.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...torch_internals import at_backward_end
from ..hooks import post_accumulate_grad_hook
from ..local import local_tensor
from . import shares

# Called on the owner with a bucket's parameters, their gradients averaged over the replicas (fp32, flat
# pieces) and how many replicas had each one (a tensor on the device: reading it would wait for the device).
Deliver = Callable[[list[nn.Parameter], list[torch.Tensor], torch.Tensor], None]


def _local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `param`'s gradient, laid out as the parameter is (a DTensor gradient may come
    back replicated or partial where the parameter is sharded)."""
    grad = param.grad
    if isinstance(grad, DTensor):
        if grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad.to_local()
    return grad


class _Bucket:
    """Parameters of one owner whose gradients travel in one reduce."""

    def __init__(self, owner: int, params: list[nn.Parameter]):
        self.owner = owner
        self.params = params
        self.sizes = [local_tensor(p).numel() for p in params]
        starts = [0]
        for size in self.sizes:
            starts.append(starts[-1] + size)
        # where each parameter's piece and flag lie in a `buffer`
        self.piece = {p: (start, size) for p, start, size in zip(params, starts, self.sizes)}
        self.flag = {p: starts[-1] + i for i, p in enumerate(params)}
        self.complete = 0  # parameters whose gradient is final in this round
        self.sums: Optional[torch.Tensor] = None  # local accumulation: earlier microbatches' fp32 sums and flags

    def buffer(self, device: torch.device) -> torch.Tensor:
        """An fp32 buffer of the bucket's gradients, then one flag a parameter."""
        return torch.empty(sum(self.sizes) + len(self.params), dtype=torch.float32, device=device)

    def sums_on(self, device: torch.device) -> torch.Tensor:
        """The local fp32 sums, zeros when nothing was added yet."""
        if self.sums is None:
            self.sums = self.buffer(device).zero_()
        return self.sums

    def split(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(each parameter's flat piece, the flags) of a `buffer`."""
        *pieces, flags = flat.split(self.sizes + [len(self.params)])
        return pieces, flags


def _fill(params: list[nn.Parameter], owner_of: dict[nn.Parameter, int]) -> list[_Bucket]:
    """Buckets of one owner each, in the order they fill when gradients come in the order of `params`."""
    sizes = [local_tensor(p).numel() for p in params]
    filled = shares.fill_buckets(sizes, [owner_of[p] for p in params], shares.BUCKET_BYTES)
    return [_Bucket(owner, [params[i] for i in indices]) for owner, indices in filled]


class GradientBuckets:
    """Reduces the gradients of `owner_of`'s trainable parameters to their owners in buckets, during backward.

    `passes`: None ends a round with every backward pass; a number k means each parameter's gradient is
    complete after k backward passes (a pipeline schedule's microbatches) and the caller ends the round
    with `end_round` once the schedule is done. Parameters in `deferred` are sent only when the round ends
    (tied weights whose gradients the pipeline sums across stages after the schedule). `accumulate_locally`:
    passes before the last add their gradients into fp32 buffers here; without a pipeline the last is the one
    during which `syncing()` holds (the model's microbatch_context on its last microbatch).
    """

    def __init__(self, owner_of: dict[nn.Parameter, int], group: dist.ProcessGroup, deliver: Deliver,
                 passes: Optional[int] = None, deferred: frozenset[int] = frozenset(),
                 accumulate_locally: bool = False, syncing: Callable[[], bool] = lambda: True):
        self.group, self.deliver, self.passes = group, deliver, passes
        self.accumulate_locally, self.syncing = accumulate_locally, syncing
        backward_order = [p for p in reversed(owner_of) if p.requires_grad]
        self.buckets = (_fill([p for p in backward_order if id(p) not in deferred], owner_of)
                        + _fill([p for p in backward_order if id(p) in deferred], owner_of))
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._passes_seen = {p: 0 for p in self._bucket_of}
        self._next = 0  # the next bucket to send, in the order every rank follows
        self._in_flight: deque[tuple[_Bucket, torch.Tensor, Optional[dist.Work]]] = deque()
        self._round_open = False
        self._deferred = deferred
        for param in self._bucket_of:
            if id(param) not in deferred or accumulate_locally:
                post_accumulate_grad_hook(param, self._gradient_accumulated)

    @torch.no_grad()
    def _gradient_accumulated(self, param: nn.Parameter) -> None:
        if id(param) in self._deferred:  # accumulating locally: every pass, summed across stages at the end
            self._add_locally(param)
            return
        if self.passes is not None:
            self._passes_seen[param] += 1
            if self._passes_seen[param] < self.passes:
                if self.accumulate_locally:
                    self._add_locally(param)
                return
        elif self.accumulate_locally and not self.syncing():
            self._add_locally(param)
            return
        elif not self._round_open:
            at_backward_end(self.end_round)
            self._round_open = True
        self._bucket_of[param].complete += 1
        while self._next < len(self.buckets) and self._full(self.buckets[self._next]):
            self._send(self.buckets[self._next])

    @staticmethod
    def _full(bucket: _Bucket) -> bool:
        return bucket.complete == len(bucket.params)

    def _add_locally(self, param: nn.Parameter) -> None:
        """Add `param`'s gradient into its bucket's fp32 sums on this rank, flag it, and free it."""
        self._flagged_sum(param).add_(_local_grad(param).reshape(-1))
        param.grad = None

    def _flagged_sum(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s piece of its bucket's local sums, its flag set (this rank has a gradient for it)."""
        bucket = self._bucket_of[param]
        sums = bucket.sums_on(local_tensor(param).device)
        sums[bucket.flag[param]] = 1.0
        return sums.narrow(0, *bucket.piece[param])

    def local_sum(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """A tied weight's fp32 sum on this rank, which stands for its gradient until the round ends (flagged as
        present: the pipeline writes the sum over its copies into it); None for any other parameter, or without
        local accumulation."""
        if not self.accumulate_locally or id(param) not in self._deferred or param not in self._bucket_of:
            return None
        return self._flagged_sum(param)

    @property
    def holds_sums(self) -> bool:
        """Local accumulation has gradients on this rank that no reduce has taken yet."""
        return any(bucket.sums is not None for bucket in self.buckets)

    def discard_sums(self) -> None:
        """Forget the locally accumulated gradients (the optimizer's zero_grad)."""
        for bucket in self.buckets:
            bucket.sums = None

    @torch.no_grad()
    def end_round(self) -> None:
        """Send what is left, wait for every reduce, hand the sums to the owners; the next round starts afresh."""
        while self._next < len(self.buckets):
            self._send(self.buckets[self._next])
        while self._in_flight:
            self._receive(*self._in_flight.popleft())
        self._next, self._round_open = 0, False
        for bucket in self.buckets:
            bucket.complete = 0
        self._passes_seen = dict.fromkeys(self._passes_seen, 0)

    def _send(self, bucket: _Bucket) -> None:
        """Copy the bucket's gradients into one fp32 buffer (flags after them), free them, start the reduce."""
        while len(self._in_flight) >= shares.IN_FLIGHT:
            self._receive(*self._in_flight.popleft())
        params = bucket.params
        summed, bucket.sums = bucket.sums, None
        flat = summed if summed is not None else bucket.buffer(local_tensor(params[0]).device)
        pieces, flags = bucket.split(flat)
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
        for param, piece, has in zip(params, pieces, present.tolist()):
            if has:
                grad = _local_grad(param).reshape(-1)
                if summed is None:
                    piece.copy_(grad)
                else:
                    piece.add_(grad)
                param.grad = None
            elif summed is None:
                piece.zero_()
        flags.copy_(present if summed is None else torch.maximum(flags, present.to(flags.device)))
        work = (dist.reduce(flat, dst=bucket.owner, group=self.group, async_op=True)
                if self.group.size() > 1 else None)
        self._in_flight.append((bucket, flat, work))
        self._next += 1

    def _receive(self, bucket: _Bucket, flat: torch.Tensor, work: Optional[dist.Work]) -> None:
        if work is not None:
            work.wait()
        if bucket.owner != dist.get_rank():
            return
        pieces, flags = bucket.split(flat)
        replicas = self.group.size()
        self.deliver(bucket.params, [piece.div_(replicas) for piece in pieces], flags)
