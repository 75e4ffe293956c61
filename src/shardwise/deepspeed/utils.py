"""`deepspeed.utils`: the logger, rank-filtered logging and `RepeatingLoader` that training scripts import."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator, Optional

import torch.distributed as dist

__all__ = ["logger", "log_dist", "RepeatingLoader"]


def _logger() -> logging.Logger:
    """DeepSpeed's logger prints INFO and above to stdout with its own handler."""
    found = logging.getLogger("shardwise.deepspeed")
    if not found.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] "
                                               "%(message)s"))
        found.addHandler(handler)
        found.setLevel(logging.INFO)
        found.propagate = False
    return found


logger = _logger()


def log_dist(message: str, ranks: Optional[list[int]] = None, level: int = logging.INFO) -> None:
    """`[Rank r] message` on the given ranks (every rank when None or containing -1)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


class RepeatingLoader:
    """Iterates a loader forever, starting it again at its end (DeepSpeed's pipeline scripts wrap theirs)."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
