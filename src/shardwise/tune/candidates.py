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

from ..config import ConfigError
from ..planner import ClusterSpec, Evaluation, ModelSpec, evaluate, plan
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

    def batch_values(self, global_batch: int) -> dict[str, int]:
        """The batch as DeepSpeed's config keys say it (for `arg_mappings`): sequences per rank per microbatch,
        microbatches per step, sequences per step."""
        e = self.evaluation
        return {"train_micro_batch_size_per_gpu": micro_batch(e),
                "gradient_accumulation_steps": e.config.get("microbatches", 1), "train_batch_size": global_batch}


# The keys a planned layout sets (planner/search.py's config_dict, and the optimizer-state offload it adds); a
# base config's own values of them give way to each candidate's, set or left at their defaults.
TUNED_KEYS = ("tensor_parallel_degree", "prescaled_batch", "sequence_parallel", "pipeline_parallel_degree",
              "microbatches", "shard_optimizer_state", "zero_stage", "sharded_data_parallel_degree",
              "zero_hpz_partition_size", "offload_activations", "offload_optimizer_state", "context_parallel_degree",
              "context_parallel_mode", "expert_parallel_degree")


def merged(base: Mapping[str, Any], planned: Mapping[str, Any]) -> dict[str, Any]:
    """The base config without its layout keys, the planned layout's over it (the layout is what is tuned)."""
    return {**{k: v for k, v in base.items() if k not in TUNED_KEYS}, **planned}


def micro_batch_variants(spec: ModelSpec, cluster: ClusterSpec, chosen: Evaluation, global_batch: int,
                         seq: Optional[int], count: Optional[int] = None) -> list[Evaluation]:
    """The planner's pick of a layout and up to `count` - 1 (None: all) other microbatch counts of it that fit
    (powers of two dividing its replica's batch: other micro batch sizes at the same global batch), fastest
    predicted first."""
    others = []
    for m in (1 << i for i in range(chosen.batch_size.bit_length())):
        if chosen.batch_size % m or m == chosen.config.get("microbatches", 1):
            continue
        config = {k: v for k, v in chosen.config.items() if k != "microbatches"}
        if m > 1:
            config["microbatches"] = m
        try:
            variant = evaluate(spec, cluster, config, global_batch=global_batch, seq=seq,
                               checkpointing=chosen.checkpointing)
        except (ConfigError, PlanError):
            continue
        if variant.fits:
            others.append(variant)
    return [chosen, *sorted(others, key=lambda e: e.step_time)[:None if count is None else count - 1]]


def micro_batch(e: Evaluation) -> int:
    """Sequences per rank per microbatch (DeepSpeed's train_micro_batch_size_per_gpu)."""
    return e.micro_batch or e.batch_size


def candidates(spec: ModelSpec, cluster: ClusterSpec, base: Mapping[str, Any], *, limit: int,
               global_batch: Optional[int] = None, seq: Optional[int] = None, precision: Optional[str] = None,
               checkpointing: str = "none", shuffled: bool = False,
               micro_batch_sizes: Optional[int] = None,
               micro_batch_range: tuple[Optional[int], Optional[int]] = (None, None)) -> list[Candidate]:
    """Up to `limit` distinct configs among the fitting layouts planned with `checkpointing`, fastest predicted
    first, or `shuffled` (a random order, seed 0: DeepSpeed's random tuner). The planner keeps each layout's best
    microbatch count; with `micro_batch_sizes` (DeepSpeed's num_tuning_micro_batch_sizes) up to that many of each
    layout are tried. `micro_batch_range` (DeepSpeed's min/max_train_micro_batch_size_per_gpu) keeps the counts
    whose micro batch per rank lies in it, a layout's best such count standing in for the planner's pick when that
    lies outside. Each keeps its place in that order as `rank`."""
    result = plan(spec, cluster, global_batch=global_batch, seq=seq, precision=precision)
    picks = [e for e in result.fitting if e.checkpointing == checkpointing]
    per_layout = micro_batch_sizes or 1
    low, high = micro_batch_range
    bounded = (low, high) != (None, None)
    if per_layout > 1 or bounded:
        def kept(e: Evaluation) -> list[Evaluation]:
            variants = micro_batch_variants(spec, cluster, e, result.global_batch, seq, None if bounded else per_layout)
            return [v for v in variants if (low or 1) <= micro_batch(v) <= (high or micro_batch(v))][:per_layout]

        picks = sorted((v for e in picks for v in kept(e)), key=lambda e: e.step_time)
    distinct: list[Candidate] = []
    seen: list[dict] = []
    for e in picks:
        if e.config in seen:
            continue
        seen.append(e.config)
        distinct.append(Candidate(len(distinct) + 1, merged(base, e.config), e))
    if shuffled:
        random.Random(0).shuffle(distinct)
    chosen = distinct[:limit]
    if not chosen:
        bounds = f" and a micro batch per rank from {low or 1} to {high or 'any'}" if bounded else ""
        raise PlanError(f"no layout of {spec.name} fits {cluster.name} with checkpointing {checkpointing!r}{bounds}; "
                        "run `shardwise plan --explain` with the same model and cluster to see why")
    return chosen
