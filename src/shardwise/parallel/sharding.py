"""Data parallelism over the dp axes: DDP, ZeRO-2, ZeRO-3 and MiCS (ZeRO-1's sharding lives with the optimizer).

ZeRO-2/3 use FSDP2 (`fully_shard`) on the `dp_shard` axis; with `dp_replicate`
> 1 the 2-D mesh makes it hybrid sharding, which is MiCS: parameters are
gathered and gradients reduce-scattered inside a partition group, and only the
gradient all-reduce crosses groups.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..config.schema import ShardwiseConfig
from ..runtime.mesh import ParallelMesh
from . import precision
from .wrap import sharding_units


class DataParallel:
    """What the runtime needs from a data-parallel wrapping: the module to call and per-microbatch sync."""

    def __init__(self, module: nn.Module, inner: nn.Module):
        self.module = module  # called in forward
        self.inner = inner  # the user's module, parameters named as they wrote them

    def microbatch_context(self, last: bool) -> ContextManager:
        return contextlib.nullcontext()


class Replicated(DataParallel):
    """DDP (ZeRO-0, and ZeRO-1 in fp32): full replicas, gradients all-reduced once per step.

    Tensor-parallel parameters are DTensors, which `DistributedDataParallel`
    cannot bucket, and a pipeline stage's backward runs piecewise under its
    schedule, which DDP's reducer cannot follow; there the module is replicated
    with FSDP2's `replicate` (same all-reduce, DTensor-aware) instead.
    """

    def microbatch_context(self, last: bool) -> ContextManager:
        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(last)
        if last or not isinstance(self.module, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.module.no_sync()


class Sharded(DataParallel):
    """FSDP2 (ZeRO-2/3, MiCS): gradients reduce-scattered every microbatch so they stay sharded,
    the cross-group all-reduce only after the last one."""

    def __init__(self, module: FSDPModule, hybrid: bool):
        super().__init__(module, module)
        self.sharded = module
        self.hybrid = hybrid

    @contextlib.contextmanager
    def microbatch_context(self, last: bool) -> Iterator[None]:
        if self.hybrid:
            self.sharded.set_requires_all_reduce(last)
        self.sharded.set_is_last_backward(last)
        yield
        if last and not torch.is_grad_enabled():
            reshard_gathered(self.sharded)


def reshard_gathered(module: nn.Module) -> None:
    """Free the parameters FSDP2's forward gathered in `module`. Training's backward does it; an evaluation
    step has no backward, and ZeRO-2 blocks (and the root in every stage) would stay whole until the next."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _dp_mesh(mesh: ParallelMesh, hybrid: bool) -> DeviceMesh:
    return mesh["dp_replicate", "dp_shard"] if hybrid else mesh["dp_shard"]


def apply_data_parallel(model: nn.Module, mesh: ParallelMesh, config: ShardwiseConfig,
                        reshard_after_forward: bool = True,
                        before_shard: Optional[Callable[[nn.Module], None]] = None) -> DataParallel:
    """Wrap `model` for the configured ZeRO stage over the data-parallel axes of `mesh`.

    `reshard_after_forward=False` keeps ZeRO-3's gathered parameters until the end of
    backward, as ZeRO-2 does (a pipeline schedule that splits backward needs them).
    ZeRO-2/3 call `before_shard` on every sharding unit, then the root, right before
    sharding it (delayed initialisation materialises them there).
    """
    stage = config.effective_zero_stage
    if stage >= 2:
        hybrid = mesh["dp_replicate"].size() > 1
        dp_mesh = _dp_mesh(mesh, hybrid)
        reshard = stage == 3 and reshard_after_forward
        prepare = before_shard or (lambda unit: None)
        for unit in sharding_units(model, config.auto_wrap_min_params):
            prepare(unit)
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard,
                        mp_policy=precision.sharded_policy(config, root=False))
        prepare(model)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard,
                    mp_policy=precision.sharded_policy(config, root=True))
        return Sharded(model, hybrid)  # fully_shard turned `model` into an FSDPModule in place
    if config.sharded_master_weights:  # ZeRO-1 in bf16/fp16: the optimizer reduces gradients (master_weights.py)
        precision.store_in_compute_dtype(model, config)
        return Replicated(model, model)
    rdp_mesh = mesh["rdp"]
    if rdp_mesh.size() == 1:
        return Replicated(model, model)
    # DDP can neither bucket DTensors nor follow a pipeline schedule's split forward and backward passes.
    if config.tensor_parallel_degree > 1 or config.pipeline_parallel_degree > 1:
        return Replicated(replicate(model, mesh=rdp_mesh, mp_policy=precision.sharded_policy(config, root=True)), model)
    return Replicated(DistributedDataParallel(model, device_mesh=rdp_mesh), model)
