"""How a Trainer joins shardwise's runtime: the config it starts, and the world accelerate and the arguments see.

The layout comes from the config `shardwise run` was given (or the script's own `sw.init`), or from
`TrainingArguments(deepspeed=...)`. The Trainer's own settings that shardwise's config also holds — bf16, fp16
and the clipping norm — go in with it, so that a config setting them otherwise is one error naming both.

A DeepSpeed config has its "auto" values filled in two passes, as transformers fills them: the first here,
before the runtime starts; the second (ZeRO's bucket sizes from the model, the schedule's steps) once `train`
knows the number of steps. The runtime starts from the first pass without the keys the Trainer drives itself
(the batch sizes and accumulation: the Trainer runs its own accumulation loop, and they were checked against
its arguments) and without the scheduler block, which the second pass completes.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import transformers

from ..config import ConfigError, Problem
from ..config.blocks import SchedulerBlock, block_problems
from ..config.deepspeed.auto import (AUTO, HIDDEN_SIZE_KEYS, auto_keys, fill_from_model, fill_from_trainer,
                                     unfilled_problem)
from ..config.sources import read_file
from ..runtime import state
from ..runtime.init import init, joined
from .arguments import trainer_arguments

# Driven by the Trainer itself, once its first pass has checked them against the TrainingArguments.
_TRAINER_DRIVEN = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def world_size() -> int:
    """Every process of the run: the process group's, else the launcher's WORLD_SIZE, else 1."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _read(value: Any) -> dict[str, Any]:
    """A DeepSpeed config as TrainingArguments takes it: a dict, or the path of a JSON file."""
    if isinstance(value, Mapping):
        return copy.deepcopy(dict(value))
    if isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
        return read_file(value)
    raise ConfigError([Problem("TrainingArguments.deepspeed", value, "is neither a dict nor the path of a JSON file",
                               "pass the DeepSpeed config as a dict or a path to its JSON file")])


def _drop(data: Mapping[str, Any], paths: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(dict(data))
    for path in paths:
        *parents, key = path.split(".")
        node: Any = out
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(key, None)
    return out


@dataclass
class DeepSpeedPlan:
    """A `TrainingArguments(deepspeed=...)` config after the Trainer's first pass."""

    data: dict[str, Any]

    @classmethod
    def of(cls, args: transformers.TrainingArguments, world: Optional[int] = None) -> "DeepSpeedPlan":
        """`args.deepspeed` after the first pass, for `world` processes (default: this run's)."""
        filled = fill_from_trainer(_read(args.deepspeed), trainer_arguments(args, world or world_size()))
        if filled.problems:
            raise ConfigError(filled.problems)
        return cls(filled.data)

    def runtime_keys(self) -> dict[str, Any]:
        """What the runtime starts from: the config without the Trainer-driven keys, the scheduler block and the
        bucket sizes the second pass fills (tuning knobs: they change no layout)."""
        later = [path for path in HIDDEN_SIZE_KEYS if _value(self.data, path) == AUTO]
        return _drop(self.data, [*_TRAINER_DRIVEN, "scheduler", *later])

    def finish(self, hidden_size: Optional[int], num_training_steps: int, warmup_steps: int) -> dict[str, Any]:
        """The second pass; every "auto" left after it is an error, as DeepSpeed would read the text."""
        filled = fill_from_model(self.data, hidden_size, num_training_steps, warmup_steps)
        left = auto_keys(filled.data)
        problems = filled.problems + ([unfilled_problem(left)] if left and not filled.problems else [])
        if "scheduler" in filled.data and not problems:
            problems = block_problems("scheduler", filled.data["scheduler"])
        if problems:
            raise ConfigError(problems)
        self.data = filled.data
        return self.data

    def scheduler(self) -> Optional[SchedulerBlock]:
        block = self.data.get("scheduler")
        return None if block is None else SchedulerBlock(**block)


def _value(data: Mapping[str, Any], path: str) -> Any:
    node: Any = data
    for name in path.split("."):
        node = node.get(name) if isinstance(node, Mapping) else None
    return node


def _trainer_keys(args: transformers.TrainingArguments) -> dict[str, Any]:
    """The Trainer's settings shardwise's config also holds (no clipping is no gradient_clipping)."""
    keys: dict[str, Any] = {"bf16": bool(args.bf16), "fp16": bool(args.fp16)}
    if args.max_grad_norm and args.max_grad_norm > 0:
        keys["gradient_clipping"] = float(args.max_grad_norm)
    return keys


def _disagreements(keys: Mapping[str, Any], args: transformers.TrainingArguments) -> list[Problem]:
    """The Trainer's settings the running config holds otherwise."""
    config = state.current().config
    wanted = {"bf16": bool(args.bf16), "fp16": bool(args.fp16), "gradient_clipping": keys.get("gradient_clipping")}
    names = {"bf16": "bf16", "fp16": "fp16", "gradient_clipping": "max_grad_norm"}
    return [Problem(key, getattr(config, key), f"differs from the TrainingArguments' {names[key]} "
                    f"({args.max_grad_norm if key == 'gradient_clipping' else value!r})",
                    f"give {names[key]} and the shardwise config one value")
            for key, value in wanted.items() if getattr(config, key) != value]


def start_runtime(args: transformers.TrainingArguments) -> Optional[DeepSpeedPlan]:
    """Start shardwise's runtime for the Trainer (or join the one the script started); the DeepSpeed plan, if any."""
    plan = DeepSpeedPlan.of(args) if args.deepspeed else None
    keys = plan.runtime_keys() if plan is not None else _trainer_keys(args)
    if not state.is_initialized():
        init(keys)
    elif plan is not None:
        _, problems = joined(keys, "", "give TrainingArguments(deepspeed=...) and sw.init the same parallelism keys")
        if problems:
            raise ConfigError(problems)
    if plan is None:
        problems = _disagreements(keys, args)
        if problems:
            raise ConfigError(problems)
    runtime = state.current()
    if runtime.layout.tp > 1 and not runtime.config.prescaled_batch:
        raise ConfigError([Problem("prescaled_batch", False, "the Hugging Face Trainer gives the ranks of a tensor-"
                                   "parallel group one batch (per_device_train_batch_size rows), as transformers' "
                                   "tensor parallelism does", "set prescaled_batch: true with tensor_parallel_degree")])
    return plan


@contextlib.contextmanager
def _threads_kept() -> Iterator[None]:
    """accelerate sets torch's thread count for CPU worlds when OMP_NUM_THREADS is unset: keep the process's."""
    had = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    try:
        yield
    finally:
        if had is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def adopt_world(args: transformers.TrainingArguments) -> None:
    """Make accelerate's state and the TrainingArguments see shardwise's process group: every process, this rank,
    this rank's device, and no DeepSpeed. accelerate takes a CPU world for no world at all unless told it runs on
    the CPU, and the arguments may have been made before the process group existed."""
    from accelerate.state import AcceleratorState, PartialState

    runtime = state.current()
    AcceleratorState._reset_state(reset_partial_state=True)
    with _threads_kept():
        partial = PartialState(cpu=runtime.device.type == "cpu")
    if partial.num_processes != dist.get_world_size() or partial.process_index != dist.get_rank():
        raise RuntimeError(f"accelerate sees {partial.num_processes} process(es) where the process group has "
                           f"{dist.get_world_size()}; start the ranks with `shardwise run` or torchrun, which set "
                           "LOCAL_RANK, RANK and WORLD_SIZE")
    args.distributed_state = partial
    args._n_gpu = 0 if runtime.device.type == "cpu" else 1
    args.__dict__["_setup_devices"] = runtime.device  # the cached device (a cached_property's slot)
    args.deepspeed_plugin = None  # shardwise runs the DeepSpeed config, not accelerate's DeepSpeed
    # transformers' TrainingArguments(deepspeed=...) registered it for from_pretrained's zero.Init: forget it.
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
