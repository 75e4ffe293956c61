"""`TrainingArguments` that keep a DeepSpeed config for shardwise instead of handing it to DeepSpeed.

transformers' own `TrainingArguments(deepspeed=...)` builds its DeepSpeed integration as the arguments are made:
it needs DeepSpeed installed, registers the config globally (so `from_pretrained` partitions models with
DeepSpeed's `zero.Init`) and starts DeepSpeed's process group. These keep `deepspeed` as given, for
`shardwise.hf.Trainer` to fill its "auto" values and run it on shardwise, and do nothing else differently, so
`HfArgumentParser` and every other field work as in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers

from ..config.deepspeed.auto import TrainerArguments


class _KeepDeepSpeed:
    """`__post_init__` with `deepspeed` hidden from transformers' integration, then put back as given."""

    def __post_init__(self) -> None:
        deepspeed, self.deepspeed = self.deepspeed, None
        try:
            super().__post_init__()
        finally:
            self.deepspeed = deepspeed


@dataclass
class TrainingArguments(_KeepDeepSpeed, transformers.TrainingArguments):
    __doc__ = transformers.TrainingArguments.__doc__


@dataclass
class Seq2SeqTrainingArguments(_KeepDeepSpeed, transformers.Seq2SeqTrainingArguments):
    __doc__ = transformers.Seq2SeqTrainingArguments.__doc__


def trainer_arguments(args: transformers.TrainingArguments, world_size: int) -> TrainerArguments:
    """The values the Trainer fills a DeepSpeed config's "auto" from; `world_size` counts every process."""
    mixed = "fp16" if args.fp16 else "bf16" if args.bf16 else "no"
    return TrainerArguments(
        world_size=world_size, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, max_grad_norm=args.max_grad_norm,
        learning_rate=args.learning_rate, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_epsilon=args.adam_epsilon, weight_decay=args.weight_decay, fp16=args.fp16 or args.fp16_full_eval,
        bf16=args.bf16 or args.bf16_full_eval, mixed_precision=mixed, save_on_each_node=args.save_on_each_node,
        auto_find_batch_size=args.auto_find_batch_size)
