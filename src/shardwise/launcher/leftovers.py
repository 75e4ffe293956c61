"""Processes a job leaves behind: what its ranks started (a data-loader worker, a helper server) and that
outlived them, or the whole job when the launcher itself is killed.

torch's agent stops a rank's whole session, but only while the rank itself runs: the children of a rank that
crashed or exited are left, and a launcher killed with SIGKILL stops nothing. Every process of a launch carries
the launch's id in its environment, so the launcher finds them all at its end, however they were reparented; a
reaper process of its own (this file run as a script, standard library only) does the same if the launcher dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

LAUNCH_ID_ENV = "SHARDWISE_LAUNCH_ID"
POLL_SECONDS = 0.5


def new_launch_id() -> str:
    return uuid.uuid4().hex


def carrying(launch_id: str) -> list[int]:
    """The other processes on this machine whose environment carries `launch_id` (Linux's /proc; elsewhere none)."""
    marker = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(entry.name) != os.getpid() and marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile, or another user's
            continue
    return found


def stop_leftovers(launch_id: str, signum: int = signal.SIGKILL) -> list[int]:
    """Send `signum` to every process carrying `launch_id`; their pids."""
    stopped = []
    for pid in carrying(launch_id):
        try:
            os.kill(pid, signum)
        except OSError:
            continue
        stopped.append(pid)
    return stopped


def start_reaper(launch_id: str, grace_seconds: float) -> subprocess.Popen:
    """A process in a session of its own that stops the job if this launcher dies without doing so."""
    env = {key: value for key, value in os.environ.items() if key != LAUNCH_ID_ENV}
    return subprocess.Popen([sys.executable, __file__, str(os.getpid()), launch_id, str(grace_seconds)], env=env,
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _reap_when_orphaned(launcher_pid: int, launch_id: str, grace_seconds: float) -> None:
    """Once the launcher is gone (this process is reparented), stop its job as torch's agent would have:
    SIGTERM (a rank with checkpoint_dir saves), SIGKILL after the grace period."""
    while os.getppid() == launcher_pid:
        time.sleep(POLL_SECONDS)
    if stop_leftovers(launch_id, signal.SIGTERM):
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and carrying(launch_id):
            time.sleep(POLL_SECONDS)
        stop_leftovers(launch_id)


if __name__ == "__main__":
    _reap_when_orphaned(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
