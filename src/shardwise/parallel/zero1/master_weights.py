"""ZeRO-1 in bf16/fp16: half-precision replicas, fp32 master copies of each rank's share only.

As in SageMaker's model-parallel library and DeepSpeed, every data-parallel
replica keeps parameters and gradients in the compute dtype (2 + 2 bytes per
parameter) and the user's optimizer steps fp32 masters of this rank's share
(optimizer_state.py deals the shares): 4 bytes of master and 8 of Adam's moments
per parameter, divided by the replicas.

Gradients reach the owners in fp32 during every backward pass: gradient_buckets.py
copies them, bucket by bucket as backward produces them, into fp32 buffers it
`reduce`s to each bucket's owner, which adds them into the fp32 gradients of its
masters (and the half-precision gradients are freed). Under a pipeline the
schedule's microbatches accumulate in the compute dtype and travel during the
last one's backward.

With `offload_optimizer_state` the masters, and with them the optimizer's states,
live in host memory (optimizer_offload.py); fp32 training gets masters then too,
host copies of its share. The gradients wait on the device until the step hands
them over.

Why fp32: a sum of n replicas' gradients in bf16 loses about log2(n) of bf16's 8
mantissa bits. Why every microbatch: accumulating m microbatches in bf16 adds an
error that grows like √m (docs/sharding.md has the measurement), while the
owner's fp32 accumulator costs only 4 bytes per parameter of its share. Why a
reduce to the owner: it moves half the bytes of an all-reduce, and nobody else
needs the sum.

Why not torch DDP or FSDP2's `replicate`: DDP cannot bucket tensor-parallel
DTensors nor follow a pipeline schedule, and FSDP2 keeps a second copy of every
parameter from forward to backward and accumulates microbatches in fp32 over
the whole model (4 bytes per parameter), which is what this layout avoids.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...torch_internals import version
from ..clipping import clip_grad_norm_
from ..local import local_tensor
from ..sharding.optimizer_offload import HostOffload, hand_gradients_to, master_copy
from .gradient_buckets import GradientBuckets
from .optimizer_state import OptimizerStateSharding


def _split_tensor_parallel(param: torch.Tensor) -> bool:
    """Split by tensor parallelism (`Shard`, or the `_StridedShard` of packed Q/K/V, which is no `Shard`)."""
    return isinstance(param, DTensor) and any(not p.is_replicate() for p in param.placements)


class MasterWeights:
    """The fp32 masters the wrapped optimizer steps, and the way gradients reach them and values leave them."""

    def __init__(self, optimizer: torch.optim.Optimizer, sharding: OptimizerStateSharding, tp_rank: int,
                 passes: Optional[int] = None, deferred: frozenset[int] = frozenset(),
                 offload: Optional[HostOffload] = None, accumulate_locally: bool = False,
                 syncing: Callable[[], bool] = lambda: True):
        """`passes` and `deferred` say when gradients are complete (GradientBuckets): None after every
        backward pass; under a pipeline, the schedule's microbatches, and its tied weights' ids deferred.
        `offload`: the masters live in host memory. `accumulate_locally`, `syncing`: microbatches' gradients
        add up in fp32 on this rank and travel once a step (GradientBuckets)."""
        self.sharding = sharding
        self.offload = offload
        self.tp_rank = tp_rank
        self.masters: dict[nn.Parameter, torch.Tensor] = {}
        for group in optimizer.param_groups:  # already this rank's share
            group["params"] = [self._master(p) if p.requires_grad else p for p in group["params"]]
        self.param_of = {id(master): param for param, master in self.masters.items()}
        self._gradients: dict[nn.Parameter, torch.Tensor] = {}  # since the last step, on the device
        self._replicas_with_grad: dict[nn.Parameter, torch.Tensor] = {}
        self.buckets = GradientBuckets(sharding.owner_of, sharding.group, self._accumulate, passes, deferred,
                                       accumulate_locally, syncing)
        self._versions = self._current_versions()

    def _master(self, param: nn.Parameter) -> torch.Tensor:
        master = master_copy(local_tensor(param), self.offload)
        self.masters[param] = master
        return master

    def _current_versions(self) -> dict[nn.Parameter, int]:
        return {p: version(p) for p in self.masters}  # the DTensor's own: writes through it bump only that one

    @torch.no_grad()
    def _accumulate(self, params: list[nn.Parameter], grads: list[torch.Tensor], replicas: torch.Tensor) -> None:
        """Add one bucket's averaged fp32 gradients into the masters' gradients, kept on the device (a master in
        host memory gets its own at the step); count on the device the replicas that had each, so backward never
        waits for the device."""
        for param, grad, count in zip(params, grads, replicas.unbind()):
            master = self.masters[param]
            if param in self._gradients:
                self._gradients[param].add_(grad.view(master.shape))
                self._replicas_with_grad[param] = self._replicas_with_grad[param] + count
                continue
            self._gradients[param], self._replicas_with_grad[param] = grad.view(master.shape), count
            if grad.device == master.device:
                master.grad = self._gradients[param]

    def hand_over_gradients(self) -> None:
        """Give the masters their gradients; a master whose parameter no replica had a gradient for keeps none,
        so the optimizer skips it as it would in one process (read at the step, which waits for the device anyway).
        Sums a step left on the ranks (no microbatch said it was the last) travel now."""
        if self.buckets.holds_sums:
            self.buckets.end_round()
        counts = torch.stack(list(self._replicas_with_grad.values())).tolist() if self._replicas_with_grad else []
        present = [param for param, count in zip(self._replicas_with_grad, counts) if count]
        for param in self._replicas_with_grad.keys() - set(present):
            self.masters[param].grad = None
        hand_gradients_to([self.masters[p] for p in present], [self._gradients[p] for p in present])
        self.discard_gradients()

    def discard_gradients(self) -> None:
        """Forget the gradients kept since the last step (the optimizer's zero_grad)."""
        self._gradients, self._replicas_with_grad = {}, {}
        self.buckets.discard_sums()

    @torch.no_grad()
    def adopt_changed_parameters(self) -> None:
        """Reload the masters of parameters changed outside the optimizer (e.g. `model.load_state_dict`
        after the optimizer was built), so that the next step starts from the new values; a value that
        is its master rounded (the same checkpoint) keeps the master."""
        for param, now in self._current_versions().items():
            value, master = local_tensor(param), self.masters[param]
            if now != self._versions[param] and not torch.equal(value, master.to(value.device, value.dtype)):
                master.copy_(value)

    def clip_grad_norm_(self, max_norm: float, device: torch.device, tied_copies: set[int]) -> torch.Tensor:
        """Clip the master gradients by the norm over the whole model: every rank holds a disjoint part
        (its share, its tensor-parallel piece, its pipeline stage), so the squares are summed over all ranks.
        A parameter tensor parallelism leaves whole counts on tp rank 0 only; a tied copy not at all."""
        def counted(master: torch.Tensor) -> bool:
            param = self.param_of[id(master)]
            return id(param) not in tied_copies and (self.tp_rank == 0 or _split_tensor_parallel(param))

        return clip_grad_norm_(list(self.masters.values()), max_norm, device, across=dist.group.WORLD,
                               counted=counted)

    @torch.no_grad()
    def write_back(self) -> None:
        """Round the stepped masters into the half-precision parameters (the caller then broadcasts them)."""
        for param, master in self.masters.items():
            local_tensor(param).copy_(master)
            master.grad = None
        self._versions = self._current_versions()

    @torch.no_grad()
    def load_values(self, values: Mapping[nn.Parameter, torch.Tensor]) -> None:
        """Exact values by parameter (whole tensors or this rank's tensor-parallel piece): the masters take
        them, every parameter given takes them rounded."""
        for param, value in values.items():
            value = local_tensor(value)
            if param in self.masters:
                self.masters[param].copy_(value)
            local_tensor(param).copy_(value)
        self._versions = self._current_versions()

    def state_dict(self) -> list[torch.Tensor]:
        return list(self.masters.values())

    @torch.no_grad()
    def load_state_dict(self, masters: list[torch.Tensor]) -> None:
        if len(masters) != len(self.masters):
            raise ValueError(f"the optimizer state holds {len(masters)} fp32 master tensors but this rank owns "
                             f"{len(self.masters)}; load a state saved with the same layout and shard_optimizer_state")
        for master, saved in zip(self.masters.values(), masters):
            master.copy_(saved)
        self.write_back()
