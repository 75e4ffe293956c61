"""The worker side of the harness: one process that runs rank i of every call.

Torch is imported inside the worker only, so the parent (pytest) stays light.
Each call gets a fresh process group on a fresh FileStore and leaves nothing
behind: shardwise state, the process group, env and output redirection are all
undone before the reply is sent, so the next call sees a clean process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Callable

_in_call = False
# Threads a worker may keep beyond those it started with (a gloo process group has three) before it is replaced.
LEAKED_THREADS = 24


def in_call() -> bool:
    """True while this process runs a rank of a call (decorated helpers then run in place)."""
    return _in_call


def main(conn, parent_pid: int) -> None:
    """Serve calls from the parent until it closes the pipe or dies; never returns."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it kills us
    faulthandler.enable(all_threads=True)  # a crash in C++ leaves its Python stacks in the call's log
    if hasattr(signal, "SIGUSR1"):  # the parent asks for stacks before killing a hung call
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    import torch.distributed  # noqa: F401  pay the import before the first call's timeout starts

    gc.freeze()  # what the worker starts with lives as long as it does: collections after each call skip it
    threads_at_start = _os_threads()
    conn.send_bytes(b"ready")
    while True:
        try:
            meta, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # skip interpreter teardown: collecting torch's objects takes seconds
        returned = functools.partial(conn.send_bytes, pickle.dumps(("returned",)))
        conn.send_bytes(pickle.dumps(_run_call(meta, payload, returned)))
        # A DeviceMesh and the meshes flattened from it refer to each other, so the call's process groups (and
        # each gloo group's threads, which poll) would outlive it until a full collection, which an idle worker
        # never reaches; collected after the reply, while the caller goes on. Groups still alive after it are held
        # by something the call left behind (a tensor hook that refers back to its tensor makes a cycle no
        # collection breaks): the worker asks to be replaced, which the caller reads during the next call.
        gc.collect()
        if _os_threads() > threads_at_start + LEAKED_THREADS:
            conn.send_bytes(pickle.dumps(("retiring",)))


def _os_threads() -> int:
    """This process's threads, C++ ones included (0 where /proc does not list them)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _exit_with_parent(parent_pid: int) -> None:
    # The pipe's EOF only wakes an idle worker; this also ends one stuck inside a call. The parent is the process
    # that made the pool, not necessarily this one's parent (a forkserver's child).
    while _alive(parent_pid):
        time.sleep(1.0)
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the process exists
    except ProcessLookupError:
        return False
    return True  # it exists (a PermissionError too says so)


def _run_call(meta: dict, payload: bytes, returned: Callable[[], None]) -> tuple:
    global _in_call
    saved_env = dict(os.environ)
    os.environ.update(meta["env"])
    sys.path[:0] = [p for p in meta["sys_path"] if p not in sys.path]
    _in_call = True
    try:
        with _output_to(meta["log_path"]):
            return _call(meta, payload, returned)
    finally:
        _in_call = False
        os.environ.clear()
        os.environ.update(saved_env)


def _call(meta: dict, payload: bytes, returned: Callable[[], None]) -> tuple:
    """Run fn in a fresh process group; tell the parent when fn has returned, then clean up."""
    import torch
    import torch.distributed as dist

    rank, world = int(meta["env"]["RANK"]), int(meta["env"]["WORLD_SIZE"])
    store = dist.FileStore(meta["store_path"], world)
    try:
        fn, args, kwargs = pickle.loads(payload)
        _init_process_group(meta, store)
        _barrier(store, "started", rank, world)  # fn may destroy the group: peers must be connected
        torch.set_num_threads(1)
        value = fn(*args, **kwargs)
        try:
            reply = ("ok", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:
            raise TypeError(f"the return value of {fn!r} is not picklable: {e}") from e
        returned()  # so that a timeout can tell ranks stuck in fn from ranks waiting for them
    except BaseException as e:
        reply = error_reply(e)
    try:
        # A rank that succeeded keeps its group until every rank is done with it; a failed
        # rank leaves at once, so that peers blocked on it fail fast instead of hanging.
        _barrier(store, "done", rank, world, wait=reply[0] == "ok")
        _cleanup(wait=reply[0] == "ok")
    except BaseException as e:
        if reply[0] == "ok":
            reply = error_reply(e, "while cleaning up after the call: ")
    return reply


def error_reply(e: BaseException, prefix: str = "") -> tuple:
    """An error reply; its wall-clock time tells the root failure from its echoes on other ranks."""
    return ("error", f"{prefix}{type(e).__qualname__}: {e}", "".join(traceback.format_exception(e)),
            time.time())


def _init_process_group(meta: dict, store) -> None:
    """One device per local rank where an accelerator has enough of them, else CPU (gloo)."""
    import torch
    import torch.distributed as dist

    rank, world = int(meta["env"]["RANK"]), int(meta["env"]["WORLD_SIZE"])
    local_rank, local_world = int(meta["env"]["LOCAL_RANK"]), int(meta["env"]["LOCAL_WORLD_SIZE"])
    acc = torch.accelerator.current_accelerator()
    if acc is not None and torch.accelerator.device_count() >= local_world:
        torch.accelerator.set_device_index(local_rank)
        dist.init_process_group(dist.get_default_backend_for_device(acc), store=store, rank=rank,
                                world_size=world, device_id=torch.device(acc.type, local_rank))
    else:
        dist.init_process_group(dist.get_default_backend_for_device("cpu"), store=store, rank=rank,
                                world_size=world)


def _barrier(store, name: str, rank: int, world: int, wait: bool = True) -> None:
    """A barrier on the store, not the group: destroying a group while a peer is still
    connecting to it or reading its last message breaks that peer."""
    store.set(f"{name}/{rank}", "1")
    if wait:
        store.wait([f"{name}/{r}" for r in range(world)])


def _cleanup(wait: bool) -> None:
    """Forget the runtime, the process group and every cache that holds its meshes; `wait` for the
    collectives still in flight unless the call failed (its peers may never send theirs)."""
    from shardwise.runtime.init import shutdown

    shutdown(wait)


@contextlib.contextmanager
def _output_to(path: str):
    """Send fds 1 and 2 (Python, C++ and child processes alike) to the call's log file."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(path, "wb", buffering=0) as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])
