"""The named mesh every technique receives: the 4-D (pp, dp_replicate, dp_shard, tp) mesh plus
its two flattened data-parallel views, `rdp` (replicas × partition) and `dp` (rdp × tp, as SMP counts it),
under ZeRO++ hpZ `hpz`: each sharding group cut into secondary groups of neighbouring ranks, and under expert
parallelism `ep`, `expert_shard` and `expert_dp`: each sharding group (its cp ranks included) cut into the ranks
that split the experts and those that shard one share, and the copies of a share over the replicas too.

Global ranks sit on the mesh as the layout places them (SMP's placement_strategy),
so every group the mesh makes holds the ranks `Layout.groups` names."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..topology import AXES, Layout
from ..torch_internals import clear_dtensor_caches, flatten_mesh, unflatten_mesh


class ParallelMesh:
    def __init__(self, device: torch.device, layout: Layout, secondary: int = 0, experts: int = 1):
        """`secondary`: ZeRO++ hpZ's group size (config/decisions.py's `secondary_partition`), 0 for none;
        `experts`: the expert-parallel degree (`expert_parallel_degree`), 1 for none."""
        self.layout, self.secondary, self.experts = layout, secondary, experts
        # The rank map is bookkeeping, on the CPU whatever the default device (as init_device_mesh keeps it).
        ranks = torch.tensor(layout.mesh_ranks(), dtype=torch.int, device="cpu")
        self.world = DeviceMesh(device.type, ranks, mesh_dim_names=AXES)
        self._flat = {
            # Context parallelism: each cp rank holds part of its replica's sequences, so gradients are reduced
            # over the cp ranks as over the replicas, and ZeRO shards over them too (torchtitan's dp_shard_cp)
            "rdp": flatten_mesh(self.world[("dp_replicate", "dp_shard") + (("cp",) if layout.cp > 1 else ())], "rdp"),
            "dp": flatten_mesh(self.world["dp_replicate", "dp_shard", "tp"], "dp"),
        }
        if layout.cp > 1:
            self._flat["dp_shard_cp"] = flatten_mesh(self.world["dp_shard", "cp"], "dp_shard_cp")
        if secondary:
            # (hpz_replicate, hpz): every rank makes every secondary group here, once, in the same order; they cut
            # the sharding group, which spans the cp ranks under context parallelism
            sharding = "dp_shard_cp" if layout.cp > 1 else "dp_shard"
            split = unflatten_mesh(self._flat.get(sharding, self.world), sharding,
                                   (layout.dp_shard * layout.cp // secondary, secondary), ("hpz_replicate", "hpz"))
            self._flat["hpz"] = split["hpz_replicate", "hpz"]
        if experts > 1:
            # The sharding group (dp_shard, × cp under context parallelism) = expert_shard × ep, ep fastest
            # (neighbouring ranks, as torchtitan splits dp_shard_cp): `ep` splits the experts, `expert_shard` shards
            # one share, (dp_replicate, expert_shard) holds its copies. Cut from `rdp`, which spans cp when it is on.
            shard = layout.dp_shard * layout.cp
            split = unflatten_mesh(self._flat["rdp"], "rdp", (layout.dp_replicate, shard // experts, experts),
                                   ("dp_replicate", "expert_shard", "ep"))
            self._flat.update(ep=split["ep"], expert_shard=split["expert_shard"],
                              expert_dp=split["dp_replicate", "expert_shard"])

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """A sub-mesh by axis name(s), e.g. mesh["tp"], mesh["dp_replicate", "dp_shard"], mesh["rdp"]; mesh["hpz"]
        is 2-D, (hpz_replicate, hpz), the secondary groups of this rank's sharding group (only under hpZ); with
        expert parallelism mesh["ep"] splits the experts, mesh["expert_shard"] shards each share and the 2-D
        mesh["expert_dp"], (dp_replicate, expert_shard), holds all its copies."""
        if isinstance(names, str) and names in self._flat:
            return self._flat[names]
        return self.world[names]


def forget_cached_meshes() -> None:
    """Drop DTensor's sharding and redistribution caches, which hold DeviceMeshes.

    A DeviceMesh compares equal to any other of the same shape and ranks, so once
    the process group is destroyed and a new one made in the same process (a
    second `init`, a pooled test worker), a cache hit would hand back a mesh whose
    process groups no longer exist.
    """
    clear_dtensor_caches()
