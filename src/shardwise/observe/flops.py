"""FLOPs per step: counted once by torch's `FlopCounterMode` over the first recorded step's @step calls
(forward and backward; the optimizer's elementwise update is not counted), summed over the ranks with one
all-reduce, then scaled by each later step's samples: a step of twice the samples does twice the FLOPs."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode


class FlopsPerStep:
    """The world's FLOPs per sample, measured once."""

    def __init__(self) -> None:
        self.counter: Optional[FlopCounterMode] = None
        self.per_sample: Optional[float] = None

    @property
    def measuring(self) -> bool:
        return self.counter is not None

    def counting(self) -> FlopCounterMode:
        """The mode to run the first recorded step's @step calls under (the same counter for each)."""
        if self.counter is None:
            self.counter = FlopCounterMode(display=False)
        return self.counter

    def finish(self, samples: int, device: torch.device) -> None:
        """After the measured step: every rank's count summed (every rank must call, once)."""
        total = torch.tensor(float(self.counter.get_total_flops()), dtype=torch.float64, device=device)
        dist.all_reduce(total)
        self.per_sample = total.item() / max(samples, 1)
        self.counter = None

    def metrics(self, samples: int, step_time_s: float, peak_tflops: Optional[float], devices: int) -> dict:
        """flops_per_step, tflops_per_s and mfu (null without peak_tflops) of a step of `samples` samples."""
        flops = self.per_sample * samples
        tflops = flops / step_time_s / 1e12 if step_time_s > 0 else None
        mfu = tflops / (peak_tflops * devices) if tflops is not None and peak_tflops else None
        return {"flops_per_step": flops, "tflops_per_s": tflops, "mfu": mfu}
