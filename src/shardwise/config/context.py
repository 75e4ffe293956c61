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
                        "over cp ranks and the rest is data parallelism", f"use a divisor of {ranks}: {_divisors(ranks)}")]
    return []
