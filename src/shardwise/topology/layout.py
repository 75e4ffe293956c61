"""The named layout pp × dp_replicate × dp_shard × cp × tp, and the order global ranks walk it in.

The order is SMP's `placement_strategy`: three letters, outermost first, D for
the data-parallel ranks (replicas, then ZeRO partition groups inside them), P
for pipeline stages and T for tensor parallelism, with context parallelism's cp just outside tp. The default "DPT" (SMP's
`cluster`) makes tensor-parallel groups consecutive ranks (inside a node), a
model replica's pipeline stages their neighbours, and only the data-parallel
traffic spans the ranks farthest apart, as SMP numbers them. Pure: no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import product
from typing import Any

from .cluster import Cluster

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The axes each placement letter stands for, outermost first. cp (context parallelism) sits next to tp: after
# tensor parallelism its ring or all-to-all is the heaviest traffic, kept inside a node where it fits.
PLACEMENT_AXES = {"D": ("dp_replicate", "dp_shard"), "P": ("pp",), "T": ("cp", "tp")}


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    placement: str = "DPT"  # the letters D, P, T, outermost first
    cp: int = 1  # context parallelism: ranks each sequence is split over

    def __post_init__(self) -> None:
        if sorted(self.placement) != sorted(PLACEMENT_AXES):
            raise ValueError(f"placement {self.placement!r} is not an order of the letters D, P and T")

    @property
    def rank_axes(self) -> tuple[str, ...]:
        """The axes from the one global ranks step through slowest to the one they step through fastest."""
        return tuple(axis for letter in self.placement for axis in PLACEMENT_AXES[letter])

    def strides(self) -> dict[str, int]:
        """How far apart two ranks are whose index along an axis differs by one."""
        strides, stride = {}, 1
        for axis in reversed(self.rank_axes):
            strides[axis] = stride
            stride *= getattr(self, axis)
        return {axis: strides[axis] for axis in AXES}

    @property
    def shape(self) -> tuple[int, ...]:
        """The degrees of `degrees()`, in order."""
        return tuple(self.degrees().values())

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def degrees(self) -> dict[str, int]:
        """Every axis's degree; cp only where context parallelism is on, so layouts without it read as before."""
        return {axis: getattr(self, axis) for axis in AXES if axis != "cp" or self.cp > 1}

    def coords(self, rank: int) -> dict[str, int]:
        """Index of `rank` along every axis."""
        return {axis: rank // stride % getattr(self, axis) for axis, stride in self.strides().items()}

    def rank_of(self, coords: dict[str, int]) -> int:
        return sum(coords[axis] * stride for axis, stride in self.strides().items())

    def mesh_ranks(self) -> list:
        """The global ranks as nested lists indexed [pp][dp_replicate][dp_shard][cp][tp]: a DeviceMesh's layout."""
        def nest(axes: tuple[str, ...], base: int) -> Any:
            if not axes:
                return base
            stride = self.strides()[axes[0]]
            return [nest(axes[1:], base + i * stride) for i in range(getattr(self, axes[0]))]

        return nest(AXES, 0)

    def groups(self, *axes: str) -> list[list[int]]:
        """The rank groups that vary along `axes` (together) with the other axes fixed."""
        return [list(g) for g in _groups(self, _known(axes))]

    def crosses_nodes(self, cluster: Cluster, *axes: str) -> bool:
        return bool(self.spanning_group(cluster, *axes))

    def spanning_group(self, cluster: Cluster, *axes: str) -> list[int]:
        """The first group along `axes` whose ranks sit on more than one node of `cluster`, [] when none does."""
        return list(_spanning(self, cluster.devices_per_node, _known(axes)))


def _known(axes: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"unknown axis {unknown[0]!r}; axes are {', '.join(AXES)}")
    return axes


# Cached: the planner validates thousands of candidate layouts of thousands of ranks, each asking the same groups.
@lru_cache(maxsize=1024)
def _groups(layout: Layout, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    strides = layout.strides()
    fixed = [a for a in AXES if a not in axes]
    offsets = [sum(i * strides[a] for a, i in zip(axes, idx))
               for idx in product(*(range(getattr(layout, a)) for a in axes))]
    result = []
    for fixed_idx in product(*(range(getattr(layout, a)) for a in fixed)):
        base = sum(i * strides[a] for a, i in zip(fixed, fixed_idx))
        result.append(tuple(sorted(base + offset for offset in offsets)))
    return tuple(sorted(result))


@lru_cache(maxsize=1024)
def _spanning(layout: Layout, devices_per_node: int, axes: tuple[str, ...]) -> tuple[int, ...]:
    return next((g for g in _groups(layout, axes) if g[0] // devices_per_node != g[-1] // devices_per_node), ())
