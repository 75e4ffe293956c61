"""A pool of worker processes for one world size, kept alive across calls.

Worker i always runs rank i. Each worker talks to the parent over its own pipe;
the parent holds only its own ends, so a worker's death shows up as EOF and
the parent's death as EOF (or a parent that is gone) in every worker.

Workers are forked from a server process that imported torch.distributed and the
modules given to `preload` once (multiprocessing's "forkserver"), so a new pool
starts in a fraction of a second instead of paying every import in every worker;
where there is no forkserver, they are spawned.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
from multiprocessing.connection import wait

from . import _worker

STARTUP_TIMEOUT = 120.0  # seconds for `size` fresh processes to import torch on a busy machine
_PRELOAD = ["torch.distributed", "shardwise.runtime.init"]   # what every call needs
_started = False


def preload(*modules: str) -> None:
    """Import `modules` once in the process the workers are forked from, so that no call pays for them (a test
    suite's model libraries, say). Only before the first pool starts; a module that cannot be imported is skipped.
    Where workers are spawned (no forkserver), each imports what it uses itself."""
    if _started:
        raise RuntimeError("shardwise.testing.preload() must be called before the first run_distributed call")
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _context() -> multiprocessing.context.BaseContext:
    global _started
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    if not _started:
        context.set_forkserver_preload(_PRELOAD)
        _started = True
    return context


class WorkerPool:
    def __init__(self, size: int):
        ctx = _context()
        self.size = size
        self.procs, self.conns = [], []
        self.retiring = False  # a worker kept threads of a call's process groups: replace the pool after this call
        for i in range(size):
            parent_end, child_end = ctx.Pipe()
            # Not daemonic: a test may start its own child processes (e.g. DataLoader workers).
            proc = ctx.Process(target=_worker.main, args=(child_end, os.getpid()),
                               name=f"shardwise-test-rank{i}")
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        self._await_ready()

    def _await_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for i, conn in enumerate(self.conns):
            try:
                started = conn.poll(max(0.0, deadline - time.monotonic())) and conn.recv_bytes()
            except (EOFError, OSError):
                started = False
            if not started:
                self.kill()
                code = self.procs[i].exitcode
                raise RuntimeError(f"test worker {i} did not start (exit code {code}, waited up "
                                   f"to {STARTUP_TIMEOUT:.0f}s); its stderr is above")

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def call(self, payload: bytes, metas: list[dict], timeout: float, grace: float
             ) -> tuple[dict[int, tuple], list[int], list[int]]:
        """Run one call on every rank.

        Returns the replies by rank; the ranks that did not answer in `timeout` seconds,
        or in `grace` seconds after the first failure (ranks blocked in a collective with
        a failed rank may never answer); and those of them still inside fn (the others
        had returned and were waiting for them or cleaning up).
        """
        for conn, meta in zip(self.conns, metas):
            conn.send_bytes(pickle.dumps((meta, payload), protocol=pickle.HIGHEST_PROTOCOL))
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        replies: dict[int, tuple] = {}
        returned: set[int] = set()
        deadline = time.monotonic() + timeout
        while pending and (remaining := deadline - time.monotonic()) > 0:
            for conn in wait(list(pending), remaining):
                rank = pending[conn]
                reply = self._receive(rank, conn)
                if reply[0] == "returned":
                    returned.add(rank)
                    continue
                if reply[0] == "retiring":
                    self.retiring = True
                    continue
                replies[rank] = reply
                del pending[conn]
                if reply[0] != "ok":
                    deadline = min(deadline, time.monotonic() + grace)
        unanswered = sorted(pending.values())
        return replies, unanswered, [rank for rank in unanswered if rank not in returned]

    def _receive(self, rank: int, conn) -> tuple:
        try:
            reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self.procs[rank].join(1.0)
            # Its time of death is unknown, but a dead process is a cause, not an echo of
            # another rank's failure (those are raised): rank it first with time 0.
            died = f"the worker process died (exit code {self.procs[rank].exitcode})"
            return ("error", died, "", 0.0)
        if reply[0] != "ok":  # "returned", "retiring" or "error"
            return reply
        try:
            return ("ok", pickle.loads(reply[1]))
        except Exception as e:
            return _worker.error_reply(e, "the return value could not be unpickled in the caller: ")

    def dump_stacks(self, ranks: list[int]) -> None:
        """Ask hung workers to write every thread's stack to their call log (POSIX only)."""
        if not hasattr(signal, "SIGUSR1"):
            return
        for rank in ranks:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(0.5)

    def kill(self) -> None:
        """Terminate, then kill, every worker (idle workers hold nothing worth a graceful exit)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 2.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
