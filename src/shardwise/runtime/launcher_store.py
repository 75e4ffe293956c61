"""The launcher's key-value store, as the ranks' side channel: hang reports and preemption talk through it
while the main thread may be stuck in (or busy between) collectives."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist


def attempt_key(name: str) -> str:
    """A store key of this launch attempt (a restart must not see what the last attempt posted)."""
    return f"shardwise/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def connect(timeout: timedelta) -> Optional[dist.TCPStore]:
    """A connection of this thread's own to the launcher's store (`timeout` for each wait and get); None without
    one (a one-process run, a test harness)."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timeout, wait_for_workers=False)


def wait_for(store: dist.TCPStore, key: str, stopped: Optional[threading.Event] = None,
             poll_seconds: float = 0.5) -> bool:
    """Wait for `key` while the script runs: True once it is set, False when the main thread has ended (or
    `stopped` is set).

    A watching thread polls rather than block in the store: the store lives in the first rank, which may exit
    first, and a thread that learns so while the interpreter is finalizing aborts the process."""
    while threading.main_thread().is_alive() and not (stopped and stopped.is_set()):
        if store.check([key]):
            return True
        time.sleep(poll_seconds)
    return False
