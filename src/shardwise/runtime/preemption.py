"""Preemption: after SIGTERM every rank saves a checkpoint at the same step boundary, then exits 75.

The ranks see the signal at slightly different times, so one may be a step ahead of another when it does.
The signal handler only queues a note; a thread posts the request in the launcher's store, and on every rank
a thread waiting for that key proposes the next step boundary (the end of `optimizer.step()`) that rank has
not passed yet, under the lock the main thread passes boundaries under. The ranks save at the largest
proposal: no rank has passed it, and none passes its own proposal without waiting for everyone's. Until a
signal comes, a boundary costs one uncontended lock; the collective-free agreement goes through the store.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, NoReturn, Optional

import torch.distributed as dist

from ..rundir import PREEMPTED_EXIT_CODE, PREEMPTED_RECORD, rank_log_dir
from .launcher_store import attempt_key, connect, wait_for
from .state import Runtime

_REQUESTED = "preempt/requested"


def _proposal_key(rank: int) -> str:
    return attempt_key(f"preempt/rank{rank}")


class Preemption:
    """One rank's side of the agreement: its boundary count, its proposal, the deadline the grace period sets."""

    def __init__(self, rank: int, world: int, grace_seconds: float):
        self.rank, self.world, self.grace_seconds = rank, world, grace_seconds
        self._lock = threading.Lock()
        self._passed = 0
        self._proposed: Optional[int] = None
        self._agreed: Optional[int] = None
        self._deadline: Optional[float] = None
        self._notes: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe in a signal handler
        self.previous_handler = signal.signal(signal.SIGTERM, self._on_signal)
        threading.Thread(target=self._request, name="shardwise-preemption-request", daemon=True).start()
        threading.Thread(target=self._watch, name="shardwise-preemption-watch").start()

    def _on_signal(self, signum, frame) -> None:
        self._notes.put(time.monotonic())

    def _request(self) -> None:
        """Tell every rank (through the store) once this one got SIGTERM."""
        self._start_clock(self._notes.get())
        try:
            store = connect(timedelta(seconds=self.grace_seconds))
            if store is None:
                self._propose(None)
                return
            store.set(attempt_key(_REQUESTED), str(self.rank))
        except RuntimeError:  # the store is gone: the job is ending anyway
            return

    def _watch(self) -> None:
        try:
            store = connect(timedelta(seconds=self.grace_seconds))
            if store is not None and wait_for(store, attempt_key(_REQUESTED)):
                self._propose(store)
        except RuntimeError:  # torch's DistError included: the store is gone, the job is ending anyway
            return

    def _start_clock(self, signalled: float) -> None:
        with self._lock:
            if self._deadline is None:
                self._deadline = signalled + self.grace_seconds

    def _propose(self, store: Optional[dist.TCPStore]) -> None:
        """Propose the next boundary this rank has not passed (once)."""
        self._start_clock(time.monotonic())
        with self._lock:
            if self._proposed is not None:
                return
            self._proposed = self._passed + 1
        if store is not None:
            store.set(_proposal_key(self.rank), str(self._proposed))

    def boundary(self) -> bool:
        """Pass a step boundary; True at the one the ranks agreed to save at."""
        with self._lock:
            self._passed += 1
            proposed = self._proposed
        if proposed is None:
            return False
        if self._agreed is None:
            self._agreed = self._agree(proposed)
        return self._passed == self._agreed

    def _agree(self, proposed: int) -> int:
        """The largest proposal of all ranks; stops this rank (without saving) when they do not all propose
        within the grace period."""
        store = connect(timedelta(seconds=max(self._remaining(), 0.1)))
        if store is None or self.world == 1:
            return proposed
        keys = [_proposal_key(rank) for rank in range(self.world)]
        try:
            store.wait(keys)
            return max(int(store.get(key)) for key in keys)
        except RuntimeError:  # torch's DistError included
            silent = [rank for rank, key in enumerate(keys) if not store.check([key])]
            self.stop(f"ranks {silent} did not agree on a step within preemption_grace_seconds="
                      f"{self.grace_seconds:g}")

    def _remaining(self) -> float:
        return (self._deadline or time.monotonic()) - time.monotonic()

    def late(self) -> bool:
        return self._remaining() <= 0

    def stop(self, why: str) -> NoReturn:
        print(f"shardwise: preempted (SIGTERM) on rank {self.rank}, but {why}; stopping without a checkpoint",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM)


_watching: Optional[tuple[Runtime, Preemption]] = None


def _for(runtime: Runtime) -> Preemption:
    """This runtime's watch, made at its first boundary (a signal before it stops the rank as usual)."""
    global _watching
    if _watching is None or _watching[0] is not runtime:
        if _watching is not None:
            signal.signal(signal.SIGTERM, _watching[1].previous_handler)
        _watching = (runtime, Preemption(runtime.rank, dist.get_world_size(),
                                         runtime.config.preemption_grace_seconds))
    return _watching[1]


def at_step_boundary(runtime: Runtime, step: int, save: Callable[[str, str], None]) -> None:
    """Called by every rank at the end of each optimizer step. With `checkpoint_dir` set, at the boundary the
    ranks agreed on after a SIGTERM: `save(checkpoint_dir, tag)`, record it beside the rank's logs, exit 75."""
    directory = runtime.config.checkpoint_dir
    if directory is None:
        return
    watch = _for(runtime)
    if not watch.boundary():
        return
    if watch.late():
        watch.stop(f"step {step} came after preemption_grace_seconds={watch.grace_seconds:g}")
    tag = f"preempted-step{step}"
    save(directory, tag)
    folder = rank_log_dir(runtime.rank)
    if folder is not None:
        record = {"checkpoint": f"{directory}/{tag}", "step": step}
        (folder / PREEMPTED_RECORD).write_text(json.dumps(record) + "\n", encoding="utf-8")
    print(f"shardwise: preempted (SIGTERM): saved checkpoint {directory}/{tag} at step {step}; exiting with "
          f"{PREEMPTED_EXIT_CODE}", file=sys.stderr, flush=True)
    raise SystemExit(PREEMPTED_EXIT_CODE)
