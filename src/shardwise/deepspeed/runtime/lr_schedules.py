"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedules, computing its formulas as torch LRSchedulers."""

from ...api.configured import OneCycle, WarmupDecayLR, WarmupLR

__all__ = ["OneCycle", "WarmupDecayLR", "WarmupLR"]
