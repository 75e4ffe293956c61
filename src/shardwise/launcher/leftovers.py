"""Processes a job leaves behind: what its ranks started (a data-loader worker, a helper server) and that
outlived them. torch's agent stops a rank's whole session, but only while the rank itself runs: the children
of a rank that crashed or exited are left. Every process of a launch carries its id in its environment, so
the launcher finds them all at the end, however they were reparented."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

LAUNCH_ID_ENV = "SHARDWISE_LAUNCH_ID"


def new_launch_id() -> str:
    return uuid.uuid4().hex


def stop_leftovers(launch_id: str) -> list[int]:
    """SIGKILL every other process on this machine whose environment carries `launch_id`; their pids.
    Reads /proc (Linux); elsewhere finds nothing."""
    marker = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    stopped = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):  # gone meanwhile, or another user's
            continue
        stopped.append(pid)
    return stopped
