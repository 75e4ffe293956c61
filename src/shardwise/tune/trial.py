"""One trial: the user's script launched through `shardwise run` with one candidate config, stopped after a few
optimizer steps (runtime/step_limit.py), measured from its run directory, or its failure named.

A trial runs as a child `shardwise run`, so that whatever the script does (crash, run out of memory, hang) ends
that launch and not the tuning run. Failure kinds: `refused` (the config is refused by validation on this
cluster, before any rank starts, or by the runtime at `sw.init`), `out_of_memory` (an allocator's out-of-memory
error, a CPU allocator's "can't allocate memory", or the first rank to fail killed by SIGKILL, as the kernel's OOM
killer does),
`hang` (no end by the trial's deadline: the launch is stopped with SIGTERM, which stops every rank), `crash` (any
other failing exit), `unmeasured` (it ended without recording a step after warm-up: the script takes fewer steps,
or steps no DistributedOptimizer).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..config import ConfigError
from ..config.layout import validate
from ..runtime.step_limit import STOP_AFTER_STEPS_ENV
from ..topology import Cluster
from .measure import Measurement, measure_run

FAILURE_KINDS = ("refused", "out_of_memory", "hang", "crash", "unmeasured")
_OOM_SIGNS = ("OutOfMemoryError", "out of memory", "MemoryError", "can't allocate memory")
# The launcher's line when the first rank to fail was killed with SIGKILL (peers it stops later are not the cause).
_KILLED_FIRST = "failed first (killed by SIGKILL)"
_REFUSED_SIGNS = ("ConfigError",)
_STOP_GRACE_SECONDS = 30
_CLI = "import sys; from shardwise.cli import main; sys.exit(main())"


@dataclass(frozen=True)
class TrialResult:
    run_dir: Path
    exit_code: Optional[int]
    seconds: float
    measurement: Optional[Measurement] = None
    failure: Optional[str] = None      # one of FAILURE_KINDS
    message: Optional[str] = None      # the line that says why

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass(frozen=True)
class NodePlace:
    """Where this node is in a tuning run across `nnodes` nodes (and where node 0 listens)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def leads(self) -> bool:
        return self.node_rank == 0

    def launch_flags(self, port: int) -> list[str]:
        """`shardwise run`'s flags for this node's share of a launch meeting at `port`."""
        return ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--master-addr", self.master_addr,
                "--master-port", str(port)]


def launch_command(script: str, script_args: Sequence[str], config_path: Path, run_dir: Path,
                   nproc: int, nodes: Sequence[str] = ()) -> list[str]:
    """The `shardwise run` a trial is (with the Python running this one, so the same shardwise). One node: the
    launcher's rendezvous takes a free port itself; several: `nodes` are this node's flags (nodes.py)."""
    return [sys.executable, "-c", _CLI, "run", "--nproc-per-node", str(nproc), *nodes, "--config",
            str(config_path), "--run-dir", str(run_dir), "--console-ranks", "none", script, *script_args]


def launch_best(script: str, script_args: Sequence[str], nproc: int, config_path: Path,
                nodes: Sequence[str] = ()) -> int:
    """The real training: `shardwise run` of the script under the best config (no step limit), its output on
    this console; its exit code. `nodes`: this node's share of a launch across nodes."""
    env = {k: v for k, v in os.environ.items() if k != STOP_AFTER_STEPS_ENV}
    command = [sys.executable, "-c", _CLI, "run", "--nproc-per-node", str(nproc), *nodes, "--config",
               str(config_path), script, *script_args]
    return subprocess.run(command, env=env, stdin=subprocess.DEVNULL).returncode


def _rank_logs(run_dir: Path) -> str:
    texts = []
    for path in sorted(run_dir.glob("logs/rank*/stderr.log")):
        try:
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    return "\n".join(texts)


def _last_line(text: str, signs: Sequence[str]) -> Optional[str]:
    """The last line of `text` holding one of `signs`, else its last non-empty line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    marked = [line for line in lines if any(sign in line for sign in signs)]
    return (marked or lines or [None])[-1]


def classify(exit_code: int, launcher_err: str, rank_logs: str) -> tuple[str, Optional[str]]:
    """The failure kind of a launch that exited with `exit_code` != 0, and the line saying why."""
    text = launcher_err + "\n" + rank_logs
    if any(sign in rank_logs for sign in _REFUSED_SIGNS) or (exit_code == 2 and "shardwise run:" in launcher_err
                                                              and not rank_logs):
        return "refused", _last_line(text, (*_REFUSED_SIGNS, "shardwise run:"))
    if any(sign in text for sign in _OOM_SIGNS) or _KILLED_FIRST in launcher_err:
        return "out_of_memory", _last_line(text, (*_OOM_SIGNS, _KILLED_FIRST))
    return "crash", _last_line(text, ("Error", "failed first"))


def _wait(proc: subprocess.Popen, deadline_s: float) -> tuple[Optional[int], str, bool]:
    """Exit code, stderr, and whether the deadline passed (then the launch is stopped: SIGTERM, later SIGKILL)."""
    try:
        _, err = proc.communicate(timeout=deadline_s)
        return proc.returncode, err, False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops every rank, and its reaper what they left
        try:
            _, err = proc.communicate(timeout=_STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        return proc.returncode, err, True


def run_trial(config: dict[str, Any], script: str, script_args: Sequence[str], *, nproc: int, steps: int,
              warmup: int, deadline_s: float, run_dir: Path, place: Optional[NodePlace] = None,
              port: int = 0) -> TrialResult:
    """Launch `script` under `config` on `nproc` local ranks for `steps` optimizer steps; measure it or say why
    not. The trial records every step into its run directory's metrics (metrics_interval 1). Across nodes, this
    launch is the share of the node at `place`, meeting the others at `port` (nodes.py)."""
    start = time.monotonic()
    try:
        validate(config, Cluster(nodes=place.nnodes if place else 1, devices_per_node=nproc))
    except ConfigError as err:
        return TrialResult(run_dir, None, 0.0, failure="refused", message=str(err).splitlines()[0])
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    config_path = run_dir.parent / f"{run_dir.name}.config.json"
    measured = {**config, "metrics_interval": 1, "metrics_dir": str(run_dir.resolve() / "metrics")}
    # written whole, then moved into place: across nodes on a shared file system every node writes this file while
    # another node's launch may be reading it
    partial = config_path.with_name(f"{config_path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(measured, indent=1) + "\n", encoding="utf-8")
    os.replace(partial, config_path)
    env = {**os.environ, STOP_AFTER_STEPS_ENV: str(steps)}
    command = launch_command(script, script_args, config_path, run_dir, nproc,
                             place.launch_flags(port) if place else ())
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    code, err, hung = _wait(proc, deadline_s)
    seconds = time.monotonic() - start
    if hung:
        return TrialResult(run_dir, code, seconds, failure="hang",
                           message=f"no end within the trial deadline of {deadline_s:g} s; the launch was stopped")
    if code != 0:
        kind, line = classify(code, err, _rank_logs(run_dir))
        return TrialResult(run_dir, code, seconds, failure=kind, message=line)
    measurement = measure_run(run_dir, warmup)
    if measurement is None:
        return TrialResult(run_dir, code, seconds, failure="unmeasured",
                           message=f"no optimizer step after the {warmup} warm-up step(s) was recorded; the script "
                                   "must take more steps through a DistributedOptimizer")
    return TrialResult(run_dir, code, seconds, measurement)
