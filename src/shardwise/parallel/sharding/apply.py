"""Data parallelism over the dp axes as the decisions say: DDP, ZeRO-2, ZeRO-3 and MiCS.

ZeRO-2/3 use FSDP2 (`fully_shard`) on the `dp_shard` axis. With `dp_replicate`
> 1 that is MiCS: parameters are gathered and gradients reduce-scattered inside a
partition group, and only the gradient all-reduce crosses groups, overlapping
backward (mics.py). Under a pipeline, whose stages reduce-scatter after the
schedule, outside backward, FSDP2's own hybrid sharding (the 2-D mesh) does it.
Everything here is given as plain values by `compose`: nothing reads the config.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..mesh import ParallelMesh
from ...config.decisions import CrossGroupSettings, Wrapping
from ...torch_internals import replicate, reshard_after_forward_over
from .. import precision
from ..strategy import OptimizerBinding, Strategy
from .fully_sharded import Sharded
from .mics import CrossGroupReduction, unit_parameters
from .mics_step import bind_step_as_shards_land
from .optimizer_offload import HostOffload, sharded_offload_policy
from .replicated import Replicated
from .units import sharding_units

_LINK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _dp_mesh(mesh: ParallelMesh, hybrid: bool) -> DeviceMesh:
    return mesh["dp_replicate", "dp_shard"] if hybrid else mesh["dp_shard_cp" if mesh.layout.cp > 1 else "dp_shard"]


def apply_data_parallel(model: nn.Module, mesh: ParallelMesh, how: Wrapping, cast: Optional[torch.dtype], *,
                        auto_wrap_min_params: int, reshard_after_forward: Union[bool, int] = True,
                        cross_group: Optional[CrossGroupSettings] = None, hybrid: bool = False,
                        offload: Optional[HostOffload] = None, whole_steps_only: bool = False,
                        autocast: Optional[Callable[[], ContextManager]] = None,
                        binding: Optional[OptimizerBinding] = None, before_shard: Optional[Callable[[nn.Module], None]] = None,
                        ddp_options: Optional[Mapping[str, Any]] = None,
                        separately: Sequence[tuple[nn.Module, DeviceMesh]] = ()) -> Strategy:
    """Wrap `model` over the data-parallel axes of `mesh` as `how` says (config/decisions.py).

    `cast`: the dtype FSDP2's policy computes in (None: as stored). `reshard_after_forward=False`
    keeps gathered parameters until the end of backward, as ZeRO-2 does (a pipeline schedule that
    splits backward needs them); an int n (ZeRO++ hpZ) keeps them sharded over n ranks, the secondary
    groups of `mesh["hpz"]`, so that backward gathers them there. `cross_group`: MiCS's reduction run
    here (its dtype and overlap), `hybrid`: FSDP2's own over both dp axes instead; `offload`: optimizer
    states in host memory; `whole_steps_only`: the optimizer needs every gradient before it steps any
    (a deferred cross-group reduction then lands all of them first); `autocast`, `binding`: the strategy's
    (forward's precision context, how optimizers bind where ZeRO-1 chose it). Sharding calls `before_shard` on
    every unit (blocks of at least `auto_wrap_min_params` parameters where the model names none), then
    the root, right before sharding it (delayed initialisation materialises them there). `ddp_options` go to
    torch's DistributedDataParallel where `how` is DDP (SMP's DistributedModel arguments: bucket_cap_mb, ...).
    `separately`: submodules sharded first, each over its own mesh (expert shares over the ranks holding copies of
    them); the units and the root then leave their parameters to them.
    """
    options = {"autocast": autocast, "binding": binding}
    if how is Wrapping.SHARDED:
        return _shard(model, mesh, cast, auto_wrap_min_params, reshard_after_forward, cross_group, hybrid, offload,
                      whole_steps_only, before_shard or (lambda unit: None), options, separately)
    if how is Wrapping.REPLICATE:
        replicated = replicate(model, mesh=mesh["rdp"], mp_policy=precision.sharded_policy(cast, root=True))
        return Replicated(replicated, model, **options)
    if how is Wrapping.DDP:
        return Replicated(DistributedDataParallel(model, device_mesh=mesh["rdp"], **(ddp_options or {})), model,
                          **options)
    return Replicated(model, model, **options)  # one replica, or ZeRO-1's replicas whose optimizer reduces gradients


def _shard(model: nn.Module, mesh: ParallelMesh, cast: Optional[torch.dtype], auto_wrap_min_params: int,
           reshard_after_forward: Union[bool, int], cross_group: Optional[CrossGroupSettings], hybrid: bool,
           offload: Optional[HostOffload], whole_steps_only: bool, prepare: Callable[[nn.Module], None],
           options: dict[str, Any], separately: Sequence[tuple[nn.Module, DeviceMesh]]) -> Strategy:
    dp_mesh = _dp_mesh(mesh, hybrid)
    policy = sharded_offload_policy(offload)
    for part, own_mesh in separately:
        fully_shard(part, mesh=own_mesh, reshard_after_forward=bool(reshard_after_forward),
                    mp_policy=precision.sharded_policy(cast, root=False), offload_policy=policy)
    units = sharding_units(model, auto_wrap_min_params)
    secondary = not isinstance(reshard_after_forward, bool)
    with reshard_after_forward_over(mesh["hpz"]) if secondary else contextlib.nullcontext():
        for unit in units:
            prepare(unit)
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=precision.sharded_policy(cast, root=False), offload_policy=policy)
        prepare(model)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=precision.sharded_policy(cast, root=True), offload_policy=policy)
    if cross_group is None:
        return Sharded(model, None, hybrid, **options)  # fully_shard turned `model` into an FSDPModule in place
    *blocks, root = unit_parameters([*units, model])  # as FSDP2 took them; backward ends with the root
    reduction = CrossGroupReduction([*reversed(blocks), root], mesh["dp_replicate"].get_group(),
                                    _LINK_DTYPES[cross_group.dtype],
                                    [*reversed(units), model] if cross_group.deferred else None)
    if cross_group.deferred:
        options = {**options, "binding": bind_step_as_shards_land(reduction, whole_steps_only)}
    return Sharded(model, reduction, hybrid, **options)
