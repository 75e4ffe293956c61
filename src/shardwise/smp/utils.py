"""SMP's `smp.utils`: `rmsg`, a message prefixed with the rank that writes it."""

from __future__ import annotations

import torch.distributed as dist


def rmsg(message: object) -> str:
    """`"[<rank>] <message>"`, as SMP formats it; rank 0 in a process outside any world."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"[{rank}] {message}"
