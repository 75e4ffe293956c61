"""Calibration: the planner's free constants for this cluster fitted to what a tuning run measured, so that its
predictions for the same configs come near the measured step times; written as a cluster file
(planner/cluster_file.py) that `shardwise plan --cluster FILE` and `shardwise tune --cluster FILE` read back.

The constants fitted are those the time model takes from the cluster (planner/timing.py, efficiency.py,
collectives.py): the FLOP/s a device sustains (its peak × the achievable share: what the matmuls achieve),
the memory bandwidth of the optimizer step and the streaming kernels, and the per-device bandwidth and the
per-step latency of the collectives inside a node (gloo or NCCL as measured, link efficiency included), and on
several nodes a node's bandwidth and the per-step latency between nodes. Each is a scale on the preset's
value, fitted in log space by least squares on log(predicted / measured) over the measured trials, by a global
search (the constants trade off against each other, where a local descent stalls), the planner itself run for
each trial's config at every point tried (its overlaps and maxima make the step time no sum of the constants'
shares). A small pull toward the preset keeps a constant no trial's time depends on where
it was. The host time of each communication op on the critical path (ClusterSpec.critical_op_seconds: on CPU
ranks sharing cores, milliseconds) is fitted where the trials issue such ops; other per-step host overheads
(Python, launches) end up in the constants above.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from scipy.optimize import differential_evolution

from ..config import ConfigError
from ..planner import ClusterSpec, ModelSpec, evaluate, resolve_model
from ..planner.cluster_file import is_cluster_file, resolve_cluster, with_values, write_cluster_file
from .results import SUMMARY_FILE
from .tuner import TRIALS_FILE

# The constants fitted, each as a scale on the cluster's own value: name → how it is read from a cluster.
CONSTANTS: dict[str, Callable[[ClusterSpec], Any]] = {
    "peak_flops": lambda c: dict(c.device.peak_flops),   # per precision (× the time model's achievable share)
    "memory_bandwidth": lambda c: c.device.memory_bandwidth,
    "intra_node_bandwidth": lambda c: c.intra_node_bandwidth,    # a collective's, per device
    "intra_node_latency": lambda c: c.intra_node_latency,        # per collective step
    "critical_op_seconds": lambda c: c.critical_op_seconds,      # host time per op on the critical path
}
# Where the cluster's own value is 0 (every preset charges no host time per critical op), the fit's scale starts
# from this value instead: the order of a gloo op's host time on CPU ranks that share cores (a small all-reduce on
# this project's 2-core machine took 0.5-2 ms on 2 ranks, 4-7 ms on 4). It is fitted only where a trial issues
# such ops (tensor, context, expert or pipeline parallelism): no other trial's time depends on it.
_REFERENCES = {"critical_op_seconds": 1e-3}
# Fitted only on a cluster of several nodes (on one, no trial's time depends on them).
BETWEEN_NODES: dict[str, Callable[[ClusterSpec], Any]] = {
    "inter_node_bandwidth": lambda c: c.inter_node_bandwidth,    # a node's
    "inter_node_latency": lambda c: c.inter_node_latency,
}


def constants(cluster: ClusterSpec) -> dict[str, Callable[[ClusterSpec], Any]]:
    """The constants fitted for `cluster`."""
    return {**CONSTANTS, **(BETWEEN_NODES if cluster.nodes > 1 else {})}


_SPAN = 9.0          # each log-scale is searched in [-_SPAN, _SPAN] (×1/8000 to ×8000)
_POPULATION = 10     # differential evolution's candidates per constant fitted
_GENERATIONS = 60    # its generations at most (it stops earlier once the population agrees)
_PULL = 1e-6         # weight of each log-scale² in the loss: a constant no trial depends on stays at the preset
CALIBRATED_CLUSTER_FILE = "cluster.json"


@dataclass(frozen=True)
class Trial:
    """A measured trial as calibration uses it: the config that ran and its measured step time."""

    trial: int
    config: dict[str, Any]
    measured_step_time_s: float


@dataclass
class Calibration:
    values: dict[str, Any]                   # the fitted constants (absolute), as a cluster file holds them
    scales: dict[str, float]                 # each over the preset's value (those the preset gives one)
    trials: list[int] = field(default_factory=list)
    before: list[float] = field(default_factory=list)   # predicted step time per trial, preset cluster
    after: list[float] = field(default_factory=list)    # the same, calibrated cluster
    measured: list[float] = field(default_factory=list)

    def errors(self, predicted: Sequence[float]) -> list[float]:
        return [p / m - 1 for p, m in zip(predicted, self.measured)]

    def described(self) -> str:
        """The fitted constants as people read them: each a scale on the preset's value, or its value in seconds
        where the preset has none."""
        return ", ".join(f"{k} ×{self.scales[k]:.3g}" if k in self.scales else f"{k} {self.values[k]:.3g} s"
                         for k in self.values)

    def summary(self) -> dict[str, Any]:
        def mean_abs(errors):
            return sum(abs(e) for e in errors) / len(errors) if errors else None

        before, after = self.errors(self.before), self.errors(self.after)
        return {"constants": self.values, "scales": self.scales, "fitted": self.described(), "trials": self.trials,
                "mean_abs_error_before": mean_abs(before), "mean_abs_error_after": mean_abs(after),
                "within_10_percent_before": sum(abs(e) <= 0.1 for e in before),
                "within_10_percent_after": sum(abs(e) <= 0.1 for e in after)}


def measured_trials(rows: Sequence[Mapping[str, Any]]) -> list[Trial]:
    """The rows of trials.jsonl that measured a step time."""
    return [Trial(r["trial"], r["config"], r["measured_step_time_s"]) for r in rows
            if r.get("measured_step_time_s")]


def read_trials(results: Path) -> list[dict[str, Any]]:
    path = results / TRIALS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give the --results directory of a `shardwise tune` run")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class _Model:
    """The planner's step time for each trial on the cluster with the constants scaled by exp(θ)."""

    def __init__(self, spec: ModelSpec, cluster: ClusterSpec, trials: Sequence[Trial], global_batch: int,
                 seq: Optional[int], checkpointing: str):
        self.spec, self.cluster, self.trials = spec, cluster, list(trials)
        self.global_batch, self.seq, self.checkpointing = global_batch, seq, checkpointing
        self.preset = {name: read(cluster) for name, read in constants(cluster).items()}
        self.base = {name: value or _REFERENCES.get(name, value) for name, value in self.preset.items()
                     if value or self._depends_on(name)}

    def _depends_on(self, name: str) -> bool:
        """Whether some trial's predicted time changes when a constant the cluster sets to 0 takes its reference."""
        return name in _REFERENCES and self.step_times(with_values(self.cluster, {name: _REFERENCES[name]})) \
            != self.step_times(self.cluster)

    def step_times(self, cluster: ClusterSpec) -> list[float]:
        return [evaluate(self.spec, cluster, t.config, global_batch=self.global_batch, seq=self.seq,
                         checkpointing=self.checkpointing).step_time for t in self.trials]

    def values(self, theta: Sequence[float]) -> dict[str, Any]:
        def scaled(value, t):
            return {k: v * math.exp(t) for k, v in value.items()} if isinstance(value, dict) else value * math.exp(t)

        return {name: scaled(self.base[name], t) for name, t in zip(self.base, theta)}

    def predict(self, theta: Sequence[float]) -> list[float]:
        return self.step_times(with_values(self.cluster, self.values(theta)))

    def loss(self, theta: Sequence[float]) -> float:
        logs = [math.log(p / t.measured_step_time_s) for p, t in zip(self.predict(theta), self.trials)]
        return sum(x * x for x in logs) / len(logs) + _PULL * sum(t * t for t in theta)


def _fit(model: _Model) -> list[float]:
    """The global least-squares fit of the log-scales: scipy's differential evolution over the whole box (seeded,
    so the same trials give the same fit), polished by L-BFGS-B. A descent one constant at a time stalls where a
    bandwidth and a latency trade off: on the recorded 4-rank trials it stopped at twice the error of the optimum."""
    result = differential_evolution(model.loss, [(-_SPAN, _SPAN)] * len(model.base), seed=0, popsize=_POPULATION,
                                    maxiter=_GENERATIONS, tol=1e-6, polish=True)
    return list(result.x)


def calibrate(spec: ModelSpec, cluster: ClusterSpec, trials: Sequence[Trial], *, global_batch: int,
              seq: Optional[int] = None, checkpointing: str = "none") -> Calibration:
    """Fit the cluster's constants to the measured `trials` (each config as the planner predicts it with
    `global_batch`, `seq` and `checkpointing`); a ValueError without a trial to fit."""
    usable = []
    for t in trials:
        try:
            evaluate(spec, cluster, t.config, global_batch=global_batch, seq=seq, checkpointing=checkpointing)
        except ConfigError:
            continue  # a config the planner refuses on this cluster has no prediction to correct
        usable.append(t)
    if not usable:
        raise ValueError("no measured trial to calibrate from; run `shardwise tune` until some trial is measured")
    model = _Model(spec, cluster, usable, global_batch, seq, checkpointing)
    theta = _fit(model)
    return Calibration(values=model.values(theta),
                       scales={k: math.exp(t) for k, t in zip(model.base, theta) if model.preset[k]},
                       trials=[t.trial for t in usable], before=model.step_times(cluster),
                       after=model.predict(theta), measured=[t.measured_step_time_s for t in usable])


def calibrated_cluster(cluster: ClusterSpec, calibration: Calibration) -> ClusterSpec:
    return with_values(cluster, calibration.values)


def held_out(spec: ModelSpec, cluster: ClusterSpec, trials: Sequence[Trial], left_out: int, *, global_batch: int,
             seq: Optional[int] = None, checkpointing: str = "none") -> tuple[float, float, float]:
    """Fit on every trial but `left_out` (a trial number) and predict that one: (before, after, measured)."""
    out = next(t for t in trials if t.trial == left_out)
    fitted = calibrate(spec, cluster, [t for t in trials if t.trial != left_out], global_batch=global_batch,
                       seq=seq, checkpointing=checkpointing)
    after = evaluate(spec, calibrated_cluster(cluster, fitted), out.config, global_batch=global_batch, seq=seq,
                     checkpointing=checkpointing).step_time
    before = evaluate(spec, cluster, out.config, global_batch=global_batch, seq=seq,
                      checkpointing=checkpointing).step_time
    return before, after, out.measured_step_time_s


def planning_inputs(results: Path) -> dict[str, Any]:
    """What the tuning run planned with (summary.json's `planning`: model, cluster, ranks, batch, sequence,
    checkpointing), {} when it does not say."""
    path = results / SUMMARY_FILE
    return dict(json.loads(path.read_text(encoding="utf-8")).get("planning") or {}) if path.is_file() else {}


def calibrate_results(results: Path, planning: Mapping[str, Any], out: Optional[Path] = None,
                      leave_one_out: bool = False) -> tuple[Calibration, Path, list[tuple[int, float, float, float]]]:
    """Calibrate from a tuning run's results directory and write the cluster file (default
    <results>/cluster.json). Also, with `leave_one_out`, each trial predicted by a fit on the others:
    (trial, before, after, measured)."""
    spec = resolve_model(planning["model"], input_shape=tuple(planning.get("input_shape") or ()) or None,
                         seq=planning.get("seq"))
    cluster_text = planning.get("cluster") or "local"
    given = dict(planning.get("cluster_values") or {})  # what the tuning run's flags set over the preset
    cluster = resolve_cluster(cluster_text, nodes=planning.get("nnodes") or 1, devices_per_node=planning["nproc"],
                              **given)
    trials = measured_trials(read_trials(results))
    inputs = dict(global_batch=planning.get("global_batch") or cluster.world_size, seq=planning.get("seq"),
                  checkpointing=planning.get("checkpointing") or "none")
    fitted = calibrate(spec, cluster, trials, **inputs)
    held = []
    if leave_one_out and len(fitted.trials) > 2:
        held = [(n, *held_out(spec, cluster, [t for t in trials if t.trial in fitted.trials], n, **inputs))
                for n in fitted.trials]
    preset = json.loads(Path(cluster_text).read_text())["preset"] if is_cluster_file(cluster_text) else cluster_text
    report = {**fitted.summary(), "measured": fitted.measured, "predicted_before": fitted.before,
              "predicted_after": fitted.after, "fitted_from": str(results.resolve()), "planning": dict(planning)}
    if held:
        report["held_out"] = [dict(zip(("trial", "before", "after", "measured"), h)) for h in held]
    path = write_cluster_file(out or results / CALIBRATED_CLUSTER_FILE, preset, cluster, {**given, **fitted.values},
                              report)
    return fitted, path, held
