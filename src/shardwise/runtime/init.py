"""`init` and `shutdown`: config → process group → layout → named DeviceMesh."""

from __future__ import annotations

import os
from typing import Any, Mapping, Union

import torch
import torch.distributed as dist

from ..config import ShardwiseConfig, load_config, refuse_unavailable
from ..topology import Cluster, layout_for
from . import state
from .agreement import check_same_config
from .devices import backend_for, local_device
from .mesh import ParallelMesh, forget_cached_meshes

# Set by `shardwise run` for every rank: the path of the validated config it was given.
CONFIG_ENV = "SHARDWISE_CONFIG"

ConfigLike = Union[None, str, os.PathLike, Mapping[str, Any], ShardwiseConfig]


def _resolve_config(config: ConfigLike) -> ShardwiseConfig:
    if isinstance(config, ShardwiseConfig):
        return config
    if config is None:
        config = os.environ.get(CONFIG_ENV)
    return load_config(config)


def _start_process_group(device: torch.device) -> bool:
    """Join torchrun's world, or make a one-process world; False when the caller already made one."""
    if dist.is_initialized():
        return False
    backend = backend_for(device)
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type != "cpu" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def init(config: ConfigLike = None) -> ShardwiseConfig:
    """Validate the config, join the process group and build the named mesh.

    With no argument, takes the config `shardwise run --config` was given, else the
    defaults (pure data parallelism). Works in one process with no launcher.
    """
    if state.is_initialized():
        raise RuntimeError("shardwise.init() was already called in this process; call shardwise.shutdown() first")
    resolved = _resolve_config(config)
    refuse_unavailable(resolved)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = local_device(local_rank)
    owns = _start_process_group(device)
    check_same_config(resolved, device)
    world = dist.get_world_size()
    cluster = Cluster.from_env() if "WORLD_SIZE" in os.environ else Cluster(1, world)
    if cluster.world_size != world:
        cluster = Cluster(1, world)
    layout = layout_for(resolved, cluster)
    mesh = ParallelMesh(device, layout)
    state.set_current(state.Runtime(config=resolved, cluster=cluster, layout=layout, mesh=mesh, device=device,
                                    rank=dist.get_rank(), local_rank=local_rank, owns_process_group=owns))
    return resolved


def shutdown(wait: bool = True) -> None:
    """Forget the runtime and destroy the process group (also one a test harness made).

    With `wait`, parameter updates still in flight (ZeRO-1 overlaps them with the
    next forward) finish first: a process group must not be destroyed under pending
    collectives. A rank leaving after an error passes False, so that it never waits
    for peers that may not send.
    """
    if wait and state.is_initialized() and state.current().model is not None:
        state.current().model.wait_for_parameters()
    state.set_current(None)
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_cached_meshes()
