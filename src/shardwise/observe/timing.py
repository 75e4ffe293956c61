"""Where a step's time went: forward, backward, optimizer, data wait, exposed communication and other.

A step runs from the end of the previous optimizer step (or the first batch fetched) to the end of its own.
The runtime marks its phases as intervals: batches fetched from `sw.data_loader` (data wait), @step calls,
the model's forward inside them (root-module hooks) and `optimizer.step()`. What of a @step call is not
forward is backward (the loss and the gradient sync included); exposed communication, the host idle while
a collective is in flight (observe/comms.py), is taken out of the phase it fell in; other is the rest (the
user's own code between the calls), so the parts sum to the step time by construction.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

import torch

Interval = tuple[float, float]


def overlap(intervals: list[Interval], windows: list[Interval]) -> float:
    """Seconds of `intervals` inside `windows` (each list disjoint)."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in intervals for c, d in windows)


def span(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def device_now(device: torch.device, synchronize: bool) -> float:
    """The time, once the device has finished what was queued when `synchronize` (a phase boundary)."""
    if synchronize and device.type != "cpu":
        torch.accelerator.synchronize(device)
    return time.perf_counter()


class StepClock:
    """The phase intervals of the step under way."""

    def __init__(self) -> None:
        self.start: Optional[float] = None
        self.phases: dict[str, list[Interval]] = defaultdict(list)

    def begin(self, at: float) -> None:
        """The step starts at `at` unless it has started already."""
        if self.start is None:
            self.start = at

    def add(self, phase: str, start: float, end: float) -> None:
        self.begin(start)
        self.phases[phase].append((start, end))

    def elapsed(self, end: float) -> float:
        return end - (self.start if self.start is not None else end)

    def restart(self, at: float) -> None:
        """The next step starts where this one ended."""
        self.start = at
        self.phases = defaultdict(list)

    def breakdown(self, end: float, exposed: list[Interval]) -> dict[str, float]:
        """The step's seconds per phase; `exposed` are the intervals of exposed communication."""
        forward, steps, optimizer = self.phases["forward"], self.phases["step"], self.phases["optimizer"]
        exposed_forward = overlap(exposed, forward)
        exposed_step = overlap(exposed, steps)
        exposed_optimizer = overlap(exposed, optimizer)
        parts = {"forward_s": span(forward) - exposed_forward,
                 "backward_s": span(steps) - span(forward) - (exposed_step - exposed_forward),
                 "optimizer_s": span(optimizer) - exposed_optimizer,
                 "data_wait_s": span(self.phases["data_wait"]),
                 "exposed_comm_s": exposed_step + exposed_optimizer}
        parts["other_s"] = self.elapsed(end) - sum(parts.values())
        return parts
