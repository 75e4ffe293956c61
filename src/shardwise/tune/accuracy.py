"""How good the plan was, over the trials that ran: each prediction's error, Spearman's rank correlation between
predicted and measured step time, and the regret of the planner's pick (its measured step time over the best's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..planner.statistics import spearman


def relative_error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """(predicted - measured) / measured; None without both."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


@dataclass(frozen=True)
class Accuracy:
    trials: int                       # trials measured
    spearman_step_time: Optional[float]
    regret: Optional[float]           # planner's pick's measured step time / the best measured; None if it failed
    mean_abs_step_time_error: Optional[float]
    mean_abs_memory_error: Optional[float]


def planner_accuracy(rows: Sequence[dict]) -> Accuracy:
    """Over trial rows (as trials.jsonl holds them) that were measured; rank 1 is the planner's pick."""
    done = [r for r in rows if r.get("measured_step_time_s") is not None]
    best = min((r["measured_step_time_s"] for r in done), default=None)
    pick = next((r for r in done if r["plan_rank"] == 1), None)
    time_errors = [abs(r["step_time_error"]) for r in done if r.get("step_time_error") is not None]
    memory_errors = [abs(r["memory_error"]) for r in done if r.get("memory_error") is not None]
    return Accuracy(
        trials=len(done),
        spearman_step_time=spearman([r["predicted_step_time_s"] for r in done],
                                    [r["measured_step_time_s"] for r in done]),
        regret=pick["measured_step_time_s"] / best if pick and best else None,
        mean_abs_step_time_error=sum(time_errors) / len(time_errors) if time_errors else None,
        mean_abs_memory_error=sum(memory_errors) / len(memory_errors) if memory_errors else None)
