"""DeepSpeed's sections and values other than zero_optimization, each into the shardwise key that does the same."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from ..blocks import optimizer_type
from .autotuning import translate_autotuning
from .keys import BF16_KEYS, COMMS_LOGGER_KEYS, FP16_KEYS, MONITOR_KEYS
from .translation import Translation, check_keys, enabled, rest

Section = Callable[[Translation, Mapping[str, Any]], None]
_NOT_READ = "DeepSpeed itself reads no such key here"


def _fp16(t: Translation, section: Mapping[str, Any]) -> None:
    """fp16 and DeepSpeed's loss scaler: loss_scale 0 is dynamic, with DeepSpeed's defaults for what is unset."""
    if not check_keys(t, "fp16", section, FP16_KEYS) or not enabled(section):
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
    rest(t, "fp16", section, ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                              "min_loss_scale", "consecutive_hysteresis"),
         "the model's fp16 parameters, fp32 master weights and autocast follow the fp16 key alone")


def _bf16(name: str) -> Section:
    def translate(t: Translation, section: Mapping[str, Any]) -> None:
        if not check_keys(t, name, section, BF16_KEYS) or not enabled(section):
            return
        t.set("bf16", True, f"{name}.enabled")
        # DeepSpeed 0.19's bf16 skips a step whose gradients hold inf/nan unless check_grad_overflow is false
        check = section.get("check_grad_overflow", section.get("check_overflow", True))
        if enabled(check) and "non_finite_gradients" not in t.config:  # the config's own key wins
            t.set("non_finite_gradients", "skip", f"{name}.check_grad_overflow (DeepSpeed's default true)"
                  if "check_grad_overflow" not in section else f"{name}.check_grad_overflow")
        used = ["enabled", "check_grad_overflow", "check_overflow"]
        if enabled(section.get("bf16_master_weights_and_grads", False)):
            t.set("bf16_master_weights_and_grads", True, f"{name}.bf16_master_weights_and_grads")
            used += ["bf16_master_weights_and_grads"]
            if enabled(section.get("bf16_optimizer_states", False)):
                used += ["bf16_optimizer_states"]  # pure bf16's states are in the parameters' dtype anyway
        rest(t, name, section, used, "without bf16_master_weights_and_grads, bf16 keeps fp32 master weights and "
             "optimizer states and reduces gradients in fp32; with it, the states follow the bf16 parameters")
    return translate


def _switch(target: str, why: str) -> Section:
    """A section whose `enabled` turns on the shardwise key `target`; its other keys are listed with `why`."""
    def translate(t: Translation, section: Mapping[str, Any]) -> None:
        if target == "comms_logger" and not check_keys(t, target, section, COMMS_LOGGER_KEYS):
            return
        t.set(target, enabled(section), f"{target}.enabled")
        rest(t, target, section, ("enabled",), why)
    return translate


def _monitor(sink: str, name: str) -> Section:
    """tensorboard / csv_monitor / wandb: one more metrics sink; their output paths become metrics_dir."""
    def translate(t: Translation, section: Mapping[str, Any]) -> None:
        if not check_keys(t, name, section, MONITOR_KEYS[name]) or not enabled(section):
            return
        sinks = t.config.get("metrics_sinks", [])
        t.set("metrics_sinks", [*sinks, sink], ", ".join(filter(None, (t.origin.get("metrics_sinks"), name))))
        used = ["enabled"]
        if "output_path" in section:
            used += ["output_path", "job_name"]
            path = os.path.join(section["output_path"], section.get("job_name", "DeepSpeedJobName"))
            if t.config.get("metrics_dir", path) != path:
                t.ignore(f"{name}.output_path", f"every sink writes to one metrics_dir, {t.config['metrics_dir']}")
            elif "metrics_dir" not in t.config:
                t.set("metrics_dir", path, f"{name}.output_path/job_name")
        if sink == "wandb" and "project" in section:
            used.append("project")
            t.set("wandb_project", section["project"], "wandb.project")
        rest(t, name, section, used, "not passed to the sink")
    return translate


def _activation_checkpointing(t: Translation, section: Mapping[str, Any]) -> None:
    if section.get("cpu_checkpointing"):
        t.set("offload_activations", True, "activation_checkpointing.cpu_checkpointing")
    rest(t, "activation_checkpointing", section, ("cpu_checkpointing",),
         "shardwise recomputes the modules sw.set_activation_checkpointing marks, with torch.utils.checkpoint")


def _tensor_parallel(t: Translation, section: Mapping[str, Any]) -> None:
    """AutoTP training's degree: tensor_parallel_degree, split by shardwise's own plans."""
    size = section.get("autotp_size", 0)
    if isinstance(size, int) and not isinstance(size, bool) and size > 1:
        t.set("tensor_parallel_degree", size, "tensor_parallel.autotp_size")
        t.note("tensor_parallel.autotp_size", "shardwise splits layers by its own plans (GPT-2, Llama, ViT, BERT, "
               "smp.nn modules, or a plan the script passes), not by DeepSpeed's AutoTP rules")
    rest(t, "tensor_parallel", section, ("autotp_size",), "DeepSpeed's AutoTP settings; shardwise's tensor "
         "parallelism follows tensor_parallel_degree and sequence_parallel")


def _block(key: str) -> Section:
    """optimizer / scheduler: the block as shardwise builds it (config/blocks.py checks it); DeepSpeed's optimizer
    names in any case, its `legacy_fusion` listed."""
    def translate(t: Translation, section: Mapping[str, Any]) -> None:
        block = dict(section)
        if key == "optimizer" and "legacy_fusion" in block:
            t.always("optimizer.legacy_fusion", block.pop("legacy_fusion"), False, "DeepSpeed's fused-kernel "
                     "switch; the optimizers are torch's")
        if "type" not in block:
            t.ignore(key, "without a type DeepSpeed builds none either; the script's own is used")
            return
        if key == "optimizer":
            block["type"] = optimizer_type(block["type"])
            params = block.get("params", {}) if isinstance(block.get("params"), Mapping) else {}
            if params.get("fp32_optimizer_states") is False:
                t.ignore("optimizer.params.fp32_optimizer_states", "optimizer states stay fp32")
        t.set(key, block, key)
    return translate


SECTIONS: dict[str, Section] = {
    "fp16": _fp16, "bf16": _bf16("bf16"), "bfloat16": _bf16("bfloat16"),
    "flops_profiler": _switch("flops_profiler", "FLOPs are counted for the whole step with torch's "
                              "FlopCounterMode; no per-module report"),
    "comms_logger": _switch("comms_logger", "every collective is logged per process group"),
    "tensorboard": _monitor("tensorboard", "tensorboard"), "csv_monitor": _monitor("csv", "csv_monitor"),
    "wandb": _monitor("wandb", "wandb"), "activation_checkpointing": _activation_checkpointing,
    "tensor_parallel": _tensor_parallel, "optimizer": _block("optimizer"), "scheduler": _block("scheduler"),
    "autotuning": translate_autotuning,
}


def _renamed(target: str) -> Callable[[Translation, Any, str], None]:
    def translate(t: Translation, value: Any, key: str) -> None:
        t.set(target, value, key)
    return translate


def _clipping(t: Translation, value: Any, key: str) -> None:
    if value != 0:  # DeepSpeed's 0.0 is no clipping, shardwise's unset
        t.set("gradient_clipping", value, key)


VALUES: dict[str, Callable[[Translation, Any, str], None]] = {
    "gradient_accumulation_steps": _renamed("microbatches"), "gradient_clipping": _clipping,
    **{key: _renamed(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print",
                                      "wall_clock_breakdown")},
}
