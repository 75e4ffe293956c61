"""`deepspeed.runtime.dataloader`: `RepeatingLoader` (the engine's loaders are `sw.data_loader`s)."""

from ..utils import RepeatingLoader

__all__ = ["RepeatingLoader"]
