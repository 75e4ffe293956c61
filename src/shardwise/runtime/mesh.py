"""The named mesh every technique receives: the 4-D (pp, dp_replicate, dp_shard, tp) mesh plus
its two flattened data-parallel views, `rdp` (replicas × partition) and `dp` (rdp × tp, as SMP counts it),
and under ZeRO++ hpZ `hpz`: each sharding group cut into secondary groups of neighbouring ranks.

Global ranks sit on the mesh as the layout places them (SMP's placement_strategy),
so every group the mesh makes holds the ranks `Layout.groups` names."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..topology import AXES, Layout
from ..torch_internals import clear_dtensor_caches, flatten_mesh, unflatten_mesh


class ParallelMesh:
    def __init__(self, device: torch.device, layout: Layout, secondary: int = 0):
        """`secondary`: ZeRO++ hpZ's group size (config/decisions.py's `secondary_partition`), 0 for none."""
        self.layout, self.secondary = layout, secondary
        # The rank map is bookkeeping, on the CPU whatever the default device (as init_device_mesh keeps it).
        ranks = torch.tensor(layout.mesh_ranks(), dtype=torch.int, device="cpu")
        self.world = DeviceMesh(device.type, ranks, mesh_dim_names=AXES)
        self._flat = {
            "rdp": flatten_mesh(self.world["dp_replicate", "dp_shard"], "rdp"),
            "dp": flatten_mesh(self.world["dp_replicate", "dp_shard", "tp"], "dp"),
        }
        if secondary:
            # (hpz_replicate, hpz): every rank makes every secondary group here, once, in the same order
            split = unflatten_mesh(self.world, "dp_shard", (layout.dp_shard // secondary, secondary),
                                   ("hpz_replicate", "hpz"))
            self._flat["hpz"] = split["hpz_replicate", "hpz"]

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """A sub-mesh by axis name(s), e.g. mesh["tp"], mesh["dp_replicate", "dp_shard"], mesh["rdp"]; mesh["hpz"]
        is 2-D, (hpz_replicate, hpz), the secondary groups of this rank's sharding group (only under hpZ)."""
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
