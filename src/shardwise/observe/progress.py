"""A progress display on rank 0, fed the global record of every recorded step: step, loss, step time,
throughput, ETA. A rich progress bar on a terminal; plain lines elsewhere (a log file, `shardwise run`'s
per-rank stdout): the first step, every `every`-th (default: about twenty over a run of known length) and
the last."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _fields(record: dict[str, Any]) -> str:
    parts = []
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.3f}")
    parts.append(f"step {record['step_time_s'] * 1e3:.0f} ms")
    rate = record.get("tokens_per_s")
    parts.append(f"{rate:,.0f} tokens/s" if rate is not None else f"{record['samples_per_s']:,.1f} samples/s")
    return "  ".join(parts)


class ProgressDisplay:
    """Shows the records of a run of `total` steps (None: unknown)."""

    def __init__(self, total: Optional[int], every: Optional[int] = None, stream: Any = None):
        self.total = total
        self.stream = stream or sys.stdout
        self.started = time.monotonic()
        self.bar: Optional[Progress] = None
        if self.stream.isatty():
            self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                console=Console(file=self.stream))
            self.task = self.bar.add_task("train", total=total, info="")
            self.bar.start()
        self.every = every or max(1, (total or 0) // 20)

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=_fields(record))
            if self.total is not None and step >= self.total:
                self.bar.stop()  # the run's last step: leave the finished bar on the screen
            return
        if step == 1 or step % self.every == 0 or step == self.total:
            print(f"step {step}{f'/{self.total}' if self.total else ''}  {_fields(record)}{self._eta(step)}",
                  file=self.stream, flush=True)

    def _eta(self, step: int) -> str:
        if not self.total or step >= self.total:
            return ""
        left = (time.monotonic() - self.started) / step * (self.total - step)
        return f"  ETA {int(left) // 60}:{int(left) % 60:02d}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
