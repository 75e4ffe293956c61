"""The named layout pp × dp_replicate × dp_shard × tp, and the order global ranks walk it in.

The order is SMP's `placement_strategy`: three letters, outermost first, D for
the data-parallel ranks (replicas, then ZeRO partition groups inside them), P
for pipeline stages and T for tensor parallelism. The default "DPT" (SMP's
`cluster`) makes tensor-parallel groups consecutive ranks (inside a node), a
model replica's pipeline stages their neighbours, and only the data-parallel
traffic spans the ranks farthest apart, as SMP numbers them. Pure: no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any, Iterable, Mapping, Optional

from ..config.errors import ConfigError, Problem
from ..config.hpz import KEY as HPZ
from ..config.packages import package_problems
from ..config.schema import ShardwiseConfig
from ..config.validate import batch_triple, config_problems, unavailable_problems
from .cluster import Cluster

AXES = ("pp", "dp_replicate", "dp_shard", "tp")
# The axes each placement letter stands for, outermost first.
PLACEMENT_AXES = {"D": ("dp_replicate", "dp_shard"), "P": ("pp",), "T": ("tp",)}


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    placement: str = "DPT"  # the letters D, P, T, outermost first

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
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def degrees(self) -> dict[str, int]:
        return dict(zip(AXES, self.shape))

    def coords(self, rank: int) -> dict[str, int]:
        """Index of `rank` along every axis."""
        return {axis: rank // stride % getattr(self, axis) for axis, stride in self.strides().items()}

    def rank_of(self, coords: dict[str, int]) -> int:
        return sum(coords[axis] * stride for axis, stride in self.strides().items())

    def mesh_ranks(self) -> list:
        """The global ranks as nested lists indexed [pp][dp_replicate][dp_shard][tp]: a DeviceMesh's layout."""
        def nest(axes: tuple[str, ...], base: int) -> Any:
            if not axes:
                return base
            stride = self.strides()[axes[0]]
            return [nest(axes[1:], base + i * stride) for i in range(getattr(self, axes[0]))]

        return nest(AXES, 0)

    def groups(self, *axes: str) -> list[list[int]]:
        """The rank groups that vary along `axes` (together) with the other axes fixed."""
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise ValueError(f"unknown axis {unknown[0]!r}; axes are {', '.join(AXES)}")
        fixed = [a for a in AXES if a not in axes]
        result = []
        for fixed_idx in product(*(range(getattr(self, a)) for a in fixed)):
            base = dict(zip(fixed, fixed_idx))
            ranks = [self.rank_of({**base, **dict(zip(axes, idx))})
                     for idx in product(*(range(getattr(self, a)) for a in axes))]
            result.append(sorted(ranks))
        return sorted(result)

    def crosses_nodes(self, cluster: Cluster, *axes: str) -> bool:
        return any(len({cluster.node_of(r) for r in g}) > 1 for g in self.groups(*axes))


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def layout_problems(config: ShardwiseConfig, cluster: Cluster) -> tuple[Optional[Layout], list[Problem]]:
    """The layout `config` gives on `cluster` (None when the degrees do not divide the world), and every
    rule it breaks there."""
    problems: list[Problem] = []
    tp, pp, world = config.tensor_parallel_degree, config.pipeline_parallel_degree, cluster.world_size
    if tp > cluster.devices_per_node:
        problems.append(Problem("tensor_parallel_degree", tp,
                                f"must not exceed the {cluster.devices_per_node} devices per node (TP stays inside a node)",
                                f"use a power of two ≤ {cluster.devices_per_node}"))
    elif _power_of_two(tp) and cluster.devices_per_node % tp:
        problems.append(Problem("tensor_parallel_degree", tp,
                                f"must divide the {cluster.devices_per_node} devices per node, or TP groups span nodes",
                                "use a power of two that divides the devices per node"))
    if world % (tp * pp):
        problems.append(Problem("pipeline_parallel_degree × tensor_parallel_degree", tp * pp,
                                f"must divide the world size {world}",
                                "choose degrees whose product divides the number of processes"))
        return None, problems
    dp = world // (tp * pp)
    group = config.sharded_data_parallel_degree
    if group > 1 and dp % group:
        problems.append(Problem("sharded_data_parallel_degree", group,
                                f"must divide the data-parallel degree {dp} (= world {world} / (tp {tp} × pp {pp}))",
                                f"use a divisor of {dp}: {_divisors(dp)}"))
    if not config.ddp and dp > 1:
        problems.append(Problem("ddp", False, f"gradients must be synchronised across the {dp} data-parallel ranks",
                                "set ddp to true, or make tp × pp equal the world size"))
    shard = 1 if config.effective_zero_stage < 2 else group if group > 1 else dp
    layout = Layout(pp=pp, dp_replicate=dp // shard, dp_shard=shard, tp=tp, placement=config.placement)
    problems += _hpz_problems(config, layout, cluster)
    spanning = [g for g in layout.groups("tp") if len({cluster.node_of(r) for r in g}) > 1]
    if spanning and not any(p.path == "tensor_parallel_degree" for p in problems):
        problems.append(Problem("placement_strategy", config.placement_strategy,
                                f"puts tensor-parallel group {spanning[0]} on different nodes of "
                                f"{cluster.devices_per_node} devices, and TP stays inside a node",
                                "use a placement with T last, such as 'cluster' (DPT)"))
    return layout, problems


def _hpz_problems(config: ShardwiseConfig, layout: Layout, cluster: Cluster) -> list[Problem]:
    """ZeRO++ hpZ's secondary groups split each sharding group into groups of `zero_hpz_partition_size`
    neighbouring ranks. Without tensor or pipeline parallelism (config/hpz.py refuses both) a sharding group's
    ranks are consecutive, so a size that divides the ranks per node keeps every secondary group on one node. A
    size of the whole sharding group or more is plain ZeRO-3, as DeepSpeed clamps it to the world: a DeepSpeed
    config made for large nodes still runs on a small machine or in one process."""
    size, shard = config.zero_hpz_partition_size, layout.dp_shard
    if size == 1 or config.effective_zero_stage != 3 or size >= shard:
        return []  # off, refused without ZeRO-3 already, or plain ZeRO-3
    problems = []
    if shard % size:
        problems.append(Problem(HPZ, size, f"must divide the sharding group's {shard} ranks "
                                "(sharded_data_parallel_degree, or the whole data-parallel group without it): "
                                "each secondary group is part of one sharding group",
                                f"use a divisor of {shard}: {_divisors(shard)}"))
    if cluster.devices_per_node % size:
        per_node = cluster.devices_per_node
        problems.append(Problem(HPZ, size, f"must divide the {per_node} ranks per node: backward's all-gathers "
                                "run inside a secondary group, which stays inside a node",
                                f"use a divisor of {per_node}: {_divisors(per_node)}"))
    return problems


def layout_for(config: ShardwiseConfig, cluster: Cluster) -> Layout:
    """The layout `config` gives on `cluster`, or a ConfigError listing every rule it breaks."""
    layout, problems = layout_problems(config, cluster)
    if problems:
        raise ConfigError(problems)
    return layout


def validate(data: Mapping[str, Any], cluster: Cluster, found: Iterable[Problem] = ()) -> tuple[ShardwiseConfig, Layout]:
    """The one validation `init`, `check-config` and `run` share: unknown keys, field types, rules, features this
    release lacks, the packages the metrics sinks need and the layout on `cluster`, raised as one ConfigError
    together with the problems the caller `found` in the sources. The layout is computed from the well-typed keys."""
    config, problems = config_problems(data)
    problems = [*found, *problems, *unavailable_problems(config), *package_problems(config)]
    layout, more = layout_problems(config, cluster)
    problems += more
    if layout:  # DeepSpeed's batch sizes need the data-parallel degree
        config, batch = batch_triple(config, layout.dp)
        problems += batch
    if problems:
        raise ConfigError(problems)
    return config, layout
