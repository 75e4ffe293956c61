"""SMP's activation-checkpointing (recompute) strategy names, read by the runtime and by the planner (which loads
no torch).

The planner names a strategy with an op-selective policy "strategy:policy" ("each:matmul": every block a region
that keeps its matrix products' outputs), the call `set_activation_checkpointing(blocks, strategy=..., policy=...)`.
"""

from __future__ import annotations

import re
from typing import Optional

_GROUP = re.compile(r"group_([1-9][0-9]*)")


def checkpointing_group_size(strategy: str) -> Optional[int]:
    """Blocks per region: 1 for "each", None (all of a stage's run) for "contiguous", k for "group_k"."""
    if strategy == "each":
        return 1
    if strategy == "contiguous":
        return None
    found = _GROUP.fullmatch(strategy) if isinstance(strategy, str) else None
    if found is None:
        raise ValueError(f"strategy must be 'each', 'contiguous' or 'group_<k>' with k a positive integer "
                         f"(e.g. 'group_2'), got {strategy!r}")
    return int(found.group(1))


POLICIES = ("matmul", "alternate_matmul")  # parallel/recompute/selective.py's named policies


def split_policy(name: str) -> tuple[str, Optional[str]]:
    """A planner checkpointing name as (SMP strategy or "none", op-selective policy or None)."""
    strategy, _, policy = name.partition(":")
    if policy and policy not in POLICIES:
        raise ValueError(f"checkpointing policy {policy!r} is not one of {', '.join(POLICIES)} (in {name!r})")
    return strategy, policy or None
