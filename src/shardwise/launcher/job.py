"""`shardwise.Job`: the SageMaker estimator's `PyTorch(entry_point=..., distribution=...).fit()` as a Python call.

    result = shardwise.Job(entry_point="train.py", nproc_per_node=4, config={"sharded_data_parallel_degree": 2},
                           hyperparameters={"steps": 20}).fit()
    result.exit_code, result.run_dir, result.metrics

`fit()` is `shardwise run` on this node (the same flags, validation, run directory
and SLURM/PyTorchJob detection): run it on every node of a multi-node job, as
`shardwise run` is. It blocks until this node's ranks end.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..observe.report_data import read_jsonl


@dataclass(frozen=True)
class JobResult:
    """How the job ended: the run directory, the exit code `shardwise run` would exit with, and the last line of
    <run dir>/metrics/global.jsonl (None when the run wrote none)."""

    run_dir: Path
    exit_code: int
    metrics: Optional[dict[str, Any]]


def _last_metrics(run_dir: Path) -> Optional[dict[str, Any]]:
    path = run_dir / "metrics" / "global.jsonl"
    rows = read_jsonl(path) if path.is_file() else []  # as the report reads it: a last line cut short is skipped
    return rows[-1] if rows else None


@dataclass
class Job:
    """One training job: the script, the cluster shape and the config (a dict, a SageMaker `distribution`
    dict, a DeepSpeed config, or a file path). `hyperparameters` become `--key value` script arguments, as
    SageMaker passes them; `script_args` follow as they are. Unset shape fields are `shardwise run`'s defaults."""

    entry_point: str
    nproc_per_node: Optional[int] = None
    nnodes: Optional[int] = None
    config: Any = None
    hostfile: Optional[str] = None
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    run_dir: Optional[str] = None
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    script_args: Sequence[str] = ()
    console_ranks: Optional[str] = None
    max_restarts: int = 0

    def _arguments(self) -> list[str]:
        args = [str(a) for key, value in self.hyperparameters.items() for a in (f"--{key}", value)]
        return [*args, *self.script_args]

    def fit(self) -> JobResult:
        """Launch this node's ranks and wait for them; a bad config or shape is a ConfigError or exit code 2, as
        with `shardwise run`."""
        from .from_args import launch_from_args
        from ..rundir import default_run_dir

        run_dir = Path(self.run_dir or default_run_dir(Path(self.entry_point)))
        with tempfile.TemporaryDirectory() as scratch:
            config = self.config
            if isinstance(config, Mapping):  # the CLI reads files; a dict goes through one, as `--config`
                config = os.path.join(scratch, "config.json")
                Path(config).write_text(json.dumps(dict(self.config)), encoding="utf-8")
            args = argparse.Namespace(
                command="Job.fit", config=config, nproc_per_node=self.nproc_per_node, nnodes=self.nnodes,
                node_rank=self.node_rank, master_addr=self.master_addr, master_port=self.master_port,
                hostfile=self.hostfile, run_dir=str(run_dir), console_ranks=self.console_ranks,
                max_restarts=self.max_restarts)
            code = launch_from_args(args, self.entry_point, self._arguments(), [])
        return JobResult(run_dir=run_dir, exit_code=code, metrics=_last_metrics(run_dir))
