"""context_parallel_degree's rules on a world: its ranks are a mesh axis of their own, `cp`, beside tp and pp.

Each sequence is split over the cp ranks, so the world must hold whole tp × pp × cp blocks; what remains is data
parallelism. The rules about the model (attention it can split, heads for all_to_all) and the sequence (2 × degree
equal chunks) are checked where those are known (parallel/context/).
"""

from __future__ import annotations

from ..errors import Problem
from .schema import ShardwiseConfig

KEY = "context_parallel_degree"


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def context_problems(config: ShardwiseConfig, ranks: int) -> list[Problem]:
    """What `context_parallel_degree` breaks when `ranks` = world / (tp × pp) ranks are left for cp × dp."""
    cp = config.context_parallel_degree
    if ranks % cp:
        return [Problem(KEY, cp, f"must divide the {ranks} ranks left by tensor and pipeline parallelism "
                        "(world / (tensor_parallel_degree × pipeline_parallel_degree)): every sequence is split "
                        "over cp ranks and the rest is data parallelism",
                        f"use a divisor of {ranks}: {_divisors(ranks)}")]
    return []


# What the runtime's context parallelism does not run with yet: (key, is it set, why), each refused by name.
def _not_yet(config: ShardwiseConfig, dp_replicate: int) -> list[tuple[str, object, bool]]:
    return [
        ("pipeline_cut", config.pipeline_cut, config.pipeline_parallel_degree > 1 and config.pipeline_cut == "graph"),
        # MiCS's partition groups under a pipeline, where FSDP2's own hybrid sharding reduces across them
        ("sharded_data_parallel_degree", config.sharded_data_parallel_degree,
         config.effective_zero_stage >= 2 and dp_replicate > 1 and config.pipeline_parallel_degree > 1),
    ]


def combination_problems(config: ShardwiseConfig, dp_replicate: int) -> list[Problem]:
    """Settings context parallelism does not run with yet in this release, each named with the fix."""
    cp = config.context_parallel_degree
    if cp == 1:
        return []
    return [Problem(key, value, f"does not run with context_parallel_degree {cp} in this release (context "
                    "parallelism composes with DDP, ZeRO-1/2/3, MiCS outside pipelines, tensor, sequence and expert "
                    "parallelism, pipelines cut at their blocks, checkpointing and precision)", f"leave {key} at its default, or set context_parallel_degree to 1")
            for key, value, used in _not_yet(config, dp_replicate) if used]
