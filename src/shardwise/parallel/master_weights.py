"""ZeRO-1 in bf16/fp16: half-precision replicas, fp32 master copies of each rank's share only.

As in SageMaker's model-parallel library and DeepSpeed, every data-parallel
replica keeps parameters and gradients in the compute dtype (2 + 2 bytes per
parameter) and the user's optimizer steps fp32 masters of this rank's share
(optimizer_state.py deals the shares): 4 bytes of master and 8 of Adam's moments
per parameter, divided by the replicas.

Gradients reach the owners in fp32. After every microbatch's backward each rank
copies its half-precision gradients, one owner's share at a time, into an fp32
buffer and `reduce`s it to the owner, which adds it into the fp32 gradients of
its masters (and the half-precision gradients are freed); a pipeline schedule
runs its microbatches itself, so there `optimizer.step()` reduces them once.

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

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .clipping import clip_grad_norm_
from .optimizer_state import OptimizerStateSharding, local_tensor


def _local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `param`'s gradient, laid out as the parameter is (a DTensor gradient may come
    back replicated or partial where the parameter is sharded)."""
    grad = param.grad
    if isinstance(grad, DTensor):
        if grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad.to_local()
    return grad


def _split_tensor_parallel(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements)


class MasterWeights:
    """The fp32 masters the wrapped optimizer steps, and the way gradients reach them and values leave them."""

    def __init__(self, optimizer: torch.optim.Optimizer, sharding: OptimizerStateSharding, tp_rank: int):
        self.sharding = sharding
        self.tp_rank = tp_rank
        self.masters: dict[nn.Parameter, torch.Tensor] = {}
        for group in optimizer.param_groups:  # already this rank's share
            group["params"] = [self._master(p) if p.requires_grad else p for p in group["params"]]
        self.param_of = {id(master): param for param, master in self.masters.items()}
        self.trainable = [p for p in sharding.owner_of if p.requires_grad]
        self.shares = [(owner, [p for p in self.trainable if sharding.owner_of[p] == owner])
                       for owner in sorted({sharding.owner_of[p] for p in self.trainable})]
        self._versions = self._current_versions()

    def _master(self, param: nn.Parameter) -> torch.Tensor:
        master = local_tensor(param).detach().to(torch.float32, copy=True)
        self.masters[param] = master
        return master

    def _current_versions(self) -> dict[nn.Parameter, int]:
        return {p: local_tensor(p)._version for p in self.masters}

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Add the replicas' half-precision gradients, averaged in fp32, into the owners' master gradients."""
        present = self._present()
        if not present:
            return
        pending = None
        for owner, params in self.shares:
            params = [p for p in params if p in present]
            if not params:
                continue
            flat = self._take_gradients(params)
            work = (dist.reduce(flat, dst=owner, group=self.sharding.group, async_op=True)
                    if self.sharding.group.size() > 1 else None)
            if pending is not None:
                self._receive(*pending)
            pending = (owner, params, flat, work)
        if pending is not None:
            self._receive(*pending)

    def _present(self) -> set[nn.Parameter]:
        """Parameters with a gradient on any replica (one missing elsewhere counts as zeros, as in one process)."""
        if not self.trainable:
            return set()
        device = local_tensor(self.trainable[0]).device
        has = torch.tensor([p.grad is not None for p in self.trainable], dtype=torch.int32, device=device)
        if self.sharding.group.size() > 1:
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.sharding.group)
        return {p for p, flag in zip(self.trainable, has.tolist()) if flag}

    @staticmethod
    def _take_gradients(params: list[nn.Parameter]) -> torch.Tensor:
        """The local gradients of `params` as one fp32 vector; the half-precision ones are freed."""
        sizes = [local_tensor(p).numel() for p in params]
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=local_tensor(params[0]).device)
        for param, piece in zip(params, flat.split(sizes)):
            if param.grad is None:
                piece.zero_()
            else:
                piece.copy_(_local_grad(param).reshape(-1))
                param.grad = None
        return flat

    def _receive(self, owner: int, params: list[nn.Parameter], flat: torch.Tensor, work: Optional[dist.Work]) -> None:
        if work is not None:
            work.wait()
        if owner != dist.get_rank():
            return
        flat.div_(self.sharding.group.size())
        for param, piece in zip(params, flat.split([local_tensor(p).numel() for p in params])):
            master = self.masters[param]
            if master.grad is None:
                master.grad = piece.view_as(master)
            else:
                master.grad.add_(piece.view_as(master))

    @torch.no_grad()
    def adopt_changed_parameters(self) -> None:
        """Reload the masters of parameters changed outside the optimizer (e.g. `model.load_state_dict`
        after the optimizer was built), so that the next step starts from the new values; a value that
        is its master rounded (the same checkpoint) keeps the master."""
        for param, version in self._current_versions().items():
            value, master = local_tensor(param), self.masters[param]
            if version != self._versions[param] and not torch.equal(value, master.to(value.dtype)):
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
        """Round the stepped masters into the half-precision parameters and send them to the other replicas."""
        for param, master in self.masters.items():
            local_tensor(param).copy_(master)
            master.grad = None
        self.sharding.broadcast_parameters()
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
