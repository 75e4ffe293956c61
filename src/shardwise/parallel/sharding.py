"""Data parallelism over the dp axes: DDP, ZeRO-2, ZeRO-3 and MiCS (ZeRO-1's optimizer side is zero1/).

ZeRO-2/3 use FSDP2 (`fully_shard`) on the `dp_shard` axis. With `dp_replicate`
> 1 that is MiCS: parameters are gathered and gradients reduce-scattered inside a
partition group, and only the gradient all-reduce crosses groups, overlapping
backward (cross_group.py). Under a pipeline, whose stages reduce-scatter after
the schedule, outside backward, FSDP2's own hybrid sharding (the 2-D mesh) does it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..runtime.mesh import ParallelMesh
from ..runtime.state import current
from ..topology.decisions import Wrapping
from ..torch_internals import replicate, reshard_after_forward_over
from . import precision
from .cross_group import CrossGroupReduction, unit_parameters
from .cross_group_step import bind_step_as_shards_land
from .optimizer_offload import sharded_offload_policy
from .strategy import Strategy
from .wrap import sharding_units


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
        with self.module.no_sync() if skip_sync else contextlib.nullcontext(), super().microbatch_context(last):
            yield


class Sharded(Strategy):
    """FSDP2 (ZeRO-2/3, MiCS): gradients reduce-scattered every microbatch so they stay sharded,
    the cross-group all-reduce (`cross_group`, or FSDP2's own in a hybrid mesh) only after the last one."""

    def __init__(self, module: FSDPModule, cross_group: Optional[CrossGroupReduction], hybrid: bool):
        super().__init__(module, module)
        self.cross_group, self.hybrid = cross_group, hybrid

    @contextlib.contextmanager
    def microbatch_context(self, last: bool) -> Iterator[None]:
        if self.cross_group is not None:
            self.cross_group.final = last
        if self.hybrid:
            self.module.set_requires_all_reduce(last)
        self.module.set_is_last_backward(last)
        with super().microbatch_context(last):
            yield
        if last and not torch.is_grad_enabled():
            reshard_gathered(self.module)


def reshard_gathered(module: nn.Module) -> None:
    """Free the parameters FSDP2's forward gathered in `module`. Training's backward does it; an evaluation
    step has no backward, and ZeRO-2 blocks (and the root in every stage) would stay whole until the next."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _cross_group_dtype(mesh: ParallelMesh) -> Optional[torch.dtype]:
    """The dtype of the overlapped cross-group all-reduce, or None where there is none: one partition group,
    or a pipeline (its stages get FSDP2's hybrid sharding)."""
    config = current("sharding").config
    if mesh["dp_replicate"].size() == 1 or config.pipeline_parallel_degree > 1:
        return None
    return torch.bfloat16 if config.cross_group_reduce_dtype == "bf16" else torch.float32


def _dp_mesh(mesh: ParallelMesh, hybrid: bool) -> DeviceMesh:
    return mesh["dp_replicate", "dp_shard"] if hybrid else mesh["dp_shard"]


def apply_data_parallel(model: nn.Module, mesh: ParallelMesh, how: Wrapping, cast: Optional[torch.dtype], *,
                        auto_wrap_min_params: int, reshard_after_forward: Union[bool, int] = True,
                        before_shard: Optional[Callable[[nn.Module], None]] = None,
                        ddp_options: Optional[Mapping[str, Any]] = None) -> Strategy:
    """Wrap `model` over the data-parallel axes of `mesh` as `how` says (topology/decisions.py).

    `cast`: the dtype FSDP2's policy computes in (None: as stored). `reshard_after_forward=False`
    keeps gathered parameters until the end of backward, as ZeRO-2 does (a pipeline schedule that
    splits backward needs them); an int n (ZeRO++ hpZ) keeps them sharded over n ranks, the secondary
    groups of `mesh["hpz"]`, so that backward gathers them there. Sharding calls `before_shard` on
    every unit (blocks of at least `auto_wrap_min_params` parameters where the model names none), then
    the root, right before sharding it (delayed initialisation materialises them there). `ddp_options` go to torch's
    DistributedDataParallel where `how` is DDP (SMP's DistributedModel arguments: bucket_cap_mb, ...).
    """
    if how is Wrapping.SHARDED:
        cross_group_dtype = _cross_group_dtype(mesh)
        hybrid = mesh["dp_replicate"].size() > 1 and cross_group_dtype is None
        dp_mesh = _dp_mesh(mesh, hybrid)
        prepare = before_shard or (lambda unit: None)
        offload = sharded_offload_policy()
        units = sharding_units(model, auto_wrap_min_params)
        secondary = not isinstance(reshard_after_forward, bool)
        with reshard_after_forward_over(mesh["hpz"]) if secondary else contextlib.nullcontext():
            for unit in units:
                prepare(unit)
                fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                            mp_policy=precision.sharded_policy(cast, root=False), offload_policy=offload)
            prepare(model)
            fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=precision.sharded_policy(cast, root=True), offload_policy=offload)
        if cross_group_dtype is None:
            return Sharded(model, None, hybrid)  # fully_shard turned `model` into an FSDPModule in place
        *blocks, root = unit_parameters([*units, model])  # as FSDP2 took them; backward ends with the root
        deferred = current("sharding").config.cross_group_overlap == "forward"
        cross_group = CrossGroupReduction([*reversed(blocks), root], mesh["dp_replicate"].get_group(),
                                          cross_group_dtype, [*reversed(units), model] if deferred else None)
        strategy = Sharded(model, cross_group, hybrid)
        if deferred:
            strategy.binding = bind_step_as_shards_land(cross_group)
        return strategy
    if how is Wrapping.REPLICATE:
        return Replicated(replicate(model, mesh=mesh["rdp"], mp_policy=precision.sharded_policy(cast, root=True)), model)
    if how is Wrapping.DDP:
        return Replicated(DistributedDataParallel(model, device_mesh=mesh["rdp"], **(ddp_options or {})), model)
    return Replicated(model, model)  # one replica, or ZeRO-1's replicas whose optimizer reduces gradients
