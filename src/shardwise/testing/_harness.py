"""run_distributed and its decorator: calls on pooled workers, with errors and hangs made loud."""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import shutil
import sys
import tempfile
import threading
from typing import Any, Callable

from . import _worker
from ._pool import WorkerPool

GRACE = 5.0  # seconds the other ranks get to answer after one has failed
# Beyond this, the least recently used pools are stopped: each idle worker holds a few hundred MB. (A worker whose
# calls leave process groups alive, each with threads that poll, asks to be replaced: see _worker.LEAKED_THREADS.)
MAX_IDLE_WORKERS = 8
TAIL_LINES, TAIL_BYTES = 60, 16_000  # of a rank's output shown in an error

_pools: dict[int, WorkerPool] = {}  # by world size, least recently used first
_lock = threading.Lock()  # one call at a time: a pool serves one call


class DistributedTestError(Exception):
    """A rank raised or its worker died.

    `rank` is the first rank to fail; `tracebacks` holds the remote traceback of each failed rank.
    """

    def __init__(self, message: str, rank: int, tracebacks: dict[int, str]):
        super().__init__(message)
        self.rank = rank
        self.tracebacks = tracebacks


def run_distributed(fn: Callable, world_size: int, /, *args: Any, nproc_per_node: int | None = None,
                    timeout: float = 120.0, **kwargs: Any) -> list:
    """Run `fn(*args, **kwargs)` on every rank of a fresh process group; return the results by rank.

    `fn`, its arguments and its results must be picklable (a module-level function).
    `nproc_per_node` < `world_size` simulates several nodes through LOCAL_RANK,
    LOCAL_WORLD_SIZE and GROUP_RANK/NODE_RANK. Raises DistributedTestError if a rank
    raises and TimeoutError if some rank has not finished after `timeout` seconds.
    """
    return _launch(fn, world_size, args, kwargs, nproc_per_node, timeout)


def distributed(world_size: int, *, nproc_per_node: int | None = None, timeout: float = 120.0):
    """Decorate a module-level function so that calling it runs it on `world_size` ranks.

    The call returns the per-rank results, or None when every rank returned None, so
    the decorator also fits test functions (pytest fixtures are passed to every rank).
    """

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def launcher(*args, **kwargs):
            if _worker.in_call():  # unpickled on a worker: this is the rank's body
                return fn(*args, **kwargs)
            results = _launch(launcher, world_size, args, kwargs, nproc_per_node, timeout)
            return None if all(r is None for r in results) else results

        return launcher

    return decorate


def shutdown_pools() -> None:
    """Stop every worker pool (also done at interpreter exit)."""
    while _pools:
        _pools.pop(next(iter(_pools))).kill()


atexit.register(shutdown_pools)


def _launch(fn: Callable, world_size: int, args: tuple, kwargs: dict, nproc_per_node: int | None,
            timeout: float) -> list:
    nproc = _check_sizes(world_size, nproc_per_node, timeout)
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(f"run_distributed needs a picklable fn and arguments (a module-level "
                        f"function), but {name} could not be pickled: {e}") from e
    with _lock:
        pool = _pool_for(world_size)
        tmp = tempfile.mkdtemp(prefix="shardwise-test-")
        try:
            metas = [_meta(rank, world_size, nproc, tmp) for rank in range(world_size)]
            try:
                replies, pending, in_fn = pool.call(payload, metas, timeout, GRACE)
            except BaseException:  # e.g. Ctrl-C while waiting: the workers are mid-call
                _discard(world_size)
                raise
            failed = {rank: reply for rank, reply in replies.items() if reply[0] != "ok"}
            if pending and not failed:
                pool.dump_stacks(in_fn or pending)
            if pending or failed:
                # A rank that saw an error may keep state that breaks the next call: one
                # whose init_process_group failed half-way keeps torch's group counter, so
                # the ranks then disagree on rendezvous keys and hang. Start afresh.
                _discard(world_size)
            if failed:
                raise _failure(name, world_size, failed, pending, metas)
            if pending:
                raise _timeout(name, world_size, timeout, pending, in_fn, metas)
            return [replies[rank][1] for rank in range(world_size)]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _check_sizes(world_size: int, nproc_per_node: int | None, timeout: float) -> int:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    nproc = world_size if nproc_per_node is None else nproc_per_node
    if not isinstance(nproc, int) or nproc < 1 or world_size % nproc:
        raise ValueError(f"nproc_per_node={nproc_per_node!r} must be a positive int dividing "
                         f"world_size={world_size} (ranks are split evenly across simulated nodes)")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return nproc


def _pool_for(world_size: int) -> WorkerPool:
    pool = _pools.pop(world_size, None)
    if pool is not None and (pool.retiring or not pool.alive()):
        pool.kill()
        pool = None
    if pool is None:
        while _pools and sum(p.size for p in _pools.values()) + world_size > MAX_IDLE_WORKERS:
            _pools.pop(next(iter(_pools))).kill()
        pool = WorkerPool(world_size)
    _pools[world_size] = pool
    return pool


def _discard(world_size: int) -> None:
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.kill()


def _meta(rank: int, world_size: int, nproc: int, tmp: str) -> dict:
    node = str(rank // nproc)
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank % nproc), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": node, "NODE_RANK": node}
    return {"env": env, "store_path": os.path.join(tmp, "store"), "sys_path": list(sys.path),
            "log_path": os.path.join(tmp, f"rank{rank}.log")}


def _failure(name: str, world_size: int, failed: dict[int, tuple], pending: list[int],
             metas: list[dict]) -> DistributedTestError:
    order = sorted(failed, key=lambda rank: failed[rank][3])  # the earliest failure is the cause
    first, (_, summary, tb, _) = order[0], failed[order[0]]
    lines = [f"{name} failed on rank {first} of {world_size}: {summary}"]
    lines += [f"then failed: rank {rank}: {failed[rank][1]}" for rank in order[1:]]
    if pending:
        lines.append(f"no answer (killed with the pool): ranks {pending}")
    message = "\n".join(lines)
    if tb:
        message += f"\n\n--- rank {first} traceback ---\n{tb.rstrip()}"
    message += _tail(metas[first], first, "output")
    return DistributedTestError(message, first, {rank: reply[2] for rank, reply in failed.items()})


def _timeout(name: str, world_size: int, timeout: float, pending: list[int], in_fn: list[int],
             metas: list[dict]) -> TimeoutError:
    if in_fn:
        message = f"{name} did not finish within {timeout}s on ranks {in_fn} of {world_size}"
        if waiting := [rank for rank in pending if rank not in in_fn]:
            message += f"; ranks {waiting} had returned and were waiting for them"
    else:
        message = (f"{name} returned on every rank, but ranks {pending} did not finish "
                   f"cleaning up within {timeout}s")
    message += "; the worker pool was killed"
    tails = "".join(_tail(metas[rank], rank, "output and stacks") for rank in in_fn or pending)
    return TimeoutError(message + tails)


def _tail(meta: dict, rank: int, what: str) -> str:
    try:
        with open(meta["log_path"], "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()[-TAIL_LINES:]
    except OSError:
        return ""
    if not lines:
        return ""
    return f"\n\n--- rank {rank} {what} (last {TAIL_LINES} lines) ---\n" + "\n".join(lines)
