"""No process of a job outlives it: the ranks and what they started (a data-loader worker, say) are gone
after a rank crashes and after `shardwise run` gets SIGTERM or SIGKILL. torch's agent stops the session of
each rank still running; the launcher stops what a rank that died left (its child), and the launcher's reaper
process stops the job when the launcher itself is SIGKILLed.

The rank scripts do not import torch; each starts a sleeping child and prints both pids.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from shardwise.cli import main

SCRIPT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(os.getpid(), child.pid, flush=True)
if os.environ["RANK"] == "1" and os.environ.get("CRASH"):
    time.sleep(1)
    raise SystemExit("rank 1 crashed")
time.sleep(300)
"""


def _launch_args(tmp_path: Path) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    return ["run", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), str(script)]


def _job_pids(tmp_path: Path) -> list[int]:
    """The ranks' and their children's pids, once every rank has printed them."""
    logs = [tmp_path / f"run/logs/rank{rank}/stdout.log" for rank in range(2)]
    while not all(log.is_file() and log.read_text().strip() for log in logs):
        time.sleep(0.1)
    return [int(pid) for log in logs for pid in log.read_text().split()]


def _running(pids: list[int]) -> list[psutil.Process]:
    """The processes still running (a zombie waiting for init to reap it has ended)."""
    running = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


def _left_behind(pids: list[int]) -> list[int]:
    """The pids still running once those signalled have had time to end."""
    psutil.wait_procs(_running(pids), timeout=30)
    return [process.pid for process in _running(pids)]


def test_a_crashed_rank_leaves_no_process_behind(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CRASH", "1")
    assert main(_launch_args(tmp_path)) == 1
    err = capsys.readouterr().err
    pids = _job_pids(tmp_path)
    assert len(set(pids)) == 4 and _left_behind(pids) == []
    # The crashed rank's child outlived it (torch stops only running ranks' sessions): the launcher stopped it.
    crashed_child = pids[3]
    assert "rank 1 crashed" in err and f"stopped 1 process(es) the ranks left behind: [{crashed_child}]" in err


def _launcher(tmp_path: Path) -> subprocess.Popen:
    code = "import sys; from shardwise.cli import main; sys.exit(main())"
    return subprocess.Popen([sys.executable, "-c", code, *_launch_args(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_sigterm_to_the_launcher_leaves_no_process_behind(tmp_path):
    launcher = _launcher(tmp_path)
    pids = _job_pids(tmp_path)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert _left_behind(pids) == []


def test_a_launcher_killed_with_sigkill_leaves_no_process_behind(tmp_path):
    """torch's agent dies with the launcher; the launcher's reaper stops the ranks and their children."""
    launcher = _launcher(tmp_path)
    pids = _job_pids(tmp_path)
    launcher.kill()
    launcher.communicate(timeout=60)
    assert _left_behind(pids) == []
