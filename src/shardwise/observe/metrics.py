"""`sw.metrics`: the metrics of this process's run, for scripts and the Job API.

    loss = sw.metrics.latest()["loss"]

Every rank builds the global record of each recorded step from its own view (its loss; the throughput
of the world); rank 0 writes it to global.jsonl.
"""

from __future__ import annotations

from typing import Any, Optional

from ..runtime.state import current
from .recorder import recorder_for


def latest() -> Optional[dict[str, Any]]:
    """The last recorded step's global record (the keys of global.jsonl), or None before the first."""
    return recorder_for(current("shardwise.metrics.latest()")).latest

