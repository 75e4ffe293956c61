"""DeepSpeed's JSON config, recognised by its keys and translated into shardwise's.

    {"train_batch_size": 32, "gradient_accumulation_steps": 2, "bf16": {"enabled": true},
     "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

Each DeepSpeed key becomes the shardwise key that does the same, or is listed
with why it cannot be honoured (a warning at run, a section in check-config):
never dropped unsaid. A key whose value is what shardwise always does (ZeRO's
`overlap_comm: true`) is honoured as it is. The batch triple is completed and
checked where the data-parallel degree is known (`validate.batch_triple`). Pure: no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .distribution import Distribution
from .schema import field_names

# Keys only a DeepSpeed config has; the sections below that shardwise spells as scalars are told by a dict value.
_DEEPSPEED_ONLY = frozenset({"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
                             "steps_per_print", "tensorboard", "csv_monitor", "wandb", "bfloat16", "amp",
                             "activation_checkpointing", "autotuning", "prescale_gradients",
                             "gradient_predivide_factor", "zero_allow_untested_optimizer", "communication_data_type"})
_DICT_SECTIONS = frozenset({"fp16", "bf16", "flops_profiler", "comms_logger", "pipeline"})

# Top-level keys shardwise has no counterpart for, and why.
_UNHONOURED = {
    "amp": "NVIDIA apex AMP is not used; set bf16 or fp16 instead",
    "pipeline": "pipelines come from pipeline_parallel_degree with sw.DistributedModel; checkpoint stages with "
                "sw.set_activation_checkpointing",
    "autotuning": "`shardwise plan` ranks the layouts by predicted memory and step time instead",
    "prescale_gradients": "gradients are averaged in fp32 by one reduction per bucket or sharding unit",
    "gradient_predivide_factor": "gradients are averaged in fp32 by one reduction per bucket or sharding unit",
    "communication_data_type": "gradients are reduced in fp32 (MiCS's cross-group reduction: "
                               "cross_group_reduce_dtype)",
    "sparse_gradients": "gradients are reduced dense",
    "memory_breakdown": "`shardwise plan` predicts memory by category",
    "dump_state": "the validated config is written to the run directory's config.json",
}
_ALWAYS_FSDP = "ZeRO-2/3 run on FSDP2, which always does this"


@dataclass
class Translation:
    """The shardwise keys, where each came from, and the DeepSpeed keys it cannot honour with why."""

    config: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    ignored: list[tuple[str, str]] = field(default_factory=list)

    def set(self, key: str, value: Any, origin: str) -> None:
        self.config[key] = value
        self.origin[key] = origin

    def ignore(self, key: str, why: str) -> None:
        self.ignored.append((key, why))

    def always(self, key: str, value: Any, expected: Any, why: str) -> None:
        """A key honoured because shardwise always behaves as `expected`; any other value is listed."""
        if value != expected:
            self.ignore(key, f"{why}; {value!r} cannot be honoured")


def is_deepspeed(data: Mapping[str, Any]) -> bool:
    """True for a DeepSpeed config: a key only DeepSpeed has, or `fp16`/`bf16`/... written as DeepSpeed's dict."""
    return any(key in _DEEPSPEED_ONLY or (key in _DICT_SECTIONS and isinstance(value, Mapping))
               for key, value in data.items())


def _enabled(section: Any) -> bool:
    return bool(section.get("enabled", False)) if isinstance(section, Mapping) else bool(section)


def _rest(t: Translation, name: str, section: Mapping[str, Any], used: tuple[str, ...], why: str) -> None:
    """List the keys of `section` not in `used` with one reason."""
    for key in section:
        if key not in used:
            t.ignore(f"{name}.{key}", why)


def _fp16(t: Translation, section: Mapping[str, Any]) -> None:
    """fp16 and DeepSpeed's loss scaler: loss_scale 0 is dynamic, with DeepSpeed's defaults for what is unset."""
    if not _enabled(section):
        return
    t.set("fp16", True, "fp16.enabled")
    static = section.get("loss_scale", 0)
    if static:
        t.set("loss_scale", static, "fp16.loss_scale")
    else:
        t.set("dynamic_loss_args", {
            "init_scale": 2.0 ** section.get("initial_scale_power", 16),
            "scale_window": section.get("loss_scale_window", 1000),
            "delayed_shift": section.get("hysteresis", 2),
            "min_scale": section.get("min_loss_scale", 1),
            "consecutive_hysteresis": section.get("consecutive_hysteresis", False),
        }, "fp16.initial_scale_power, loss_scale_window, hysteresis, min_loss_scale, consecutive_hysteresis")
    _rest(t, "fp16", section, ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                               "min_loss_scale", "consecutive_hysteresis"),
          "the model's fp16 parameters, fp32 master weights and autocast follow the fp16 key alone")


def _bf16(name: str) -> Callable[[Translation, Mapping[str, Any]], None]:
    def translate(t: Translation, section: Mapping[str, Any]) -> None:
        if _enabled(section):
            t.set("bf16", True, f"{name}.enabled")
        _rest(t, name, section, ("enabled",), "bf16 keeps fp32 master weights and reduces gradients in fp32")
    return translate


def _zero(t: Translation, section: Mapping[str, Any]) -> None:
    """ZeRO stage and options: the stage and optimizer offload are honoured; FSDP2 does the rest its own way."""
    if "stage" in section:
        t.set("zero_stage", section["stage"], "zero_optimization.stage")
    offload = section.get("offload_optimizer")
    if isinstance(offload, Mapping):
        device = offload.get("device", "none")
        if device == "cpu":
            t.set("offload_optimizer_state", True, "zero_optimization.offload_optimizer.device")
        elif device != "none":
            t.ignore("zero_optimization.offload_optimizer.device", f"{device!r}: only host memory (cpu) is built")
        _rest(t, "zero_optimization.offload_optimizer", offload, ("device",),
              "host offload keeps its buffers as FSDP2's CPUOffloadPolicy does")
    for key, value in section.items():
        if key in ("stage", "offload_optimizer"):
            continue
        if key in ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions"):
            t.always(f"zero_optimization.{key}", value, True, _ALWAYS_FSDP)
        elif key == "offload_param":
            t.ignore("zero_optimization.offload_param", "parameters go to host memory with the optimizer state "
                     "(offload_optimizer with device cpu) under ZeRO-3")
        elif key.endswith("bucket_size") or key.startswith("stage3_"):
            t.ignore(f"zero_optimization.{key}", "FSDP2 gathers and reduces one sharding unit at a time; size the "
                     "units with auto_wrap_min_params")
        else:
            t.ignore(f"zero_optimization.{key}", "no counterpart in shardwise's ZeRO (FSDP2 and ZeRO-1)")


def _switch(target: str, why: str) -> Callable[[Translation, Mapping[str, Any]], None]:
    """A section whose `enabled` turns on the shardwise key `target`; its other keys are listed with `why`."""
    def translate(t: Translation, section: Any) -> None:
        t.set(target, _enabled(section), f"{target}.enabled" if isinstance(section, Mapping) else target)
        if isinstance(section, Mapping):
            _rest(t, target, section, ("enabled",), why)
    return translate


def _monitor(sink: str) -> Callable[[Translation, Mapping[str, Any]], None]:
    """tensorboard / csv_monitor / wandb: one more metrics sink; their output paths become metrics_dir."""
    name = {"tensorboard": "tensorboard", "csv": "csv_monitor", "wandb": "wandb"}[sink]

    def translate(t: Translation, section: Mapping[str, Any]) -> None:
        if not _enabled(section):
            return
        sinks = t.config.get("metrics_sinks", [])
        t.set("metrics_sinks", [*sinks, sink], ", ".join(filter(None, (t.origin.get("metrics_sinks"), name))))
        used = ["enabled"]
        if "output_path" in section:
            used += ["output_path", "job_name"]
            path = os.path.join(section["output_path"], section.get("job_name", ""))
            if t.config.get("metrics_dir", path) != path:
                t.ignore(f"{name}.output_path", f"every sink writes to one metrics_dir, {t.config['metrics_dir']}")
            elif "metrics_dir" not in t.config:
                t.set("metrics_dir", path, f"{name}.output_path/job_name")
        if sink == "wandb" and "project" in section:
            used.append("project")
            t.set("wandb_project", section["project"], "wandb.project")
        _rest(t, name, section, tuple(used), "not passed to the sink")
    return translate


def _activation_checkpointing(t: Translation, section: Mapping[str, Any]) -> None:
    if section.get("cpu_checkpointing"):
        t.set("offload_activations", True, "activation_checkpointing.cpu_checkpointing")
    _rest(t, "activation_checkpointing", section, ("cpu_checkpointing",),
          "shardwise recomputes the modules sw.set_activation_checkpointing marks, with torch.utils.checkpoint")


def _renamed(target: str) -> Callable[[Translation, Any, str], None]:
    def translate(t: Translation, value: Any, key: str) -> None:
        t.set(target, value, key)
    return translate


def _clipping(t: Translation, value: Any, key: str) -> None:
    if value:  # DeepSpeed's 0.0 is no clipping, shardwise's unset
        t.set("gradient_clipping", value, key)


_SECTIONS: dict[str, Callable[[Translation, Mapping[str, Any]], None]] = {
    "fp16": _fp16, "bf16": _bf16("bf16"), "bfloat16": _bf16("bfloat16"), "zero_optimization": _zero,
    "flops_profiler": _switch("flops_profiler", "FLOPs are counted for the whole step with torch's "
                              "FlopCounterMode; no per-module report"),
    "comms_logger": _switch("comms_logger", "every collective is logged per process group"),
    "tensorboard": _monitor("tensorboard"), "csv_monitor": _monitor("csv"), "wandb": _monitor("wandb"),
    "activation_checkpointing": _activation_checkpointing,
}
_VALUES: dict[str, Callable[[Translation, Any, str], None]] = {
    "gradient_accumulation_steps": _renamed("microbatches"), "steps_per_print": _renamed("metrics_interval"),
    "gradient_clipping": _clipping,
    **{key: _renamed(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "optimizer",
                                      "scheduler", "wall_clock_breakdown")},
}


def translate(data: Mapping[str, Any]) -> Translation:
    """The shardwise keys a DeepSpeed config asks for; shardwise's own keys beside them pass as they are."""
    t = Translation()
    own = set(field_names())
    for key, value in data.items():
        if key in _SECTIONS and isinstance(value, Mapping):
            _SECTIONS[key](t, value)
        elif key in _VALUES:
            _VALUES[key](t, value, key)
        elif key == "zero_allow_untested_optimizer":
            t.always(key, value, True, "any torch optimizer works under every ZeRO stage")
        elif key in _UNHONOURED:
            t.ignore(key, _UNHONOURED[key])
        elif key in own:
            t.set(key, value, key)
        else:
            t.ignore(key, "not a DeepSpeed key shardwise translates")
    return t


def as_distribution(data: Mapping[str, Any]) -> Distribution:
    """The translation in the form every config source ends in (sources.py)."""
    t = translate(data)
    return Distribution(t.config, ignored=t.ignored)


def describe(t: Translation) -> str:
    """check-config's section: each shardwise key with the DeepSpeed key(s) it came from, then what is not
    honoured and why."""
    lines = ["DeepSpeed config, translated:"]
    lines += [f"  {key} = {value!r}    <- {t.origin[key]}" for key, value in t.config.items()]
    if t.ignored:
        lines.append("not honoured:")
        lines += [f"  {key}: {why}" for key, why in t.ignored]
    return "\n".join(lines)
