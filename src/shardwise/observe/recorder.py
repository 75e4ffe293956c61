"""The recorder: what the runtime tells it during a step, turned into one global and one per-rank record.

The API calls it at four places: `sw.data_loader` (each batch fetched), `@step` (each call, with the
batch), `StepOutput.reduce_mean` (the loss) and `DistributedOptimizer.step` (the step's end). Every
`metrics_interval`-th optimizer step is recorded; between them the recorder only reads the clock. The
costly parts run on recorded steps alone: the phase breakdown and comms log watch every op through a
dispatch mode, the FLOP count runs once. There is one recorder per runtime (`recorder_for`).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Optional
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist

from ..rundir import RUN_DIR_ENV
from ..parallel.mesh import ParallelMesh
from ..runtime.state import Runtime, current
from ..torch_internals import tree_leaves
from . import comms
from .flops import FlopsPerStep
from .memory import memory_record
from .progress import ProgressDisplay
from .sinks import JsonLines, global_sinks
from .timing import StepClock, device_now


def metrics_dir(config: Any) -> Optional[Path]:
    """`metrics_dir`, else <run dir>/metrics under `shardwise run`, else None (no files)."""
    if config.metrics_dir is not None:
        return Path(config.metrics_dir)
    run_dir = os.environ.get(RUN_DIR_ENV)
    return Path(run_dir) / "metrics" if run_dir else None


def _batch_shape(args: tuple, kwargs: dict) -> tuple[int, Optional[int]]:
    """Rows of the first tensor argument, and its tokens when it holds token ids (an integer tensor of 2+ dims:
    rows × sequence); (0, None) without a tensor."""
    tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not tensors:
        return 0, None
    batch = tensors[0]
    tokens = batch.shape[0] * batch.shape[1] if batch.dim() >= 2 and not batch.is_floating_point() else None
    return batch.shape[0], tokens


class Recorder:
    """Records the steps of one runtime (passed to each call: the recorder must not keep it alive)."""

    def __init__(self, runtime: Runtime):
        config = runtime.config
        self.interval = config.metrics_interval
        self.breakdown = config.wall_clock_breakdown
        self.comms_logger = config.comms_logger
        self.peak_tflops = config.peak_tflops
        self.flops = FlopsPerStep() if config.flops_profiler else None
        self.directory = metrics_dir(config) if self.interval else None
        self.rank_file = JsonLines(self.directory / f"rank{runtime.rank}.jsonl") if self.directory else None
        self.sinks = (global_sinks(config.metrics_sinks, self.directory, config.wandb_project,
                                   config.model_dump(mode="json")) if self.interval and runtime.rank == 0 else [])
        self.progress: Optional[ProgressDisplay] = (ProgressDisplay(None) if config.progress_bar and runtime.rank == 0
                                                    else None)
        self.steps = 0  # optimizer steps taken: those of the first DistributedOptimizer that steps
        self._stepper: Optional[weakref.ref] = None
        self.clock = StepClock()
        self.watch: Optional[comms.CollectiveWatch] = None
        self.rows = 0
        self.tokens: Optional[int] = 0
        self.loss: Optional[torch.Tensor] = None
        self.latest: Optional[dict[str, Any]] = None

    @property
    def recording(self) -> bool:
        """The step under way is recorded."""
        return self.interval > 0 and (self.steps + 1) % self.interval == 0

    def show_progress(self, display: ProgressDisplay) -> None:
        """Show the records on `display` (rank 0's), in place of the one `progress_bar` made."""
        if self.progress is not None:
            self.progress.close()
        self.progress = display

    def _now(self, device: torch.device) -> float:
        return device_now(device, self.breakdown and self.recording)

    def _watching(self, runtime: Runtime) -> contextlib.AbstractContextManager:
        if not self.recording or not (self.comms_logger or self.breakdown):
            return contextlib.nullcontext()
        if self.watch is None:
            self.watch = comms.CollectiveWatch(comms.mesh_groups(runtime.mesh), track_idle=self.breakdown)

        @contextlib.contextmanager
        def watching() -> Iterator[None]:
            with self.watch:
                yield
            self.watch.close()

        return watching()

    # What the API calls.
    def batch_fetched(self, start: float, end: float) -> None:
        if self.interval:
            self.clock.add("data_wait", start, end)

    @contextlib.contextmanager
    def step_call(self, runtime: Runtime, models: list, args: tuple, kwargs: dict) -> Iterator[None]:
        """Around one @step call."""
        if not self.interval:
            yield
            return
        if torch.is_grad_enabled():  # an evaluation step's batch is no training sample
            self.batch_trained(args, kwargs)
        start = self._now(runtime.device)
        with contextlib.ExitStack() as stack:
            if self.recording and self.breakdown:
                for module in (m for model in models for m in _forward_modules(model)):
                    stack.enter_context(self._forward_hooks(module, runtime.device))
            stack.enter_context(self._watching(runtime))
            if self.recording and self.flops is not None and self.flops.per_sample is None:
                stack.enter_context(self.flops.counting())
            yield
        self.clock.add("step", start, self._now(runtime.device))

    def batch_trained(self, args: tuple, kwargs: dict) -> None:
        """Count a training batch's samples and tokens (a @step call's, or a DeepSpeed engine's micro-step)."""
        if self.interval:
            rows, tokens = _batch_shape(args, kwargs)
            self.rows += rows
            self.tokens = None if tokens is None or self.tokens is None else self.tokens + tokens

    @contextlib.contextmanager
    def _forward_hooks(self, model: Any, device: torch.device) -> Iterator[None]:
        began: list[float] = []
        pre = model.register_forward_pre_hook(lambda *_: began.append(device_now(device, True)))
        post = model.register_forward_hook(lambda *_: self.clock.add("forward", began.pop(), device_now(device, True)))
        try:
            yield
        finally:
            pre.remove()
            post.remove()

    def loss_returned(self, loss: Optional[torch.Tensor]) -> None:
        if self.loss is None and loss is not None:
            self.loss = loss

    @contextlib.contextmanager
    def optimizer_step(self, runtime: Runtime, optimizer: Any) -> Iterator[None]:
        """Around one `optimizer.step()`: the step's end; its records when it is recorded."""
        if not self.interval:
            yield
            return
        start = self._now(runtime.device)
        with self._watching(runtime):
            yield
        end = self._now(runtime.device)
        self.clock.add("optimizer", start, end)
        if self._stepper is None:
            self._stepper = weakref.ref(optimizer)
        if self._stepper() is not optimizer:  # a second optimizer (a teacher's): its time is the step's optimizer
            return
        if self.recording:
            self._record(runtime, optimizer, end)
        self.steps += 1
        self.clock.restart(end)
        self.rows, self.tokens, self.loss, self.watch = 0, 0, None, None

    def _record(self, runtime: Runtime, optimizer: Any, end: float) -> None:
        step, step_time = self.steps + 1, self.clock.elapsed(end)
        # the ranks reading different batches: SMP's dp (replicas × tp), or its rdp when tp ranks share one
        layout = runtime.layout
        replicas = layout.dp if runtime.config.prescaled_batch else layout.dp * layout.tp
        samples = self.rows * replicas
        if self.flops is not None and self.flops.per_sample is None:
            self.flops.finish(samples, runtime.device)
        loss = self.loss.float() if self.loss is not None and self.loss.numel() == 1 else None
        record = {"step": step, "time": time.time(), "loss": None if loss is None else loss.item(),
                  "step_time_s": step_time, "samples": samples,
                  "samples_per_s": samples / step_time if step_time > 0 else None,
                  "tokens_per_s": (self.tokens * replicas / step_time if self.tokens is not None and step_time > 0
                                   else None),
                  "lr": optimizer.param_groups[0].get("lr"),
                  "grad_norm": None if optimizer.grad_norm is None else float(optimizer.grad_norm),
                  "loss_scale": optimizer.loss_scale if optimizer.loss_scaler is not None else None,
                  "skipped_steps": optimizer.skipped_steps}
        exposed = self.watch.exposed_intervals(end) if self.watch is not None and self.breakdown else []
        if self.breakdown:
            record["breakdown"] = self.clock.breakdown(end, exposed)
        if self.flops is not None:
            record.update(self.flops.metrics(samples, step_time, self.peak_tflops, dist.get_world_size()))
        self.latest = record
        for sink in self.sinks:
            sink.write(record)
        if self.progress is not None:
            self.progress.write(record)
        if self.rank_file is not None:
            self.rank_file.write(self._rank_record(runtime, step, end))

    def _rank_record(self, runtime: Runtime, step: int, end: float) -> dict[str, Any]:
        record = {"step": step, "rank": runtime.rank,
                  "memory": memory_record(list(runtime.models), list(runtime.optimizers), runtime.device)}
        if self.comms_logger:
            record["comms"] = comms.summary(self.watch.collectives if self.watch else [], end)
        return record

    def close(self) -> None:
        for sink in [*self.sinks, self.rank_file, self.progress]:
            if sink is not None:
                sink.close()


_recorders: WeakKeyDictionary[ParallelMesh, Recorder] = WeakKeyDictionary()


def recorder_for(runtime: Runtime) -> Recorder:
    """The runtime's recorder (made on first use; its files are closed when the runtime's mesh goes)."""
    recorder = _recorders.get(runtime.mesh)
    if recorder is None:
        recorder = _recorders[runtime.mesh] = Recorder(runtime)
        weakref.finalize(runtime.mesh, recorder.close)
    return recorder


def _forward_modules(model: Any) -> list:
    """The modules whose forward calls are the model's forward time: the model itself, or under a pipeline this
    rank's stage modules, which its schedule calls between backward passes (the model itself is not called)."""
    stages = model.stage_modules()
    return [model] if stages is None else stages


def progress(total_steps: Optional[int] = None, every: Optional[int] = None) -> None:
    """Show a progress display on rank 0 over a run of `total_steps` optimizer steps (the `progress_bar` key
    does the same with an unknown total); without a terminal, a line every `every` steps. It shows recorded
    steps: every step with metrics_interval 1."""
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps < 1):
        raise ValueError(f"sw.progress(total_steps={total_steps!r}): give the number of optimizer steps, e.g. "
                         "sw.progress(1000), or None when unknown")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"sw.progress(every={every!r}): give a number of steps >= 1 between plain lines, or None")
    runtime = current("shardwise.progress()")
    if runtime.rank == 0:
        recorder_for(runtime).show_progress(ProgressDisplay(total_steps, every))
