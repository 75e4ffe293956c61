"""FLOPs per step: counted once by torch's `FlopCounterMode` over the first recorded step's @step calls
(forward and backward; the optimizer's elementwise update is not counted), summed over the ranks with one
all-reduce, then scaled by each later step's samples: a step of twice the samples does twice the FLOPs."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode


class FlopsPerStep:
    """The world's FLOPs per sample, measured once."""

    def __init__(self) -> None:
        self.counted = 0  # this rank's FLOPs in the measured step's @step calls so far
        self.per_sample: Optional[float] = None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Around one @step call of the measured step (a FlopCounterMode starts from 0 each time it is entered)."""
        counter = FlopCounterMode(display=False)
        with counter:
            yield
        self.counted += counter.get_total_flops()

    def finish(self, samples: int, device: torch.device) -> None:
        """After the measured step: every rank's count summed (every rank must call, once)."""
        total = torch.tensor(float(self.counted), dtype=torch.float64, device=device)
        dist.all_reduce(total)
        self.per_sample = total.item() / max(samples, 1)

    def metrics(self, samples: int, step_time_s: float, peak_tflops: Optional[float], devices: int) -> dict:
        """flops_per_step, tflops_per_s and mfu (null without peak_tflops) of a step of `samples` samples."""
        flops = self.per_sample * samples
        tflops = flops / step_time_s / 1e12 if step_time_s > 0 else None
        mfu = tflops / (peak_tflops * devices) if tflops is not None and peak_tflops else None
        return {"flops_per_step": flops, "tflops_per_s": tflops, "mfu": mfu}
