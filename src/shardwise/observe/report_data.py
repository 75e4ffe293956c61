"""What `shardwise report` reads from a run directory, and the per-rank figures it condenses them to.

The recorder writes `metrics/global.jsonl` (rank 0, one line per recorded step) and `metrics/rank<R>.jsonl`
(memory and comms of rank R). Reading is tolerant: optional keys may be absent or null, a run may have
recorded only one of the two kinds of file, the last line of a run that was stopped mid-write is skipped,
and a step recorded twice (a restarted run appends to the same files) counts with its last record.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any, Optional

from ..errors import ConfigError
from ..topology import Cluster
from ..config.describe import describe_layout
from ..config.layout import validate

RECORD_HINT = ("record them with the config key metrics_interval at 1 or more (the default) under shardwise run, "
               "which writes them to <run dir>/metrics")
MEMORY_STATE = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes")
MEMORY_MEASURED = ("device_peak_bytes", "device_allocated_bytes", "host_rss_bytes")
BREAKDOWN = ("forward_s", "backward_s", "optimizer_s", "data_wait_s", "exposed_comm_s", "other_s")

_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")


class ReportError(ValueError):
    """A run directory the report cannot be written for; the message says why and what to do."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One object per line; a last line cut short (the run was stopped while writing it) is skipped."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number < len(lines):
                raise ReportError(f"{path}:{number} is not JSON ({err.msg}); fix or delete that line") from None
    return rows


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


@dataclass(frozen=True)
class CommsTotal:
    """One collective in one process group, per step and rank (mean over the recorded steps and the ranks)."""
    group: str
    collective: str
    count: float
    bytes: float
    time_s: float
    algbw_gbps: Optional[float]
    busbw_gbps: Optional[float]


@dataclass(frozen=True)
class RunData:
    root: Path
    config: Optional[dict[str, Any]]
    launches: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    ranks: dict[int, list[dict[str, Any]]]

    def series(self, key: str, within: Optional[str] = None) -> tuple[list[int], list[float]]:
        """The recorded steps where `key` (inside the `within` dict, if given) has a value, and those values."""
        points = [(row["step"], (row.get(within) or {}) if within else row) for row in self.steps]
        pairs = [(step, source[key]) for step, source in points if source.get(key) is not None]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def has(self, key: str, within: Optional[str] = None) -> bool:
        return bool(self.series(key, within)[0])

    def memory_by_rank(self) -> dict[int, dict[str, float]]:
        """Each rank's largest value of each memory category over its recorded steps."""
        result = {}
        for rank, rows in self.ranks.items():
            memories = [row["memory"] for row in rows if row.get("memory")]
            if memories:
                keys = [k for k in (*MEMORY_STATE, *MEMORY_MEASURED) if any(m.get(k) is not None for m in memories)]
                result[rank] = {k: max(m[k] for m in memories if m.get(k) is not None) for k in keys}
        return dict(sorted(result.items()))

    def comms(self) -> list[CommsTotal]:
        """Traffic per (group, collective), largest first: a rank's step, averaged over recorded steps and ranks."""
        per_rank: dict[tuple[str, str], list[list[dict[str, Any]]]] = defaultdict(list)
        for rows in self.ranks.values():
            recorded = [row["comms"] for row in rows if row.get("comms") is not None]
            entries: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
            for step_comms in recorded:
                for entry in step_comms:
                    entries[entry["group"], entry["collective"]].append(entry)
            for key, found in entries.items():
                per_rank[key].append([*found, *([{}] * (len(recorded) - len(found)))])  # steps without it: 0
        totals = [CommsTotal(group, collective, *(_mean_per_step(ranks, k) for k in ("count", "bytes", "time_s")),
                             *(_mean_present(ranks, k) for k in ("algbw_gbps", "busbw_gbps")))
                  for (group, collective), ranks in per_rank.items()]
        return sorted(totals, key=lambda t: -t.bytes)

    def layout_text(self) -> str:
        """describe_layout of the config on the launched cluster shape; the launch record's degrees if the
        config no longer validates (written by another shardwise version)."""
        launch = self.launches[0] if self.launches else {}
        cluster = Cluster(nodes=launch.get("nnodes", 1), devices_per_node=launch.get("nproc_per_node", 1))
        try:
            return describe_layout(*validate(self.config or {}, cluster), cluster)
        except ConfigError as err:
            degrees = launch.get("layout") or {}
            shown = " × ".join(f"{k}={v}" for k, v in degrees.items()) or "unknown"
            return f"layout: {shown} (the config does not validate with this shardwise: {err})"


def _mean_per_step(ranks: list[list[dict[str, Any]]], key: str) -> float:
    return fmean(fmean(entry.get(key) or 0 for entry in steps) for steps in ranks)


def _mean_present(ranks: list[list[dict[str, Any]]], key: str) -> Optional[float]:
    values = [entry[key] for steps in ranks for entry in steps if entry.get(key) is not None]
    return fmean(values) if values else None


def read_run(root: Path) -> RunData:
    """Everything the report shows; a ReportError when the directory holds no metrics at all."""
    root = Path(root)
    if not root.is_dir():
        raise ReportError(f"{root} is not a directory; pass the run directory `shardwise run` printed")
    metrics = root / "metrics"
    global_file = metrics / "global.jsonl"
    rank_files = sorted((int(m.group(1)), path) for path in metrics.glob("rank*.jsonl")
                        if (m := _RANK_FILE.fullmatch(path.name)))
    if not global_file.is_file() and not rank_files:
        raise ReportError(f"{root} has no metrics ({metrics}/global.jsonl, rank<R>.jsonl); {RECORD_HINT}")
    by_step = {row["step"]: row for row in read_jsonl(global_file)} if global_file.is_file() else {}
    launches = [_read_json(p) for p in sorted(root.glob("launch-node*.json"))]
    return RunData(root=root, config=_read_json(root / "config.json"), launches=[d for d in launches if d],
                   steps=[by_step[step] for step in sorted(by_step)],
                   ranks={rank: read_jsonl(path) for rank, path in rank_files})
