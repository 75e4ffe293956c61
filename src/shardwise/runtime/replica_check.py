"""The replica check: every copy of a replicated parameter must be bit-identical on the ranks that hold one.

Data parallelism keeps one replica per rank and trusts every rank to apply the
same update; when some combination of features breaks that (a gradient summed
on some ranks only, a norm counted twice), replicas drift apart and training
goes on, silently wrong. This check turns that into an error: each rank takes an
exact integer fingerprint of each parameter's local tensor and compares it with
the ranks that should hold the same tensor:

- a plain tensor with the ranks along each axis of its pipeline stage
  (replicas, partition group, tensor-parallel peers);
- a DTensor with the ranks along each mesh axis it is `Replicate` on (MiCS's
  replicas of a shard) and along each axis of the stage its mesh leaves out.

One all-gather of a vector of fingerprints per axis, then one world all-reduce,
so every rank stops together and names the same parameter.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..parallel.local import local_tensor
from ..parallel.mesh import ParallelMesh

_AS_INTEGER = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MODULUS = 65521  # position weights cycle through 1..65521, so a permutation of values changes the fingerprint


class ReplicaMismatchError(RuntimeError):
    """Ranks that should hold equal copies of a parameter hold different ones."""


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 of every bit of `tensor`'s local values, weighted by position (wrapping sums are exact)."""
    flat = local_tensor(tensor).detach().contiguous().view(-1)
    bits = flat.view(_AS_INTEGER[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % _MODULUS + 1
    return (bits * weights).sum()


# Axes inside a pipeline stage, and the flattened axes of ParallelMesh that span several of them.
_STAGE_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
_SPANS = {"rdp": ("dp_replicate", "dp_shard"), "dp": _STAGE_AXES,
          "ep": ("dp_shard", "cp"), "expert_shard": ("dp_shard", "cp")}  # EP cuts the sharding group in two

# ZeRO under context parallelism shards over the data-parallel and the cp ranks together (torchtitan's dp_shard_cp)
_SPANS.update(dp_shard_cp=("dp_shard", "cp"))


def _replica_groups(param: torch.Tensor, mesh: ParallelMesh) -> Iterator[tuple[str, dist.ProcessGroup]]:
    """(axis name, process group) of every line of ranks that must hold this rank's copy of `param`: the axes
    a DTensor is `Replicate` on, and every axis of the stage its mesh does not span (a norm FSDP2 replicates
    over the replicas is whole on each tensor-parallel rank too). Equal along each line is equal across all."""
    spanned: set[str] = set()
    if isinstance(param, DTensor):
        dmesh = param.device_mesh
        for axis, (name, placement) in enumerate(zip(dmesh.mesh_dim_names, param.placements)):
            spanned.update(_SPANS.get(name, (name,)))
            if placement.is_replicate() and dmesh.size(axis) > 1:
                yield name, dmesh.get_group(axis)
    for name in _STAGE_AXES:
        if name not in spanned and mesh[name].size() > 1:
            yield name, mesh[name].get_group()


def _first_difference(axis: str, group: dist.ProcessGroup, names: list[str],
                      prints: torch.Tensor) -> Optional[str]:
    """All-gather the group's fingerprints; describe the first parameter whose copies differ."""
    size = dist.get_world_size(group)
    counts = [torch.zeros(1, dtype=torch.int64, device=prints.device) for _ in range(size)]
    dist.all_gather(counts, torch.tensor([len(names)], dtype=torch.int64, device=prints.device), group=group)
    ranks = dist.get_process_group_ranks(group)
    if len({int(c) for c in counts}) > 1:
        return (f"ranks {ranks} should hold the same parameters over {axis} but hold "
                f"{[int(c) for c in counts]} of them")
    gathered = [torch.empty_like(prints) for _ in range(size)]
    dist.all_gather(gathered, prints, group=group)
    table = torch.stack(gathered)  # [ranks, parameters]
    for index in torch.nonzero((table != table[0]).any(0)).flatten().tolist():
        other = next(r for r, row in zip(ranks, table) if row[index] != table[0, index])
        return f"parameter '{names[index]}' differs between ranks {ranks[0]} and {other}, which hold copies over {axis}"
    return None


def check_replicas(named_parameters: Iterable[tuple[str, torch.Tensor]], mesh: ParallelMesh, device: torch.device,
                   step: int) -> None:
    """Raise `ReplicaMismatchError` on every rank if any replicated parameter differs between its holders."""
    by_axis: dict[str, tuple[dist.ProcessGroup, list[str], list[torch.Tensor]]] = {}
    for name, param in named_parameters:
        for axis, group in _replica_groups(param, mesh):
            entry = by_axis.setdefault(axis, (group, [], []))
            entry[1].append(name)
            entry[2].append(fingerprint(param).to(device))
    found = []
    for axis in sorted(by_axis):  # the same order on every rank
        group, names, prints = by_axis[axis]
        found.append(_first_difference(axis, group, names, torch.stack(prints)))
    problem = next((f for f in found if f is not None), None)
    flag = torch.tensor([problem is not None], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    reports: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, problem)
    first = next(r for r in reports if r is not None)
    raise ReplicaMismatchError(
        f"replica check after step {step}: {first}; the ranks no longer train the same model (fix: report it with "
        "the config, or look for code that changes parameters on some ranks only)")
