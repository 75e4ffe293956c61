"""`deepspeed.runtime.utils`: the helpers training scripts import from it."""

from __future__ import annotations

import random

import torch

__all__ = ["set_random_seed", "see_memory_usage"]


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators, as DeepSpeed's helper does."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed prints device and host memory here when forced; shardwise's metrics record memory every
    recorded step (`metrics_interval`), so this prints only what torch's accelerator reports."""
    if not force:
        return
    from ..accelerator import get_accelerator
    from ..utils import log_dist

    used = get_accelerator().memory_allocated() / 2**30
    log_dist(f"{message} | allocated {used:.2f} GB", ranks=[0])
