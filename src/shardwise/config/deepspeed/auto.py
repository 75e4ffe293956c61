""""auto": the Hugging Face Trainer's placeholder, found and refused outside the Trainer.

The Trainer's DeepSpeed integration (transformers' `HfTrainerDeepSpeedConfig`)
fills every "auto" in a DeepSpeed config from its TrainingArguments and the model
before DeepSpeed reads it: the batch sizes, the accumulation steps, the clip, the
optimizer's and scheduler's values, fp16/bf16, the ZeRO-3 bucket sizes. Nothing
else fills them in, so a config holding one is refused as one problem naming
every such key, and "auto" never turns a feature on. A Trainer front end calls
`auto_keys` on the config, fills those paths, then translates.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import Problem

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
