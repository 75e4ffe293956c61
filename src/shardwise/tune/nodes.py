"""Tuning across nodes. Every node runs the same `shardwise tune` command, as every node runs the same `shardwise
run`: node 0 plans, decides each trial and keeps the results; each other node launches its share of every trial
node 0 announces and reports what its ranks did. They talk through torch's TCPStore (the key-value store a static
rendezvous uses) at --master-addr:--master-port; each trial's launch meets at a port node 0 picks free.

Node 0 names a trial's outcome from every node's: the most telling failure wins (a rank that was refused or ran
out of memory, over the peers that then lost it; another node's message starts with its number), and the peak
memory is every rank's, wherever it ran. On a file system the nodes share, node 0 reads every rank's log itself.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

from .measure import Measurement, peak_memory
from .results import write_best_config
from .trial import NodePlace, TrialResult, launch_best, run_trial
from .tuner import TrialRunner, TuneSettings

# A node that has not answered this long after a trial's deadline (its launch stopped by then) is gone: stopped,
# or cut off.
REPORT_GRACE_SECONDS = 120.0
# How long a node waits for node 0's store (node 0 plans first) and, at the end, node 0 for the others to go.
CONNECT_SECONDS = 600.0
GOODBYE_SECONDS = 60.0
# Failure kinds from the most telling to the least: a rank's own refusal or out-of-memory explains the crash and
# the hang its peers then show; `unmeasured` is a node whose ranks recorded nothing (node 0 measures).
_PRECEDENCE = ("refused", "out_of_memory", "crash", "hang", "unmeasured")


def free_port() -> int:
    """A TCP port free on this host (node 0's, where every launch's rendezvous listens)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _wait_for_listener(addr: str, port: int, timeout_s: float, node_rank: int) -> None:
    """Until node 0 listens at addr:port (it may start later), or a ConnectionError after `timeout_s`: probed with
    plain connections, so a node started first waits quietly (torch's store client logs every retry with a stack
    trace)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=min(5.0, timeout_s)).close()
            return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"node {node_rank}: no tuning node 0 at {addr}:{port} within {timeout_s:g} s "
                                      f"({err.strerror or err}); start the same command there with --node-rank 0") \
                    from None
            time.sleep(1.0)


class NodeChannel:
    """Messages from node 0 to all (numbered, read in order) and each node's report of each trial."""

    def __init__(self, place: NodePlace, connect_s: float = CONNECT_SECONDS):
        from torch.distributed import TCPStore  # torch only when tuning across nodes

        self.place = place
        where = f"{place.master_addr}:{place.master_port}"
        if not place.leads:
            _wait_for_listener(place.master_addr, place.master_port, connect_s, place.node_rank)
        try:
            self.store = TCPStore(place.master_addr, place.master_port, is_master=place.leads,
                                  wait_for_workers=False, timeout=timedelta(seconds=connect_s))
        except (RuntimeError, OSError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConnectionError(f"node {place.node_rank}: " + (
                f"cannot listen at {where} ({first}); pass another --master-port" if place.leads else
                f"cannot join node 0's store at {where} ({first})")) from None
        self._sent = self._read = 0
        self.lost: list[int] = []  # nodes silent past the grace after the last trial
        self.trained = False       # node 0 has sent every node to train with the best config

    def _wait(self, key: str, timeout_s: float) -> Optional[dict[str, Any]]:
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError:  # torch says a wait timed out, or the store went away, by RuntimeError
            return None
        return json.loads(self.store.get(key))

    def announce(self, message: dict[str, Any]) -> None:
        self.store.set(f"message{self._sent}", json.dumps(message))
        self._sent += 1

    def next_message(self, timeout_s: float) -> Optional[dict[str, Any]]:
        message = self._wait(f"message{self._read}", timeout_s)
        if message is not None:
            self._read += 1
        return message

    def train(self, config: dict[str, Any], script_args: Sequence[str], port: int) -> None:
        """Send every node to train with `config` and the script's `script_args`, meeting at `port`; back once each
        has read it."""
        self.announce({"kind": "train", "config": config, "script_args": list(script_args), "port": port})
        self.trained = True
        self.wait_goodbyes()

    def halted(self) -> Optional[str]:
        """Why the tuning run cannot go on (a node stopped answering: the next launch would wait for it)."""
        return f"node {self.lost[0]} stopped answering; no further trial can launch" if self.lost else None

    def report(self, trial: str, outcome: dict[str, Any]) -> None:
        self.store.set(f"{trial}/node{self.place.node_rank}", json.dumps(outcome))

    def reports(self, trial: str, timeout_s: float) -> dict[int, Optional[dict[str, Any]]]:
        """Each other node's report of `trial` (None for one silent past the deadline)."""
        deadline = time.monotonic() + timeout_s
        return {node: self._wait(f"{trial}/node{node}", max(deadline - time.monotonic(), 1.0))
                for node in range(1, self.place.nnodes)}

    def goodbye(self) -> None:
        self.store.set(f"gone/node{self.place.node_rank}", "1")

    def wait_goodbyes(self, timeout_s: float = GOODBYE_SECONDS) -> None:
        """Node 0 keeps its store up until every node has read the last message (or the time is up)."""
        deadline = time.monotonic() + timeout_s
        for node in range(1, self.place.nnodes):
            self._wait(f"gone/node{node}", max(deadline - time.monotonic(), 1.0))


def outcome(result: TrialResult) -> dict[str, Any]:
    """What a node reports of its share of a trial: how it ended and its ranks' peak memory (node 0 times the
    steps, so a node whose ranks record no step time is not `unmeasured`)."""
    return {"exit_code": result.exit_code, "seconds": result.seconds, "failure": result.failure,
            "message": result.message,
            "peak_memory_bytes": {str(r): b for r, b in peak_memory(result.run_dir).items()}}


def merge(local: TrialResult, reports: dict[int, Optional[dict[str, Any]]]) -> TrialResult:
    """The trial as node 0 names it from its own share and the other nodes' reports."""
    failures = [] if local.failure is None else [(local.failure, local.message)]
    peaks = dict(local.measurement.peak_memory_bytes) if local.measurement else {}
    for node, report in reports.items():
        if report is None:
            failures.append(("crash", f"node {node} sent no report by {REPORT_GRACE_SECONDS:g} s after the trial's "
                                      "deadline; it stopped, or lost its way to node 0"))
            continue
        peaks.update({int(r): int(b) for r, b in report["peak_memory_bytes"].items()})
        if report["failure"] not in (None, "unmeasured"):  # node 0 times the steps
            failures.append((report["failure"], f"node {node}: {report['message']}"))
    if failures:
        kind, message = min(failures, key=lambda f: _PRECEDENCE.index(f[0]))
        return TrialResult(local.run_dir, local.exit_code, local.seconds, failure=kind, message=message)
    if local.measurement is None:
        return local
    m = local.measurement
    whole = Measurement(m.steps, m.measured_steps, m.step_time_s, m.samples_per_s, m.tokens_per_s, dict(sorted(
        peaks.items())))
    return TrialResult(local.run_dir, local.exit_code, local.seconds, whole)


# How far a shared file system's clock may be behind this node's, when telling an earlier run's files from node 0's.
CLOCK_SKEW_SECONDS = 60.0


def clear_stale(run_dir: Path, since: float) -> None:
    """Remove a trial directory (and its config) an earlier tuning run left on this node: written before this
    node's run started. Node 0 clears its own at the start; on a shared file system what is newer is node 0's."""
    for path in (run_dir, run_dir.parent / f"{run_dir.name}.config.json"):
        if path.exists() and path.stat().st_mtime < since - CLOCK_SKEW_SECONDS:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def across_nodes(channel: NodeChannel, settings: TuneSettings) -> TrialRunner:
    """Node 0's trials: each announced to every node, launched on this node's ranks as its share, named from
    every node's report. A node silent past the grace leaves that trial a crash and `channel.lost` naming it (the
    next launch would wait for it: the tuning run stops)."""
    place = channel.place

    def run(config: dict[str, Any], run_dir: Path, script_args: Sequence[str]) -> TrialResult:
        port = free_port()
        channel.announce({"kind": "trial", "config": config, "port": port, "run_dir": run_dir.name,
                          "script_args": list(script_args)})
        local = run_trial(config, settings.script, script_args, nproc=settings.nproc, steps=settings.steps,
                          warmup=settings.warmup, deadline_s=settings.trial_deadline_s, run_dir=run_dir,
                          place=place, port=port)
        # another node's share may run on to the deadline after this one failed (its ranks waiting for these)
        reports = channel.reports(run_dir.name, max(settings.trial_deadline_s - local.seconds, 0.0)
                                  + REPORT_GRACE_SECONDS)
        channel.lost = [node for node, report in reports.items() if report is None]
        return merge(local, reports)

    return run


def follow(channel: NodeChannel, settings: TuneSettings, since: float) -> int:
    """A node other than 0: launch its share of each trial node 0 announces and report it, until node 0 says the
    run is over (its exit code) or to train with the best config (that launch's exit code)."""
    place = channel.place
    runs = settings.runs or settings.results
    patience = settings.trial_deadline_s + CONNECT_SECONDS  # node 0 runs its own share, then hears every node
    while True:
        message = channel.next_message(patience)
        if message is None:
            print(f"shardwise tune: node {place.node_rank}: no word from node 0 within {patience:g} s (it stopped, or "
                  "cannot be reached); stopping", file=sys.stderr)
            return 1
        if message["kind"] == "trial":
            run_dir = runs / message["run_dir"]
            clear_stale(run_dir, since)
            result = run_trial(message["config"], settings.script, message["script_args"], nproc=settings.nproc,
                               steps=settings.steps, warmup=settings.warmup, deadline_s=settings.trial_deadline_s,
                               run_dir=run_dir, place=place, port=message["port"])
            channel.report(message["run_dir"], outcome(result))
            print(f"shardwise tune: node {place.node_rank}: {message['run_dir']}: "
                  f"{'ran' if result.failure in (None, 'unmeasured') else result.failure}", flush=True)
            continue
        channel.goodbye()
        if message["kind"] == "train":
            path = write_best_config(settings.results, message["config"])
            return launch_best(settings.script, message["script_args"], settings.nproc, path,
                               place.launch_flags(message["port"]))
        print(f"shardwise tune: node {place.node_rank}: node 0 ended the run: {message['reason']}", flush=True)
        return message["code"]
