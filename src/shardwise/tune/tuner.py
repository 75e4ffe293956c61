"""The tuning loop: candidates in the planner's order, one trial each, until the trials, the time budget or the
early stop run out; the best by the chosen metric among the trials that were measured."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from .accuracy import Accuracy, planner_accuracy, relative_error
from .bound import DEFAULT_MARGIN, cannot_win
from .candidates import Candidate
from .trial import NodePlace, TrialResult, run_trial

TRIALS_FILE = "trials.jsonl"
# metric → (the trial row's value it compares, whether more is better)
METRICS = {"throughput": ("samples_per_s", True), "latency": ("measured_step_time_s", False),
           "memory": ("max_memory_bytes", False)}


@dataclass(frozen=True)
class TuneSettings:
    script: str
    script_args: Sequence[str] = ()
    nproc: int = 1
    steps: int = 3
    warmup: int = 1
    metric: str = "throughput"
    time_budget_s: Optional[float] = None
    trial_deadline_s: float = 600.0
    early_stopping: Optional[int] = None   # stop after this many trials in a row that do not beat the best
    bound_margin: Optional[float] = DEFAULT_MARGIN  # stop by the planner's bound with this margin (None: never)
    results: Path = Path("tune_results")
    runs: Optional[Path] = None            # where each trial's run directory goes (default: results)
    planning: Mapping[str, Any] = field(default_factory=dict)  # what the candidates were planned with (summary.json)
    place: Optional[NodePlace] = None      # this node's place in a tuning run across nodes (nodes.py)
    # DeepSpeed's arg_mappings: a batch value a trial sets (Candidate.batch_values) → the script's argument for it
    arg_mappings: Mapping[str, str] = field(default_factory=dict)


@dataclass
class TuneResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    best: Optional[dict[str, Any]] = None
    stopped: str = "every candidate was tried"

    @property
    def accuracy(self) -> Accuracy:
        return planner_accuracy(self.rows)


def with_arguments(args: Sequence[str], values: Mapping[str, str]) -> tuple[str, ...]:
    """`args` with each `--flag` of `values` set to its value: where given (`--flag v` or `--flag=v`) in place,
    else added at the end."""
    out, rest, i = [], dict(values), 0
    while i < len(args):
        name, eq, _ = args[i].partition("=")
        if name in values:
            out += [f"{name}={values[name]}"] if eq else [name, values[name]]
            i += 0 if eq else 1   # the value given after it
            rest.pop(name, None)
        else:
            out.append(args[i])
        i += 1
    return tuple(out + [part for flag, value in rest.items() for part in (flag, value)])


def trial_arguments(settings: TuneSettings, candidate: Candidate) -> tuple[str, ...]:
    """The script's arguments in a candidate's trial: the batch values `arg_mappings` names, set over the given
    arguments."""
    if not settings.arg_mappings:
        return tuple(settings.script_args)
    values = candidate.batch_values(settings.planning.get("global_batch") or 0)
    return with_arguments(settings.script_args, {flag: str(values[key]) for key, flag in settings.arg_mappings.items()})


def trial_row(number: int, candidate: Candidate, result: TrialResult,
              script_args: Sequence[str] = ()) -> dict[str, Any]:
    """What trials.jsonl holds for one trial: the candidate, its prediction, the script's arguments, and what was
    measured or why not."""
    m = result.measurement
    row = {"trial": number, "plan_rank": candidate.rank, "config": candidate.config, "script_args": list(script_args),
           "layout": candidate.evaluation.layout.degrees(),
           "predicted_step_time_s": candidate.predicted_step_time_s,
           "predicted_memory_bytes": candidate.predicted_memory_bytes,
           "run_dir": str(result.run_dir), "exit_code": result.exit_code, "seconds": round(result.seconds, 3),
           "failure": result.failure, "message": result.message,
           "measured_step_time_s": m.step_time_s if m else None, "measured_steps": m.measured_steps if m else None,
           "samples_per_s": m.samples_per_s if m else None, "tokens_per_s": m.tokens_per_s if m else None,
           "peak_memory_bytes": {str(r): b for r, b in m.peak_memory_bytes.items()} if m else None,
           "max_memory_bytes": m.max_memory_bytes if m else None}
    row["step_time_error"] = relative_error(row["predicted_step_time_s"], row["measured_step_time_s"])
    row["memory_error"] = relative_error(row["predicted_memory_bytes"], row["max_memory_bytes"])
    return row


def append_trial(results: Path, row: dict[str, Any]) -> None:
    """One line of <results>/trials.jsonl, written as the trial ends (a tuning run stopped mid-way keeps it)."""
    results.mkdir(parents=True, exist_ok=True)
    with (results / TRIALS_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _better(metric: str, row: dict[str, Any], best: Optional[dict[str, Any]]) -> bool:
    key, more = METRICS[metric]
    value = row.get(key)
    if value is None:
        return False
    if best is None:
        return True
    return value > best[key] if more else value < best[key]


# One trial: its config, run directory and the script's arguments in, what it did out (run_trial on this node's
# ranks, or across nodes).
TrialRunner = Callable[[dict[str, Any], Path, Sequence[str]], TrialResult]


def on_this_node(settings: TuneSettings) -> TrialRunner:
    """Trials launched on this node's ranks."""
    return lambda config, run_dir, args: run_trial(config, settings.script, args, nproc=settings.nproc,
                                                   steps=settings.steps, warmup=settings.warmup,
                                                   deadline_s=settings.trial_deadline_s, run_dir=run_dir)


def tune(candidates: Sequence[Candidate], settings: TuneSettings,
         on_trial: Callable[[dict[str, Any]], None] = lambda row: None,
         runner: Optional[TrialRunner] = None, halted: Optional[Callable[[], Optional[str]]] = None) -> TuneResult:
    """Run the candidates in order, each row appended to trials.jsonl as it is made and shown to `on_trial`;
    `runner` launches each (default: on this node's ranks); `halted` says why no further trial can run, if so."""
    runner = runner or on_this_node(settings)
    if settings.metric not in METRICS:
        raise ValueError(f"metric {settings.metric!r}: use one of {', '.join(METRICS)}")
    result = TuneResult()
    start, since_better = time.monotonic(), 0
    tried: list[tuple[Candidate, dict[str, Any]]] = []
    for number, candidate in enumerate(candidates, 1):
        why = halted and halted()
        if why:
            result.stopped = why
            break
        if settings.time_budget_s is not None and time.monotonic() - start >= settings.time_budget_s:
            result.stopped = f"the time budget of {settings.time_budget_s:g} s was spent after {number - 1} trials"
            break
        if settings.early_stopping is not None and since_better >= settings.early_stopping:
            result.stopped = f"{since_better} trials in a row did not beat the best (early stopping)"
            break
        bound = settings.bound_margin is not None and cannot_win(
            settings.metric, METRICS[settings.metric][1], METRICS[settings.metric][0], tried,
            candidates[number - 1:], result.best, settings.bound_margin)
        if bound:
            result.stopped = bound.describe(settings.metric, settings.bound_margin)
            break
        args = trial_arguments(settings, candidate)
        trial = runner(candidate.config, (settings.runs or settings.results) / f"trial{number}", args)
        row = trial_row(number, candidate, trial, args)
        result.rows.append(row)
        tried.append((candidate, row))
        append_trial(settings.results, row)
        on_trial(row)
        if _better(settings.metric, row, result.best):
            result.best, since_better = row, 0
        else:
            since_better += 1
    return result
