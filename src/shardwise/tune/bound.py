"""Stopping by the planner's bound: the candidates not yet tried cannot win when even their most optimistic
corrected prediction does not beat the measured best.

Each measured trial says how far off the planner was for it (measured ÷ predicted, of the tuning metric). A
candidate's best case is its prediction corrected by the most favourable of those ratios (the one under which
the planner most overrated what it measured: least time or memory, most samples/s), widened by a margin
(default 10 %) for the trials' noise. When no remaining candidate's best case beats the best measured value,
running them cannot change the outcome, and the tuning run stops. Two measured trials are needed first: one
ratio says nothing of how it varies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .candidates import Candidate

DEFAULT_MARGIN = 0.10
MIN_MEASURED = 2


def predicted_value(metric: str, candidate: Candidate) -> float:
    """The planner's prediction of `metric` for a candidate: step time (latency), samples/s of the batch it
    planned (throughput), or the largest rank's bytes (memory)."""
    e = candidate.evaluation
    if metric == "throughput":
        return e.batch_size * e.layout.dp / e.step_time
    if metric == "memory":
        return candidate.predicted_memory_bytes
    return candidate.predicted_step_time_s


@dataclass(frozen=True)
class Bound:
    """Why the remaining candidates cannot win: the best case among them against the measured best."""

    remaining: int
    best_case: float       # the remaining candidates' most favourable corrected prediction
    ratio: float           # the most favourable measured / predicted ratio seen
    measured_best: float
    best_trial: int

    def describe(self, metric: str, margin: float) -> str:
        unit = {"latency": "s/step", "throughput": "samples/s", "memory": "bytes"}[metric]
        return (f"the {self.remaining} remaining candidates cannot beat trial {self.best_trial} by the planner's bound: "
                f"their best prediction corrected by measured/predicted {self.ratio:.3g} and a {margin:.0%} margin is "
                f"{self.best_case:.4g} {unit}, the measured best {self.measured_best:.4g} {unit}")


def cannot_win(metric: str, more_is_better: bool, key: str, tried: Sequence[tuple[Candidate, dict[str, Any]]],
               remaining: Sequence[Candidate], best: Optional[dict[str, Any]], margin: float) -> Optional[Bound]:
    """A Bound when no candidate in `remaining` can beat `best` (the best measured row, its value at `key`) by
    the predictions of `tried` (each candidate with its trial row); None when one still can, or too little
    was measured to say."""
    ratios = [row[key] / predicted_value(metric, c) for c, row in tried if row.get(key) is not None]
    if not remaining or best is None or len(ratios) < MIN_MEASURED:
        return None
    if more_is_better:
        ratio = max(ratios)
        best_case = max(predicted_value(metric, c) for c in remaining) * ratio * (1 + margin)
        hopeless = best_case <= best[key]
    else:
        ratio = min(ratios)
        best_case = min(predicted_value(metric, c) for c in remaining) * ratio * (1 - margin)
        hopeless = best_case >= best[key]
    return Bound(len(remaining), best_case, ratio, best[key], best["trial"]) if hopeless else None
