"""How the ranks act together on a checkpoint: a group of its own, agreement on errors, the save in flight.

Every check that could fail on one rank only (a missing file, a damaged shard)
is followed by an exchange of errors, so all ranks raise the same one-line
error instead of the others waiting forever in the next collective.
"""

from __future__ import annotations

import atexit
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from ..runtime.hang_report import group_timeout
from ..runtime.state import Runtime, current, is_initialized
from .directory import CheckpointError

T = TypeVar("T")


def checkpoint_group(runtime: Runtime) -> dist.ProcessGroup:
    """A gloo group over the whole world, made by the first checkpoint call (collective, as every one is):
    a background save talks over it while training uses the others, and gloo works on every device."""
    if runtime.checkpoint_group is None:
        runtime.checkpoint_group = dist.new_group(backend="gloo", timeout=group_timeout())
    return runtime.checkpoint_group


def agree(group: dist.ProcessGroup, action: Callable[[], T]) -> T:
    """Run `action` on every rank; if it failed on any, raise that rank's error on all of them."""
    result: Any = None
    error: Optional[str] = None
    try:
        result = action()
    except CheckpointError as failure:
        error = str(failure)
    except Exception as failure:  # a local OSError etc.: named, then raised everywhere
        error = f"{type(failure).__name__}: {str(failure).strip().splitlines()[0] if str(failure).strip() else ''}"
    errors: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    first = next((message for message in errors if message), None)
    if first is not None:
        raise CheckpointError(first)
    return result


def _wait_at_exit() -> None:
    if is_initialized():
        current().wait_for_pending_save()


atexit.register(_wait_at_exit)
