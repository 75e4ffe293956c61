"""The named mesh every technique receives: the 4-D (pp, dp_replicate, dp_shard, tp) mesh plus
its two flattened data-parallel views, `rdp` (replicas × partition) and `dp` (rdp × tp, as SMP counts it)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..topology import AXES, Layout


class ParallelMesh:
    def __init__(self, device: torch.device, layout: Layout):
        self.layout = layout
        self.world = init_device_mesh(device.type, layout.shape, mesh_dim_names=AXES)
        self._flat = {
            "rdp": self.world["dp_replicate", "dp_shard"]._flatten("rdp"),
            "dp": self.world["dp_replicate", "dp_shard", "tp"]._flatten("dp"),
        }

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """A sub-mesh by axis name(s), e.g. mesh["tp"], mesh["dp_replicate", "dp_shard"], mesh["rdp"]."""
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
    from torch.distributed.tensor import _redistribute, debug

    debug._clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
