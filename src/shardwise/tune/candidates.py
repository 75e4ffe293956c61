"""The configs a tuning run tries: the planner's fitting layouts for the model on this cluster, fastest predicted
first, each merged over the user's base config.

Only what a config sets is tuned: the planner's checkpointing strategy and per-replica batch are what the script
does, so the candidates are the layouts planned with the script's own checkpointing (`checkpointing`), and each
distinct config is tried once (layouts differing only in what the script does are one trial).
"""

from __future__ import annotations

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


def merged(base: Mapping[str, Any], planned: Mapping[str, Any]) -> dict[str, Any]:
    """The base config with the planned layout's keys over it (the layout is what is tuned)."""
    return {**base, **planned}


def candidates(spec: ModelSpec, cluster: ClusterSpec, base: Mapping[str, Any], *, limit: int,
               global_batch: Optional[int] = None, seq: Optional[int] = None, precision: Optional[str] = None,
               checkpointing: str = "none") -> list[Candidate]:
    """Up to `limit` distinct configs among the fitting layouts planned with `checkpointing`, in plan order."""
    result = plan(spec, cluster, global_batch=global_batch, seq=seq, precision=precision)
    chosen: list[Candidate] = []
    seen: list[dict] = []
    for e in result.fitting:
        if e.checkpointing != checkpointing or e.config in seen:
            continue
        seen.append(e.config)
        chosen.append(Candidate(len(chosen) + 1, merged(base, e.config), e))
        if len(chosen) == limit:
            break
    if not chosen:
        raise PlanError(f"no layout of {spec.name} fits {cluster.name} with checkpointing {checkpointing!r}; "
                        "run `shardwise plan --explain` with the same model and cluster to see why")
    return chosen
