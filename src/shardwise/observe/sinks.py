"""Where records go: JSON lines (always, when there is a metrics directory), CSV, TensorBoard, W&B.

Each sink takes one record at a time and writes it through at once, so a run stopped mid-way keeps every
step recorded before it. CSV, TensorBoard and W&B take the global records (rank 0's); nested ones are
flattened to `breakdown/forward_s` and the like.
"""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Any, Optional


def flat(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"breakdown": {"forward_s": 1}}` as `{"breakdown/forward_s": 1}`."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


class JsonLines:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class CsvRows:
    """metrics.csv: one row per global record, the columns of the first (a run's records share their keys)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("w", encoding="utf-8", newline="")
        self.writer: Optional[csv.DictWriter] = None

    def write(self, record: dict[str, Any]) -> None:
        row = flat(record)
        if self.writer is None:
            self.writer = csv.DictWriter(self.file, fieldnames=list(row), extrasaction="ignore")
            self.writer.writeheader()
        self.writer.writerow(row)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in flat(record).items()
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoard:
    """Event files under <metrics dir>/tensorboard, one scalar per numeric metric, by step."""

    def __init__(self, directory: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("metrics_sinks lists tensorboard, which is not installed; fix: pip install "
                              "tensorboard, or drop it from metrics_sinks") from err
        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, global_step=record["step"], walltime=record["time"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WeightsAndBiases:
    """A W&B run in `project` (wandb's own default when None)."""

    def __init__(self, project: Optional[str], directory: Optional[Path], config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=project, dir=str(directory) if directory else None, config=config)

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def global_sinks(names: list[str], directory: Optional[Path], wandb_project: Optional[str],
                 config: dict[str, Any]) -> list[Any]:
    """Rank 0's sinks of the global records: global.jsonl and the chosen ones that can write here."""
    sinks: list[Any] = []
    if directory is not None:
        sinks.append(JsonLines(directory / "global.jsonl"))
        if "csv" in names:
            sinks.append(CsvRows(directory / "metrics.csv"))
        if "tensorboard" in names:
            sinks.append(TensorBoard(directory / "tensorboard"))
    elif {"csv", "tensorboard"} & set(names):
        warnings.warn("metrics_sinks csv/tensorboard write into the metrics directory, and there is none; fix: set "
                      "metrics_dir, or launch with shardwise run", stacklevel=3)
    if "wandb" in names:
        try:
            sinks.append(WeightsAndBiases(wandb_project, directory, config))
        except ImportError:
            warnings.warn("metrics_sinks lists wandb, which is not installed; metrics go to the other sinks; fix: "
                          "pip install wandb", stacklevel=3)
    return sinks
