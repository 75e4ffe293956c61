"""What a trial measured, read from its run directory as `shardwise report` reads it (observe/report_data.py):
the step time of the steps after warm-up (the recorder's own step timing), throughput, and each rank's peak memory
(the device allocator's peak, or on a device whose memory is the host's, the process's resident set)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Optional

from ..observe.report_data import ReportError, read_run


@dataclass(frozen=True)
class Measurement:
    steps: int                          # optimizer steps recorded
    measured_steps: int                 # of them, after warm-up
    step_time_s: float                  # median over the measured steps
    samples_per_s: Optional[float]
    tokens_per_s: Optional[float]
    peak_memory_bytes: dict[int, int]   # per rank

    @property
    def max_memory_bytes(self) -> Optional[int]:
        return max(self.peak_memory_bytes.values()) if self.peak_memory_bytes else None


def _median(values: list) -> Optional[float]:
    present = [v for v in values if v is not None]
    return median(present) if present else None


def _peaks(data) -> dict[int, int]:
    memory = {}
    for rank, peaks in data.memory_by_rank().items():
        peak = peaks.get("device_peak_bytes") or peaks.get("host_rss_bytes")
        if peak is not None:
            memory[rank] = int(peak)
    return memory


def peak_memory(run_dir: Path) -> dict[int, int]:
    """Each rank's peak memory recorded in the run directory (none when it has no metrics)."""
    try:
        return _peaks(read_run(run_dir))
    except ReportError:
        return {}


def measure_run(run_dir: Path, warmup: int) -> Optional[Measurement]:
    """The trial's measurement, None when the run recorded no step past `warmup`."""
    try:
        data = read_run(run_dir)
    except ReportError:
        return None
    measured = [row for row in data.steps if row["step"] > warmup and row.get("step_time_s") is not None]
    if not measured:
        return None
    return Measurement(steps=len(data.steps), measured_steps=len(measured),
                       step_time_s=median(row["step_time_s"] for row in measured),
                       samples_per_s=_median([row.get("samples_per_s") for row in measured]),
                       tokens_per_s=_median([row.get("tokens_per_s") for row in measured]),
                       peak_memory_bytes=_peaks(data))
