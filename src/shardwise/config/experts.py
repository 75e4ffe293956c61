"""expert_parallel_degree's rules on a layout: expert parallelism borrows its ranks from the sharding group.

As torchtitan does, the `ep` ranks of a mixture-of-experts layer are a slice of the sharding group, which under
context parallelism spans the cp ranks too (dp_shard × cp = expert-sharding × ep): each expert share is then
sharded by ZeRO over the ranks left, and its gradients are reduced over those and the replicas only. A pipeline
cut along the block list splits each stage's experts; one cut from the module graph is refused. The rule about
the model (its number of experts, or having experts at all) is checked where the model is known
(parallel/experts/).
"""

from __future__ import annotations

from ..errors import Problem
from ..topology import Layout
from .schema import ShardwiseConfig

KEY = "expert_parallel_degree"


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def expert_problems(config: ShardwiseConfig, layout: Layout) -> list[Problem]:
    """What `expert_parallel_degree` breaks on `layout`."""
    ep = config.expert_parallel_degree
    # ZeRO-2/3 shard over dp_shard × cp (context parallelism's ranks hold copies of the parameters too)
    shard = layout.dp_shard * layout.cp if config.effective_zero_stage >= 2 else 1
    if ep == 1:
        return []
    if layout.pp > 1 and config.pipeline_cut == "graph":  # its stages are graphs: no experts module to split
        return [Problem(KEY, ep, "does not combine with pipeline_cut 'graph' yet (a pipeline cut from the module "
                        "graph keeps no experts modules)", "set pipeline_cut to 'blocks' or 'auto'")]
    if shard == 1:
        return [Problem(KEY, ep, "borrows its ranks from the sharding group, and this config shards over none "
                        "(ZeRO-2/3 shard; DDP and ZeRO-1 do not)",
                        f"set sharded_data_parallel_degree (or zero_stage 2 or 3) so that {ep} divides the "
                        "sharding group")]
    if shard % ep:
        spans_cp = f", times context_parallel_degree {layout.cp}" if layout.cp > 1 else ""
        return [Problem(KEY, ep, f"must divide the sharding group's {shard} ranks it borrows from "
                        "(sharded_data_parallel_degree, or the whole data-parallel group under zero_stage 2/3"
                        f"{spans_cp})",
                        f"use a divisor of {shard}: {_divisors(shard)}")]
    return []
