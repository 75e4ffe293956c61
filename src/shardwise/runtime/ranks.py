"""Where this process sits in the world, with SMP's names: ranks, sizes and groups.

As in SMP, `dp` counts every rank that holds a different batch slice — the
replicas, the ZeRO partition and the tensor-parallel ranks — `rdp` ("reduced"
data parallel) leaves tensor parallelism out, and `mp` (model parallel) is the
pipeline × tensor-parallel ranks that together hold one replica of the model.

A rank "within its group" is its index among the group's global ranks in
ascending order, as SMP's groups (and MPI's and torch's) number them, so
`allgather` over a group returns the objects in that group's rank order.
Everything follows the layout's placement of ranks; the process groups are
the mesh's, the model-parallel one aside (see `get_mp_process_group`).
"""

from __future__ import annotations

from itertools import product
from math import prod
from weakref import WeakKeyDictionary

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..topology import AXES
from .hang_report import group_timeout
from ..parallel.mesh import ParallelMesh
from .state import Runtime, current

# The layout axes each of SMP's groups spans.
GROUP_AXES = {
    "world": AXES,
    "mp": ("pp", "tp"),
    "dp": ("dp_replicate", "dp_shard", "tp"),
    "rdp": ("dp_replicate", "dp_shard"),
    "tp": ("tp",),
    "pp": ("pp",),
}

# The model-parallel groups made on first use, by mesh, so they die with the runtime that made them.
_made_mp_groups: WeakKeyDictionary[ParallelMesh, ProcessGroup] = WeakKeyDictionary()


def _members(runtime: Runtime, name: str) -> list[int]:
    axes = GROUP_AXES[name]
    here = runtime.layout.coords(runtime.rank)
    return sorted(runtime.layout.rank_of({**here, **dict(zip(axes, index))})
                  for index in product(*(range(getattr(runtime.layout, axis)) for axis in axes)))


def members(name: str, what: str = "this call") -> list[int]:
    """The global ranks of this process's group `name` ("world", "mp", "dp", "rdp", "tp" or "pp"), ascending."""
    return _members(current(what), name)


def group_rank(name: str, what: str = "this call") -> int:
    """This process's rank within its group `name`."""
    runtime = current(what)
    return _members(runtime, name).index(runtime.rank)


def group_size(name: str, what: str = "this call") -> int:
    layout = current(what).layout
    return prod(getattr(layout, axis) for axis in GROUP_AXES[name])


def process_group(name: str, what: str = "this call") -> ProcessGroup:
    """The torch.distributed group of this process's group `name`."""
    runtime = current(what)
    if name == "world":
        return dist.group.WORLD
    if name == "mp":
        return _mp_process_group(runtime)
    return runtime.mesh[name].get_group()


def _mp_process_group(runtime: Runtime) -> ProcessGroup:
    """The mesh has no model-parallel axis: pp × tp is one of its groups when one of the two (or the data
    parallelism) is 1, and is made on first use otherwise."""
    size = group_size("mp")
    for name in ("tp", "pp", "world"):  # each lies inside or around mp: equal sizes mean equal ranks
        if group_size(name) == size:
            return process_group(name)
    if runtime.mesh not in _made_mp_groups:
        # Only this group's members synchronise, so one model-parallel group can act while the others do not.
        _made_mp_groups[runtime.mesh] = dist.new_group(_members(runtime, "mp"), use_local_synchronization=True,
                                                       group_desc="mp", timeout=group_timeout())
    return _made_mp_groups[runtime.mesh]


def rank() -> int:
    """The global rank of this process."""
    return current("shardwise.rank()").rank


def size() -> int:
    """The number of processes."""
    return current("shardwise.size()").layout.world_size


def local_rank() -> int:
    """The rank among the processes on this node."""
    return current("shardwise.local_rank()").local_rank


def local_size() -> int:
    """The number of processes on this node."""
    return current("shardwise.local_size()").cluster.devices_per_node


def tp_rank() -> int:
    return group_rank("tp", "shardwise.tp_rank()")


def tp_size() -> int:
    return group_size("tp", "shardwise.tp_size()")


def pp_rank() -> int:
    return group_rank("pp", "shardwise.pp_rank()")


def pp_size() -> int:
    return group_size("pp", "shardwise.pp_size()")


def rdp_rank() -> int:
    return group_rank("rdp", "shardwise.rdp_rank()")


def rdp_size() -> int:
    return group_size("rdp", "shardwise.rdp_size()")


def dp_rank() -> int:
    return group_rank("dp", "shardwise.dp_rank()")


def dp_size() -> int:
    return group_size("dp", "shardwise.dp_size()")


def mp_rank() -> int:
    return group_rank("mp", "shardwise.mp_rank()")


def mp_size() -> int:
    return group_size("mp", "shardwise.mp_size()")


def get_mp_group() -> list[int]:
    """The global ranks over which this process's model replica is partitioned."""
    return members("mp", "shardwise.get_mp_group()")


def get_dp_group() -> list[int]:
    """The global ranks that hold other replicas of this process's model partition."""
    return members("dp", "shardwise.get_dp_group()")


def get_rdp_group() -> list[int]:
    return members("rdp", "shardwise.get_rdp_group()")


def get_tp_group() -> list[int]:
    return members("tp", "shardwise.get_tp_group()")


def get_pp_group() -> list[int]:
    return members("pp", "shardwise.get_pp_group()")


def get_world_process_group() -> ProcessGroup:
    return process_group("world", "shardwise.get_world_process_group()")


def get_mp_process_group() -> ProcessGroup:
    """Made on first use when pp, tp and the data parallelism all exceed 1: then every rank of this model-parallel
    group must make its first model-parallel call (this, `allgather`, `barrier`) together, as with any collective."""
    return process_group("mp", "shardwise.get_mp_process_group()")


def get_dp_process_group() -> ProcessGroup:
    return process_group("dp", "shardwise.get_dp_process_group()")


def get_rdp_process_group() -> ProcessGroup:
    return process_group("rdp", "shardwise.get_rdp_process_group()")


def get_tp_process_group() -> ProcessGroup:
    return process_group("tp", "shardwise.get_tp_process_group()")


def get_pp_process_group() -> ProcessGroup:
    return process_group("pp", "shardwise.get_pp_process_group()")


def is_tracing() -> bool:
    """Always False: SMP ran a tracing step to partition the model; shardwise cuts it along its list of
    repeated blocks without running it."""
    return False
