""""auto": the Hugging Face Trainer's placeholder, filled in for the Trainer and refused outside it.

The Trainer's DeepSpeed integration (transformers' `HfTrainerDeepSpeedConfig`)
fills every "auto" in a DeepSpeed config from its TrainingArguments and the model
before DeepSpeed reads it: the batch sizes, the accumulation steps, the clip, the
optimizer's and scheduler's values, fp16/bf16, the ZeRO-3 bucket sizes. Outside
the Trainer nothing fills them in, so a config holding one is refused as one
problem naming every such key, and "auto" never turns a feature on.

`fill_from_trainer` and `fill_from_model` are the Trainer's two passes, as
transformers 5 runs them (`trainer_config_process` when the TrainingArguments are
made, `trainer_config_finalize` once the model and the number of steps are known):
each fills the keys it owns where they are "auto", and where one holds a value the
Trainer's differs from, it is a problem (the Trainer refuses such a config, listing
every mismatch). `shardwise.hf` runs them before translating; an "auto" neither pass
owns stays, and is refused naming the keys the Trainer fills.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ...errors import Problem

AUTO = "auto"
# Where "auto" is a value of DeepSpeed's own, not the Trainer's placeholder: ZenFlow's selection and update
# intervals, the pipeline's stage count, the dtype rules of data_types, AutoEP's and the autotuner's choices.
_DEEPSPEED_OWN = ("zero_optimization.zenflow.", "pipeline.stages", "data_types.", "expert_parallel.", "autotuning.")


def auto_keys(data: Mapping[str, Any]) -> list[str]:
    """The dotted paths (`optimizer.params.lr`, `zero_optimization.stage3_prefetch_bucket_size`) of every value
    that is the Trainer's "auto", in the config's order."""
    found: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")
        elif value == AUTO and not any(path.startswith(own) for own in _DEEPSPEED_OWN):
            found.append(path)

    walk(data, "")
    return found


def without_auto(data: Mapping[str, Any], paths: list[str]) -> dict[str, Any]:
    """`data` with the values at `paths` removed (lists keep their length: their "auto" becomes None), so the rest
    of the config is still checked in the same pass."""
    def strip(value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            return {key: strip(item, f"{path}.{key}" if path else str(key)) for key, item in value.items()
                    if (f"{path}.{key}" if path else str(key)) not in paths}
        if isinstance(value, list):
            return [None if f"{path}[{i}]" in paths else strip(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return value

    return strip(data, "")


def auto_problem(paths: list[str]) -> Problem:
    """One problem for every "auto" in the config."""
    return Problem(
        ", ".join(paths), AUTO,
        '"auto" is the Hugging Face Trainer\'s placeholder, which the Trainer fills in from its TrainingArguments '
        "(and the model) before DeepSpeed reads the config; outside the Trainer nothing fills it in, and it turns "
        "nothing on",
        "write the values themselves (a number; true or false for fp16.enabled and bf16.enabled), or run the "
        "script through the Hugging Face Trainer with this config")


# ----- the Trainer's two passes (transformers 5.x, integrations/deepspeed.py) -----

# The keys the Trainer's second pass fills from the model's hidden size: ZeRO's bucket sizes (tuning knobs here).
HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")
# The keys the second pass fills from the number of training steps.
STEP_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")
# Every key either pass fills: an "auto" anywhere else is no placeholder the Trainer knows.
TRAINER_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
                "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
                "fp16.enabled", "bf16.enabled", *HIDDEN_SIZE_KEYS, *STEP_KEYS)


@dataclass(frozen=True)
class TrainerArguments:
    """What the Trainer reads from its TrainingArguments to fill "auto" (transformers' names); `world_size` is
    every process of the run, as `TrainingArguments.world_size` counts them."""

    world_size: int = 1
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    learning_rate: float = 5e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    fp16: bool = False  # fp16 or fp16_full_eval
    bf16: bool = False  # bf16 or bf16_full_eval
    mixed_precision: str = "no"  # the Trainer's accelerator's: "fp16" with fp16, "bf16" with bf16
    save_on_each_node: bool = False
    auto_find_batch_size: bool = False


@dataclass
class Filled:
    """A DeepSpeed config after a pass: `data` with the pass's "auto" values filled in, and `problems` for the values
    the Trainer's differ from (and a hidden size the model does not give)."""

    data: dict[str, Any]
    problems: list[Problem] = field(default_factory=list)


class _Filler:
    """transformers' `fill_match` / `fill_only` over a copy of the config."""

    def __init__(self, data: Mapping[str, Any]):
        self.data = copy.deepcopy(dict(data))
        self.problems: list[Problem] = []

    def _node(self, path: str) -> tuple[Optional[dict], str]:
        """The dict holding `path`'s last key, or None where a section on the way is absent (nothing to fill)."""
        *parents, key = path.split(".")
        node: Any = self.data
        for name in parents:
            node = node.get(name) if isinstance(node, Mapping) else None
            if node is None:
                return None, key
        return (node, key) if isinstance(node, dict) else (None, key)

    def fill(self, path: str, value: Any, trainer_key: Optional[str] = None) -> None:
        """Put `value` at `path` where it is "auto"; where it holds another value and `trainer_key` is given, that
        is a mismatch (the Trainer's `fill_match`; without `trainer_key`, its `fill_only`)."""
        node, key = self._node(path)
        if node is None:
            return
        if node.get(key) == AUTO:
            node[key] = value
            return
        held = node.get(key)
        if trainer_key is not None and held is not None and held != value:
            self.problems.append(Problem(
                path, held, f"differs from the Trainer's {trainer_key}={value!r}, and the Hugging Face Trainer refuses "
                "a DeepSpeed config whose values differ from its TrainingArguments",
                f'set it to "auto" (the Trainer fills it in) or to {value!r}, or change {trainer_key}'))


def fill_from_trainer(data: Mapping[str, Any], args: TrainerArguments) -> Filled:
    """The Trainer's first pass (`trainer_config_process`): batch sizes, accumulation, clipping, the optimizer's
    lr/betas/eps/weight_decay, the warmup schedule's bounds and fp16/bf16 from the TrainingArguments."""
    f = _Filler(data)
    total = args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps
    exact = not args.auto_find_batch_size  # the batch-size finder changes them as it goes: no mismatch then
    f.fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size,
           "per_device_train_batch_size" if exact else None)
    f.fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    f.fill("train_batch_size", total, "train_batch_size (world size x per_device_train_batch_size x "
           "gradient_accumulation_steps)" if exact else None)
    f.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    f.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    f.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]")
    f.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    f.fill("scheduler.params.warmup_min_lr", 0)  # no TrainingArguments value: 0, never a mismatch
    f.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if args.save_on_each_node:  # the Trainer asks DeepSpeed to write to each node's own storage
        f.data["checkpoint"] = {**f.data.get("checkpoint", {}), "use_node_local_storage": True}
    f.fill("fp16.enabled", args.fp16, "fp16 (or fp16_full_eval)")
    f.fill("bf16.enabled", args.bf16, "bf16 (or bf16_full_eval)")
    _mixed_precision(f, args.mixed_precision)
    return Filled(f.data, f.problems)


def _mixed_precision(f: _Filler, mixed: str) -> None:
    """What the Trainer's accelerator adds (accelerate's `DeepSpeedPlugin.set_mixed_precision`): fp16 or bf16 asked
    by the TrainingArguments turns on a section the config leaves out, and may not meet the other one enabled."""
    if mixed not in ("fp16", "bf16"):
        return
    f.data.setdefault(mixed, {"enabled": True})
    other = "bf16" if mixed == "fp16" else "fp16"
    section = f.data.get(other)
    named = any(problem.path == f"{other}.enabled" for problem in f.problems)  # a mismatch says it already
    if isinstance(section, Mapping) and str(section.get("enabled", False)).lower() == "true" and not named:
        f.problems.append(Problem(f"{other}.enabled", section["enabled"], f"is on while the TrainingArguments ask for "
                                  f"{mixed}, and the Trainer's accelerator refuses both", f'set it to false or "auto", '
                                  f"or train with {other} in the TrainingArguments"))


def fill_from_model(data: Mapping[str, Any], hidden_size: Optional[int], num_training_steps: int,
                    warmup_steps: int) -> Filled:
    """The Trainer's second pass (`trainer_config_finalize`): ZeRO's bucket sizes from the model's `hidden_size`
    (None where its config gives none; a problem only if one of them is "auto"), the schedule's total and warmup
    steps from the run's optimizer steps and `TrainingArguments.get_warmup_steps` (at least 1, as DeepSpeed 0.19.6+
    takes no warmup of 0)."""
    f = _Filler(data)
    wanted = [path for path in HIDDEN_SIZE_KEYS if _value(f.data, path) == AUTO]
    if wanted and hidden_size is None:
        f.problems.append(Problem(", ".join(wanted), AUTO, "is filled from the model's hidden size, and the model's "
                                  "config has neither hidden_size nor hidden_sizes",
                                  "write a whole number for each of these keys"))
    elif wanted:
        f.fill("zero_optimization.reduce_bucket_size", hidden_size * hidden_size)
        if _value(f.data, "zero_optimization.stage") == 3:  # the Trainer fills the stage-3 ones only at stage 3
            f.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size))
            f.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size)
    f.fill("scheduler.params.total_num_steps", num_training_steps, "the run's optimizer steps")
    f.fill("scheduler.params.warmup_num_steps", max(1, warmup_steps), "warmup_steps (or warmup_ratio)")
    return Filled(f.data, f.problems)


def _value(data: Mapping[str, Any], path: str) -> Any:
    node: Any = data
    for name in path.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(name)
    return node


def unfilled_problem(paths: list[str]) -> Problem:
    """One problem for the "auto" values the Trainer does not fill (it fills only TRAINER_KEYS)."""
    return Problem(", ".join(paths), AUTO, "is no key the Hugging Face Trainer fills in (it fills the batch sizes, "
                   "accumulation, clipping, the optimizer's lr/betas/eps/weight_decay, the warmup schedule, "
                   "fp16/bf16 enabled and ZeRO's bucket sizes), so DeepSpeed would read the text \"auto\"",
                   "write the values themselves")
