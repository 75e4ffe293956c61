"""A Trainer script's TrainingArguments as `shardwise plan`'s inputs (`shardwise plan --training-args ...`).

What the planner needs of a Trainer run: the rows each model replica trains per micro-step
(`per_device_train_batch_size`, so the global batch is that times the devices under data parallelism), the
precision (`bf16`, `fp16`), whether the model's blocks are recomputed (the Trainer's activation checkpointing: one
region per block, the planner's "each") and, with `deepspeed=...`, the layout that config gives once the Trainer's
"auto" values are filled for the planned cluster's world. The arguments are read as written, without
TrainingArguments' own checks of this machine's devices: the plan is for another machine.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import Any, Optional

import transformers

from ..config import ConfigError, Problem
from .runtime import DeepSpeedPlan


@dataclass
class _AsWritten(transformers.TrainingArguments):
    """TrainingArguments' fields without `__post_init__`, which checks this machine's devices (bf16 and fp16
    need a GPU or use_cpu) and starts accelerate's state: neither concerns a plan for another machine."""

    def __post_init__(self) -> None:
        pass


@dataclass(frozen=True)
class TrainerRun:
    """The planner's inputs a Trainer run fixes."""

    per_device_batch: int  # rows per model replica and micro-step
    accumulation: int  # micro-steps per optimizer step (the plan is per micro-step)
    precision: str  # the planner's name: fp32, bf16 or fp16
    checkpointing: str  # the planner's strategy: "each" block under the Trainer's activation checkpointing, or "none"
    deepspeed: Optional[dict[str, Any]] = None  # `deepspeed=...`'s config as shardwise runs it, "auto" filled

    def global_batch(self, replicas: int) -> int:
        """Sequences per micro-step over `replicas` model replicas, each given per_device_batch rows."""
        return self.per_device_batch * replicas


def read_training_args(source: str) -> transformers.TrainingArguments:
    """The script's TrainingArguments from its JSON file (as `HfArgumentParser.parse_json_file` reads it; the
    script's own keys beside them left out) or from its command-line flags (its own flags left out)."""
    parser = transformers.HfArgumentParser(_AsWritten, prog="shardwise plan --training-args",
                                           usage="shardwise plan --training-args='--per_device_train_batch_size N "
                                                 "[--bf16] [--gradient_checkpointing] [--deepspeed ds.json] ...'")
    if source.endswith(".json") and os.path.isfile(source):
        return parser.parse_json_file(source, allow_extra_keys=True)[0]
    return parser.parse_args_into_dataclasses(shlex.split(source), return_remaining_strings=True)[0]


def _checkpointed(args: transformers.TrainingArguments) -> bool:
    """activation_checkpointing, or its older name gradient_checkpointing (an alias from transformers 5.20 on)."""
    return bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))


def trainer_run(source: str, world_size: int) -> TrainerRun:
    """The planner's inputs for the Trainer script whose arguments `source` holds, run on `world_size` devices."""
    args = read_training_args(source)
    if args.fsdp:
        raise ConfigError([Problem("TrainingArguments.fsdp", args.fsdp, "is accelerate's sharding, which shardwise.hf "
                                   "refuses", "drop fsdp; the plan proposes the sharding")])
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    deepspeed = DeepSpeedPlan.of(args, world_size).runtime_keys() if args.deepspeed else None
    return TrainerRun(args.per_device_train_batch_size, args.gradient_accumulation_steps, precision,
                      "each" if _checkpointed(args) else "none", deepspeed)
