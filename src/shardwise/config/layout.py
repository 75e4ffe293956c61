"""The layout a config gives on a cluster, and every rule it breaks there: the one validation `init`,
`check-config`, `run` and the planner share."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from ..topology import Cluster, Layout
from ..errors import ConfigError, Problem
from .context import combination_problems, context_problems
from .decisions import Decisions, PrecisionMode
from .experts import expert_problems
from .hpz import KEY as HPZ
from .packages import package_problems
from .schema import ShardwiseConfig
from .validate import batch_triple, config_problems, unavailable_problems


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
    split = context_problems(config, world // (tp * pp))
    if split:
        return None, problems + split
    cp = config.context_parallel_degree
    dp = world // (tp * pp * cp)
    group = config.sharded_data_parallel_degree
    if group > 1 and dp % group:
        problems.append(Problem("sharded_data_parallel_degree", group,
                                f"must divide the data-parallel degree {dp} (= world {world} / (tp {tp} × pp {pp}))",
                                f"use a divisor of {dp}: {_divisors(dp)}"))
    if not config.ddp and dp > 1:
        problems.append(Problem("ddp", False, f"gradients must be synchronised across the {dp} data-parallel ranks",
                                "set ddp to true, or make tp × pp equal the world size"))
    shard = 1 if config.effective_zero_stage < 2 else group if group > 1 else dp
    layout = Layout(pp=pp, dp_replicate=dp // shard, dp_shard=shard, tp=tp, placement=config.placement, cp=cp)
    problems += _hpz_problems(config, layout, cluster)
    problems += combination_problems(config, layout.dp_replicate)
    problems += expert_problems(config, layout)
    if config.sequence_parallel_regather and Decisions(config, layout).precision_mode() is PrecisionMode.AUTOCAST:
        problems.append(Problem("sequence_parallel_regather", True, "is not available under autocast (a lone "
                                "replica in bf16/fp16 without zero_stage): each linear keeps its own cast copy of "
                                "the gathered input", "set zero_stage to 1 or more, or drop "
                                "sequence_parallel_regather"))
    spanning = layout.spanning_group(cluster, "tp")
    if spanning and not any(p.path == "tensor_parallel_degree" for p in problems):
        problems.append(Problem("placement_strategy", config.placement_strategy,
                                f"puts tensor-parallel group {spanning} on different nodes of "
                                f"{cluster.devices_per_node} devices, and TP stays inside a node",
                                "use a placement with T last, such as 'cluster' (DPT)"))
    return layout, problems


def _hpz_problems(config: ShardwiseConfig, layout: Layout, cluster: Cluster) -> list[Problem]:
    """ZeRO++ hpZ's secondary groups split each sharding group into groups of `zero_hpz_partition_size`
    neighbouring ranks. Without tensor or pipeline parallelism (config/hpz.py refuses both) a sharding group's
    ranks are consecutive, so a size that divides the ranks per node keeps every secondary group on one node. A
    size of the whole sharding group or more is plain ZeRO-3, as DeepSpeed clamps it to the world: a DeepSpeed
    config made for large nodes still runs on a small machine or in one process."""
    size, shard = config.zero_hpz_partition_size, layout.dp_shard * layout.cp  # ZeRO shards over the cp ranks too
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
