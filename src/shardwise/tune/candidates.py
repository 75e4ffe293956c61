"""The configs a tuning run tries: the planner's fitting layouts for the model on this cluster, fastest predicted
first, each merged over the user's base config.

Only what a config sets is tuned: the planner's checkpointing strategy and per-replica batch are what the script
does, so the candidates are the layouts planned with the script's own checkpointing (`checkpointing`), and each
distinct config is tried once (layouts differing only in what the script does are one trial).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..planner import ClusterSpec, Evaluation, ModelSpec, plan
from ..planner.errors import PlanError


@dataclass(frozen=True)
class Candidate:
    """One config to try: `config` is what `shardwise run --config` gets; `rank` is its place in the plan (1 is
    the planner's pick); predictions come from `evaluation`."""

    rank: int
    config: dict[str, Any]
    evaluation: Evaluation

    @property
    def predicted_step_time_s(self) -> float:
        return self.evaluation.step_time

    @property
    def predicted_memory_bytes(self) -> float:
        return self.evaluation.memory.total


# The keys a planned layout sets (planner/search.py's config_dict, and the optimizer-state offload it adds); a
# base config's own values of them give way to each candidate's, set or left at their defaults.
TUNED_KEYS = ("tensor_parallel_degree", "prescaled_batch", "sequence_parallel", "pipeline_parallel_degree",
              "microbatches", "shard_optimizer_state", "zero_stage", "sharded_data_parallel_degree",
              "zero_hpz_partition_size", "offload_activations", "offload_optimizer_state", "context_parallel_degree",
              "context_parallel_mode", "expert_parallel_degree")


def merged(base: Mapping[str, Any], planned: Mapping[str, Any]) -> dict[str, Any]:
    """The base config without its layout keys, the planned layout's over it (the layout is what is tuned)."""
    return {**{k: v for k, v in base.items() if k not in TUNED_KEYS}, **planned}


def candidates(spec: ModelSpec, cluster: ClusterSpec, base: Mapping[str, Any], *, limit: int,
               global_batch: Optional[int] = None, seq: Optional[int] = None, precision: Optional[str] = None,
               checkpointing: str = "none", shuffled: bool = False) -> list[Candidate]:
    """Up to `limit` distinct configs among the fitting layouts planned with `checkpointing`, in plan order, or
    `shuffled` (a random order, seed 0: DeepSpeed's random tuner). Each keeps its place in the plan as `rank`."""
    result = plan(spec, cluster, global_batch=global_batch, seq=seq, precision=precision)
    distinct: list[Candidate] = []
    seen: list[dict] = []
    for e in result.fitting:
        if e.checkpointing != checkpointing or e.config in seen:
            continue
        seen.append(e.config)
        distinct.append(Candidate(len(distinct) + 1, merged(base, e.config), e))
    if shuffled:
        random.Random(0).shuffle(distinct)
    chosen = distinct[:limit]
    if not chosen:
        raise PlanError(f"no layout of {spec.name} fits {cluster.name} with checkpointing {checkpointing!r}; "
                        "run `shardwise plan --explain` with the same model and cluster to see why")
    return chosen
