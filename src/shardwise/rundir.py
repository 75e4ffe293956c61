"""The run directory: one place per launch for the config, the launch record and per-rank logs.

    runs/<YYYYmmdd-HHMMSS>-<script stem>/
        config.json              validated config every rank loads (SHARDWISE_CONFIG), the keys given only
        launch-node<K>.json      how node K launched: command, shape, rendezvous
        logs/rank<R>/stdout.log  rank R's stdout (global rank, so nodes sharing a disk never collide)
        logs/rank<R>/stderr.log  rank R's stderr
        logs/rank<R>/error.json  structured error, when the script uses torch's @record
        logs/rank<R>/preempted.json  the checkpoint the rank saved on SIGTERM (checkpoint_dir)
        logs/agent-node<K>.log   warnings of torch's elastic agent on node K
        logs/attempt<N>/…        the same per-rank files for restart N (--max-restarts)

Files are named by global rank so `tail -f runs/…/logs/rank5/stdout.log` works on any node.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, Std

RUN_DIR_ENV = "SHARDWISE_RUN_DIR"
# A rank that saved a checkpoint on SIGTERM writes this record beside its logs and exits with this code
# (EX_TEMPFAIL, "try again later"), which `shardwise run` returns too.
PREEMPTED_RECORD = "preempted.json"
PREEMPTED_EXIT_CODE = 75


def default_run_dir(script: Path, root: Path = Path("runs")) -> Path:
    """`runs/<timestamp>-<script stem>`, with a numeric suffix if that name is taken."""
    base = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{script.stem}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def rank_dir(self, rank: int, attempt: int = 0) -> Path:
        base = self.logs if attempt == 0 else self.logs / f"attempt{attempt}"
        return base / f"rank{rank}"

    def stdout(self, rank: int, attempt: int = 0) -> Path:
        return self.rank_dir(rank, attempt) / "stdout.log"

    def stderr(self, rank: int, attempt: int = 0) -> Path:
        return self.rank_dir(rank, attempt) / "stderr.log"

    def error_file(self, rank: int, attempt: int = 0) -> Path:
        return self.rank_dir(rank, attempt) / "error.json"

    def preempted(self, rank: int, attempt: int = 0) -> Path:
        return self.rank_dir(rank, attempt) / PREEMPTED_RECORD

    def agent_log(self, node_rank: int) -> Path:
        return self.logs / f"agent-node{node_rank}.log"

    def create(self) -> "RunDir":
        self.logs.mkdir(parents=True, exist_ok=True)
        return self

    def write_json(self, path: Path, data: Any) -> None:
        """Write via a temp file and rename: nodes sharing a disk may write the same file."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def write_config(self, config) -> Path:
        """Only the keys the user set: `init` merges them with its own config, and a default written
        here must not look like a choice that conflicts with one made there."""
        self.write_json(self.config, config.model_dump(mode="json", exclude_unset=True))
        return self.config

    def write_launch(self, node_rank: int, record: dict) -> Path:
        path = self.root / f"launch-node{node_rank}.json"
        self.write_json(path, record)
        return path


def rank_log_dir(rank: int) -> Optional[Path]:
    """This rank's log directory in the current attempt, for files a rank writes beside its logs (a hang report,
    a preemption record); None when the process was not started by `shardwise run`."""
    if RUN_DIR_ENV not in os.environ:
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return RunDir(Path(os.environ[RUN_DIR_ENV])).rank_dir(rank, attempt)


class RankLogsSpecs(LogsSpecs):
    """torchrun's log redirection with shardwise's layout: every rank's stdout and stderr go to
    `logs/rank<R>/`, and the ranks in `console_local_ranks` are also echoed (tee) to the console."""

    def __init__(self, run_dir: RunDir, console_local_ranks: Optional[set[int]] = None) -> None:
        tee = {lr: Std.ALL for lr in (console_local_ranks or ())}
        super().__init__(log_dir=str(run_dir.logs), redirects=Std.ALL, tee=tee)
        self.run_dir = run_dir
        self.console_local_ranks = set(console_local_ranks or ())
        self.attempts = 0  # attempts started so far: 1 + the restarts (--max-restarts)

    @property
    def root_log_dir(self) -> str:
        return str(self.run_dir.logs)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        for local_rank, env in envs.items():
            rank = int(env.get("RANK", local_rank))
            attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
            self.attempts = max(self.attempts, attempt + 1)
            folder = self.run_dir.rank_dir(rank, attempt)
            if folder.exists():  # a reused --run-dir: never report a stale error file
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            dest.stdouts[local_rank] = str(self.run_dir.stdout(rank, attempt))
            dest.stderrs[local_rank] = str(self.run_dir.stderr(rank, attempt))
            dest.error_files[local_rank] = str(self.run_dir.error_file(rank, attempt))
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
            if local_rank in self.console_local_ranks:
                dest.tee_stdouts[local_rank] = dest.stdouts[local_rank]
                dest.tee_stderrs[local_rank] = dest.stderrs[local_rank]
        base = self.run_dir.logs
        dest.filtered_stdout = str(base / "filtered_stdout.log")
        dest.filtered_stderr = str(base / "filtered_stderr.log")
        return dest
