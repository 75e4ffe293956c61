"""Human-readable account of a layout: degrees, strategy, and which ranks form each group."""

from __future__ import annotations

from ..topology import Cluster, Layout
from .decisions import Decisions
from .schema import ShardwiseConfig

_GROUPS = [
    ("tp", ("tp",), "tensor parallel"),
    ("dp_shard", ("dp_shard",), "ZeRO partition"),
    ("dp_replicate", ("dp_replicate",), "MiCS replicas, gradient all-reduce only"),
    ("rdp", ("dp_replicate", "dp_shard"), "reduced data parallel: ranks with the same TP shard"),
    ("dp", ("dp_replicate", "dp_shard", "tp"), "data parallel as SMP counts it: rdp × tp"),
    ("pp", ("pp",), "pipeline"),
]


def strategy_name(config: ShardwiseConfig, layout: Layout) -> str:
    secondary = Decisions(config, layout).secondary_partition
    name = _sharding_name(config, layout)
    return name + (f" with ZeRO++ hpZ (after forward, parameters stay sharded over {secondary} ranks, where "
                   "backward gathers them)" if secondary else "")


def _sharding_name(config: ShardwiseConfig, layout: Layout) -> str:
    stage = config.effective_zero_stage
    if stage == 0:
        return "DDP" if layout.dp > 1 else "single replica"
    if stage == 1:
        return "ZeRO-1 (optimizer state sharding)"
    if layout.dp_replicate > 1:
        return f"MiCS / ZeRO-2D (ZeRO-{stage} in partition groups of {layout.dp_shard}, {layout.dp_replicate} replicas)"
    return f"ZeRO-{stage}"


def _placement(layout: Layout) -> list[str]:
    """The rank order, when it matters: at least two of data, pipeline and tensor parallelism."""
    if sum(size > 1 for size in (layout.dp, layout.pp, layout.tp)) < 2:
        return []
    return [f"placement: {layout.placement} (ranks step through the last letter fastest: D data parallel, "
            "P pipeline, T tensor parallel)"]


def describe_layout(config: ShardwiseConfig, layout: Layout, cluster: Cluster) -> str:
    lines = [
        f"cluster: {cluster.nodes} node(s) × {cluster.devices_per_node} device(s) = {cluster.world_size} ranks",
        "layout: " + " × ".join(f"{k}={v}" for k, v in layout.degrees().items()),
        *_placement(layout),
        f"data parallel: {strategy_name(config, layout)}; precision: {config.dtype_name}; "
        f"microbatches: {config.microbatches}",
    ]
    for name, axes, meaning in _GROUPS:
        if all(getattr(layout, a) == 1 for a in axes) or (name == "dp" and layout.tp == 1):
            continue  # a trivial group, or dp when it equals rdp
        groups = layout.groups(*axes)
        where = "crosses nodes" if layout.crosses_nodes(cluster, *axes) else "inside nodes"
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:8])
        more = f" … (+{len(groups) - 8})" if len(groups) > 8 else ""
        lines.append(f"{name} groups ({meaning}, {where}): {shown}{more}")
        secondary = Decisions(config, layout).secondary_partition
        if name == "dp_shard" and secondary:
            lines.append(_secondary_groups(layout, secondary, cluster))
    return "\n".join(lines)


def _secondary_groups(layout: Layout, size: int, cluster: Cluster) -> str:
    """ZeRO++ hpZ's groups: each sharding group's ranks, `size` neighbours at a time."""
    groups = [g[i:i + size] for g in layout.groups("dp_shard") for i in range(0, len(g), size)]
    where = "crosses nodes" if any(len({cluster.node_of(r) for r in g}) > 1 for g in groups) else "inside nodes"
    shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:8])
    more = f" … (+{len(groups) - 8})" if len(groups) > 8 else ""
    return f"hpz groups (ZeRO++ hpZ secondary: backward's all-gathers, {where}): {shown}{more}"
