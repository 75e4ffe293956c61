"""Turn torch's `ChildFailedError` into what a user needs: which rank failed first, its exit
code, and the last lines of that rank's own log — not the launcher's stack trace."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from ..rundir import RunDir
from .spec import LaunchSpec

TAIL_LINES = 20


@dataclass(frozen=True)
class RankFailure:
    rank: int
    local_rank: int
    exitcode: int
    log: Path
    tail: list[str]

    @property
    def signal_name(self) -> Optional[str]:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def shell_exit_code(self) -> int:
        """What a shell reports for this death: the code itself, or 128 + signal number."""
        return 128 + (-self.exitcode) if self.exitcode < 0 else self.exitcode

    def cause(self) -> str:
        return f"killed by {self.signal_name}" if self.signal_name else f"exit code {self.exitcode}"


def tail(path: Path, lines: int = TAIL_LINES, max_bytes: int = 64 * 1024) -> list[str]:
    """Last `lines` non-empty-trailing lines of a file; reads at most `max_bytes` from its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return text.rstrip("\n").splitlines()[-lines:] if text.strip() else []


def _log_of(run_dir: RunDir, rank: int, attempt: int) -> Path:
    """stderr holds tracebacks; fall back to stdout when a rank wrote nothing there."""
    err = run_dir.stderr(rank, attempt)
    if err.is_file() and err.stat().st_size > 0:
        return err
    return run_dir.stdout(rank, attempt)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")


def rank_failures(failures: Mapping[int, object], run_dir: RunDir, attempt: int = 0,
                  lines: int = TAIL_LINES) -> list[RankFailure]:
    """Failed ranks, first failure first.

    torch stamps a failure in whole seconds when its agent notices it, then SIGTERMs the
    survivors (SIGKILL only after a 30 s grace), so: earliest stamp first; within a second,
    ranks the agent stopped with SIGTERM after the others; then the rank whose log was last
    written earliest — a rank that raised stops writing before the peers that then lose their
    connection to it and raise in turn.
    """
    result = []
    for rank, failure in failures.items():
        log = _log_of(run_dir, rank, attempt)
        stopped = failure.exitcode == -signal.SIGTERM
        result.append((failure.timestamp, stopped, _mtime(log), rank,
                       RankFailure(rank, failure.local_rank, failure.exitcode, log, tail(log, lines))))
    return [item[-1] for item in sorted(result, key=lambda item: item[:4])]


def format_failure(failed: list[RankFailure], spec: LaunchSpec) -> str:
    """The message printed when ranks fail: first failing rank, its log tail, the others in one line."""
    first = failed[0]
    where = f"node {spec.node_rank}, local rank {first.local_rank}"
    lines = [f"shardwise run: rank {first.rank} ({where}) failed first ({first.cause()})"]
    if first.tail:
        count = len(first.tail)
        lines.append(f"last {count} line{'s' if count > 1 else ''} of {first.log}:")
        lines.extend(f"  | {line}" for line in first.tail)
    else:
        lines.append(f"rank {first.rank} wrote nothing to {first.log}")
    if len(failed) > 1:
        others = ", ".join(f"rank {f.rank} ({f.cause()})" for f in failed[1:])
        lines.append(f"also failed: {others}")
    lines.append(f"all logs: {first.log.parent.parent}")
    return "\n".join(lines)


def preemption_line(run_dir: RunDir, spec: LaunchSpec, attempt: int) -> Optional[str]:
    """The one line for a job whose every rank on this node saved a checkpoint on SIGTERM; None otherwise."""
    records = []
    for local_rank in range(spec.nproc_per_node):
        try:
            records.append(json.loads(run_dir.preempted(spec.global_rank(local_rank), attempt).read_text()))
        except (OSError, ValueError):
            return None
    first = records[0]
    return (f"shardwise run: preempted: every rank saved checkpoint {first['checkpoint']} at step {first['step']}; "
            f"the next launch with the same checkpoint_dir resumes from it")
