"""Rank helpers with SMP's names.

As in SMP, `dp` counts every rank that holds a different batch slice — the
replicas, the ZeRO partition and the tensor-parallel ranks — and `rdp`
("reduced" data parallel) leaves tensor parallelism out.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .state import current


def _coord(axis: str) -> int:
    rt = current(f"shardwise.{axis}_rank()")
    return rt.layout.coords(rt.rank)[axis]


def rank() -> int:
    return current("shardwise.rank()").rank


def local_rank() -> int:
    return current("shardwise.local_rank()").local_rank


def size() -> int:
    return current("shardwise.size()").layout.world_size


def local_size() -> int:
    return current("shardwise.local_size()").cluster.devices_per_node


def tp_rank() -> int:
    return _coord("tp")


def tp_size() -> int:
    return current("shardwise.tp_size()").layout.tp


def pp_rank() -> int:
    return _coord("pp")


def pp_size() -> int:
    return current("shardwise.pp_size()").layout.pp


def rdp_rank() -> int:
    rt = current("shardwise.rdp_rank()")
    c = rt.layout.coords(rt.rank)
    return c["dp_replicate"] * rt.layout.dp_shard + c["dp_shard"]


def rdp_size() -> int:
    return current("shardwise.rdp_size()").layout.dp


def dp_rank() -> int:
    return rdp_rank() * tp_size() + tp_rank()


def dp_size() -> int:
    return rdp_size() * tp_size()


def _group(name: str) -> ProcessGroup:
    return current(f"shardwise.get_{name}_process_group()").mesh[name].get_group()


def get_world_process_group() -> ProcessGroup:
    current("shardwise.get_world_process_group()")
    return dist.group.WORLD


def get_dp_process_group() -> ProcessGroup:
    return _group("dp")


def get_rdp_process_group() -> ProcessGroup:
    return _group("rdp")


def get_tp_process_group() -> ProcessGroup:
    return _group("tp")


def get_pp_process_group() -> ProcessGroup:
    return _group("pp")
