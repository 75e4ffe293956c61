"""No process of a job outlives it: the ranks and what they started (a data-loader worker, say) are gone
after a rank crashes and after `shardwise run` gets SIGTERM. torch's agent starts each rank in a session of
its own and stops the whole session, so a child of a rank that already died is stopped too.

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


def _left_behind(pids: list[int]) -> list[int]:
    """The pids still running (a zombie waiting for init to reap it has ended)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_crashed_rank_leaves_no_process_behind(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CRASH", "1")
    assert main(_launch_args(tmp_path)) == 1
    err = capsys.readouterr().err
    pids = _job_pids(tmp_path)
    assert len(set(pids)) == 4 and _left_behind(pids) == []
    # The crashed rank's child outlived it (torch stops only running ranks' sessions): the launcher stopped it.
    crashed_child = pids[3]
    assert "rank 1 crashed" in err and f"stopped 1 process(es) the ranks left behind: [{crashed_child}]" in err


def test_sigterm_to_the_launcher_leaves_no_process_behind(tmp_path):
    code = "import sys; from shardwise.cli import main; sys.exit(main())"
    launcher = subprocess.Popen([sys.executable, "-c", code, *_launch_args(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    pids = _job_pids(tmp_path)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert _left_behind(pids) == []
