"""A run cut short after a given number of optimizer steps, so that a few steps of a user's own script can be
measured unchanged (`shardwise tune` sets the variable on every rank of each trial).

With SHARDWISE_STOP_AFTER_STEPS=S every rank leaves at the end of optimizer step S: the step's metrics are
already written, updates in flight finish, the ranks meet at a barrier (they all count the same steps), and the
process exits with code 0 as a finished script does.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

STOP_AFTER_STEPS_ENV = "SHARDWISE_STOP_AFTER_STEPS"


def step_limit() -> Optional[int]:
    """The number of optimizer steps after which the run stops, None when unset."""
    text = os.environ.get(STOP_AFTER_STEPS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{STOP_AFTER_STEPS_ENV}={text!r} is not a number of steps; set it to an integer >= 1 "
                         "or unset it")
    return int(text)


def at_step_boundary(step: int) -> None:
    """Called by every rank at the end of each optimizer step: at the limit, leave cleanly with exit code 0."""
    limit = step_limit()
    if limit is None or step < limit:
        return
    import torch.distributed as dist  # here: `shardwise tune` reads the variable's name and must not load torch

    from .init import shutdown

    if dist.is_initialized():
        dist.barrier()
    shutdown(wait=True)
    print(f"shardwise: stopped after optimizer step {step} ({STOP_AFTER_STEPS_ENV}={limit})", file=sys.stderr,
          flush=True)
    raise SystemExit(0)
