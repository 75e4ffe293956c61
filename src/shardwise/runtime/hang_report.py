"""When a collective times out: every rank reports what it was doing, and the ranks that never joined are named.

torch's own timeout error names no collective and no culprit. So every rank keeps torch's flight recorder on
(its recent collectives with their groups, sequence numbers and Python stacks, on gloo as on NCCL) and runs a
thread that waits for a hang to be posted in the launcher's store. A rank whose collective times out posts it;
every live rank then writes its recorder to its log directory and posts how far it got in each group; the rank
that timed out names the ranks whose sequence number in that group is below the one it waited at.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from ..rundir import rank_log_dir
from ..torch_internals import flight_recorder_trace, process_groups, set_group_timeout
from . import state
from .launcher_store import attempt_key, connect, wait_for

RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
RECORDER_SIZE = 64  # collectives each rank remembers
RECENT = 8  # collectives each report lists
ANSWER_SECONDS = 10.0  # how long the rank that timed out waits for the others to say how far they got


def enable_flight_recorder() -> None:
    """Turn torch's flight recorder on (it reads the variable when the first process group is made)."""
    os.environ.setdefault(RECORDER_ENV, str(RECORDER_SIZE))


def apply_timeout(seconds: float) -> None:
    """Give every process group of this process (the world's and the mesh's) the same collective timeout."""
    for group, _, _ in process_groups().values():
        set_group_timeout(group, timedelta(seconds=seconds))


def group_timeout() -> Optional[timedelta]:
    """The timeout for a group made after `init` (`new_group`'s default is torch's 30 minutes); None before
    `init`, which sets the world's and the mesh's groups itself."""
    if not state.is_initialized():
        return None
    return timedelta(seconds=state.current().config.collective_timeout_seconds)


def _key(name: str) -> str:
    return attempt_key(f"hang/{name}")


def _store() -> Optional[dist.TCPStore]:
    return connect(timedelta(seconds=ANSWER_SECONDS))


def _describe(entry: dict[str, Any]) -> dict[str, Any]:
    """A flight-recorder entry as the report shows it: the collective, its group and number, its Python stack."""
    frames = [f"{frame['filename']}:{frame['line']} in {frame['name']}" for frame in entry.get("frames", [])]
    return {"collective": entry["profiling_name"], "group": entry["process_group"][0],
            "group_desc": entry["process_group"][1], "sequence": entry["collective_seq_id"],
            "sizes": entry.get("input_sizes"), "stack": frames}


def _snapshot(rank: int) -> dict[str, Any]:
    """How far this rank got in each group, and its recent collectives with their stacks."""
    trace = flight_recorder_trace()
    positions = {name: status["last_enqueued_collective"] for name, status in trace.get("pg_status", {}).items()}
    recent = [_describe(entry) for entry in trace.get("entries", [])[-RECENT:]]
    return {"rank": rank, "positions": positions, "recent": recent}


def _write(rank: int, report: dict[str, Any]) -> Optional[Path]:
    """Write the report beside the rank's logs (`shardwise run`); None when there is no run directory."""
    folder = rank_log_dir(rank)
    if folder is None:
        return None
    path = folder / "hang.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return path


class HangWatch:
    """Answers a hang another rank posts (a thread), and reports this rank's own: a timed-out collective that
    ends the script prints, after torch's traceback, the one-line error `report` gives."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds
        self._previous_hook = sys.excepthook
        sys.excepthook = self._hook
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="shardwise-hang-watch").start()

    def stop(self) -> None:
        self._stopped.set()
        if sys.excepthook == self._hook:
            sys.excepthook = self._previous_hook

    def _hook(self, kind, error, traceback) -> None:
        self._previous_hook(kind, error, traceback)
        if is_collective_timeout(error):
            print(f"shardwise.CollectiveTimeout: {report(self.rank, self.seconds)}", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        try:
            store = _store()
            if store is not None and wait_for(store, _key("hung"), self._stopped):
                self._answer(store, json.loads(store.get(_key("hung"))))
        except RuntimeError:  # torch's DistError included
            return  # the store is gone: the job is ending anyway

    def _answer(self, store: dist.TCPStore, hung: dict[str, Any]) -> None:
        snapshot = _snapshot(self.rank)
        store.set(_key(f"rank{self.rank}"), json.dumps(snapshot["positions"]))
        if hung["rank"] == self.rank:
            return
        path = _write(self.rank, {"hung_on_rank": hung, **snapshot})
        where = snapshot["positions"].get(hung["group"], 0)
        print(f"shardwise: rank {hung['rank']} timed out in {_name(hung)}; this rank's last collective in that "
              f"group: #{where}; report: {path}", file=sys.stderr, flush=True)


_watch: Optional[HangWatch] = None


def start(rank: int, seconds: float) -> None:
    """Watch for hangs in this process until `stop` (called by init and shutdown)."""
    global _watch
    stop()
    _watch = HangWatch(rank, seconds)


def stop() -> None:
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None


def _name(hung: dict[str, Any]) -> str:
    desc = f" ({hung['group_desc']})" if hung["group_desc"] not in ("", "undefined") else ""
    return f"collective {hung['collective']} #{hung['sequence']} of process group {hung['group']}{desc}"


def is_collective_timeout(error: Optional[BaseException]) -> bool:
    """A collective that timed out, as gloo (`Timed out waiting`) and NCCL's watchdog (`timeout`) word it
    (a store's timeout, at rendezvous say, and gloo's `timed out connecting` a new group are none)."""
    while error is not None:
        text = str(error).lower()
        collective = isinstance(error, RuntimeError) and not isinstance(error, dist.DistStoreError)
        if collective and ("timed out" in text or "timeout" in text) and "timed out connecting" not in text:
            return True
        error = error.__cause__ or error.__context__
    return False


def _waited_in(rank: int, trace: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The newest collective this thread entered: the one it timed out in."""
    entries = trace.get("entries", [])
    mine = [e for e in entries if e.get("thread_id") == str(threading.get_ident())] or entries
    return {**_describe(mine[-1]), "rank": rank} if mine else None


def _positions_of(hung: dict[str, Any], ranks: list[int]) -> Optional[dict[int, dict[str, int]]]:
    """Post the hang; how far each rank that answers within ANSWER_SECONDS got in each group (None: no store)."""
    try:
        store = _store()
        if store is None:
            return None
        store.set(_key("hung"), json.dumps(hung))
        deadline, answers = time.monotonic() + ANSWER_SECONDS, {}
        while time.monotonic() < deadline and len(answers) < len(ranks):
            for rank in ranks:
                if rank not in answers and store.check([_key(f"rank{rank}")]):
                    answers[rank] = json.loads(store.get(_key(f"rank{rank}")))
            time.sleep(0.1)
        return answers
    except RuntimeError:  # torch's DistError included
        return None  # the launcher's store is gone too


def _verdict(hung: dict[str, Any], others: list[int], answers: Optional[dict[int, dict[str, int]]]) -> tuple[
        dict[int, int], list[int], str]:
    """Who never joined (with their last sequence number in the group), who did not answer, and both in words."""
    if answers is None:
        return {}, others, "the other ranks could not be asked (no launcher store: start the job with shardwise run)"
    reached = {r: answers[r].get(hung["group"], 0) for r in others if r in answers}
    behind = {r: n for r, n in reached.items() if n < hung["sequence"]}
    silent = [r for r in others if r not in answers]
    words = [f"rank {r} never joined it (its last in that group: #{n})" for r, n in behind.items()]
    words += [f"ranks {silent} did not answer (dead, or stuck outside Python)"] if silent else []
    return behind, silent, "; ".join(words) or "every rank of the group reached it"


def report(rank: int, seconds: float) -> str:
    """After this rank's collective timed out: post it, gather the others' positions, write the report;
    returns the one-line error naming the collective, its group and sequence number and who never joined."""
    snapshot = _snapshot(rank)
    hung = _waited_in(rank, flight_recorder_trace())
    if hung is None:
        return (f"a collective timed out after {seconds:g} s on rank {rank} (the flight recorder is off: start the "
                f"process group through shardwise.init to name it)")
    members = process_groups().get(hung["group"], (None, "", list(range(dist.get_world_size()))))[2]
    others = [r for r in members if r != rank]
    behind, silent, words = _verdict(hung, others, _positions_of(hung, others))
    path = _write(rank, {"hung_on_rank": hung, "never_joined": behind, "did_not_answer": silent, **snapshot})
    where = f"; report: {path}" if path else ""
    return f"{_name(hung)} timed out after {seconds:g} s on rank {rank}; {words}{where}"
