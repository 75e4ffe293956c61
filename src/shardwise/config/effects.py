"""Settings that change nothing in the layout the rest of the config chooses.

Such a key is valid, but a user who set it believes it did something; `init`
warns and `check-config` prints the same notice, naming each key and what it
needs. Pure (no torch), so the planner can use it too. What only the script
or the model decides, `DistributedModel` names with the same notice
(`delayed_parameter_initialization` for a model not built under
`sw.delay_param_initialization()`, `auto_wrap_min_params` for models with known
blocks); `ddp: false` is refused with several replicas and inert with one. SMP's
keys without a counterpart here are named with what shardwise does instead.
"""

from __future__ import annotations

from typing import Iterator, Optional

from .decisions import cross_group_possible
from .schema import ShardwiseConfig
from .smp_only import INSTEAD, OFFLOAD_PACING, SHARDING_INSTEAD

# SMP's pipeline-partition keys that only the module-graph cut reads (graph_cut.py).
PARTITION_KEYS = ("memory_weight",)
PIPELINE_KEYS = ("pipeline_schedule", "virtual_stages", "pipeline_balance", "pipeline_split_points",
                 "pipeline_cut", "active_microbatches", "auto_partition", "default_partition", *PARTITION_KEYS)


class IneffectiveSettingsWarning(UserWarning):
    """A config sets keys that have no effect in its layout."""


def changed(config: ShardwiseConfig, key: str) -> bool:
    return getattr(config, key) != ShardwiseConfig.model_fields[key].default


def _key(name: str) -> str:
    """The key as a config writes it (SMP's internal keys keep their leading `_`)."""
    return ShardwiseConfig.model_fields[name].alias or name


def _pipeline(c: ShardwiseConfig) -> Iterator[tuple[str, str]]:
    if c.pipeline_parallel_degree == 1:
        yield from ((key, "needs pipeline_parallel_degree > 1") for key in PIPELINE_KEYS if changed(c, key))
        return
    if not c.auto_partition and changed(c, "pipeline_balance"):
        yield "pipeline_balance", "auto_partition false places every block by hand or on default_partition"
    elif c.pipeline_split_points is not None and changed(c, "pipeline_balance"):
        yield "pipeline_balance", "pipeline_split_points fixes the cut"
    if c.auto_partition and changed(c, "default_partition"):
        yield "default_partition", "places the modules not placed by hand only when auto_partition is false"
    if c.active_microbatches is not None and c.pipeline_round == c.model_copy(
            update={"active_microbatches": None}).pipeline_round:
        yield "active_microbatches", (f"{c.pipeline_schedule} runs rounds of {c.pipeline_round} microbatches "
                                      "with or without it")
    if c.pipeline_cut == "blocks":
        yield from ((key, "the block-list cut balances by pipeline_balance; this key steers the module-graph cut "
                     "(pipeline_cut graph)") for key in PARTITION_KEYS if changed(c, key))
    elif c.pipeline_cut == "graph":
        yield from ((key, "the module-graph cut balances by memory_weight") for key in ("pipeline_balance",
                                                                                        "pipeline_split_points")
                    if changed(c, key))


def _others(c: ShardwiseConfig) -> Iterator[tuple[str, str]]:
    if c.tensor_parallel_degree == 1 and c.prescaled_batch:
        yield "prescaled_batch", "needs tensor_parallel_degree > 1"
    if not c.offload_activations and changed(c, "activation_loading_horizon"):
        yield "activation_loading_horizon", "needs offload_activations"
    if c.offload_optimizer_state and c.effective_zero_stage == 0:
        yield "offload_optimizer_state", "needs shard_optimizer_state or zero_stage 1, 2 or 3"
    if c.effective_zero_stage < 2 and changed(c, "auto_wrap_min_params"):
        yield "auto_wrap_min_params", "sizes ZeRO-2/3 sharding units; needs zero_stage 2 or 3"
    for key in ("cross_group_reduce_dtype", "cross_group_overlap"):
        if changed(c, key) and not cross_group_possible(c):
            yield key, ("needs MiCS without a pipeline: sharded_data_parallel_degree > 1 and smaller "
                        "than the data-parallel degree, pipeline_parallel_degree 1")
    if c.fp16 and changed(c, "non_finite_gradients"):
        yield "non_finite_gradients", "fp16's loss scaler skips every step with inf/nan gradients and lowers the scale"
    if not c.fp16:
        yield from ((key, "needs fp16") for key in ("loss_scale", "dynamic_loss_args") if changed(c, key))
    elif c.loss_scale and c.dynamic_loss_args is not None:
        yield "dynamic_loss_args", "loss_scale > 0 keeps the scale fixed"
    if c.non_finite_gradients != "stop" and changed(c, "non_finite_stop_after"):
        yield "non_finite_stop_after", "needs non_finite_gradients: stop"
    if c.checkpoint_dir is None and changed(c, "preemption_grace_seconds"):
        yield "preemption_grace_seconds", "needs checkpoint_dir, where a preempted job saves"
    # SMP's default "memory" is named only when given: it is what SMP's own split layers did by default.
    given = "optimize" in c.model_fields_set
    if c.tensor_parallel_degree > 1 and given and c.optimize == "memory" and not c.sequence_parallel:
        yield "optimize", ("tensor-parallel ranks keep whole activations between split layers; sequence_parallel "
                           "shards them")


# What the metrics recorder does only on recorded steps (observe/), or only with another key.
RECORDING_KEYS = ("metrics_sinks", "metrics_dir", "wall_clock_breakdown", "comms_logger", "flops_profiler",
                  "peak_tflops", "progress_bar", "wandb_project")


def _metrics(c: ShardwiseConfig) -> Iterator[tuple[str, str]]:
    if c.metrics_interval == 0:
        yield from ((key, "needs metrics_interval >= 1") for key in RECORDING_KEYS if changed(c, key))
        return
    if c.peak_tflops is not None and not c.flops_profiler:
        yield "peak_tflops", "MFU needs flops_profiler"
    if c.wandb_project is not None and "wandb" not in c.metrics_sinks:
        yield "wandb_project", "needs wandb in metrics_sinks"


def _smp(c: ShardwiseConfig) -> Iterator[tuple[str, str]]:
    """SMP's keys without a counterpart here, with what shardwise does instead."""
    sharded = c.sharded_data_parallel_degree > 1
    if c.sdp_gradient_clipping is not None and not sharded:
        yield "sdp_gradient_clipping", "needs sharded_data_parallel_degree > 1; gradient_clipping clips without it"
    for name, instead in (*INSTEAD.items(), *SHARDING_INSTEAD.items()):
        if changed(c, name):
            needs_sharding = name in SHARDING_INSTEAD and not sharded
            yield _key(name), "needs sharded_data_parallel_degree > 1" if needs_sharding else instead
    yield from ((_key(name), instead if c.offload_activations else "needs offload_activations")
                for name, instead in OFFLOAD_PACING.items() if changed(c, name))


def ineffective_on_device(config: ShardwiseConfig, device_type: str) -> list[tuple[str, str]]:
    """Settings that change nothing on this device: offloading to host memory from a CPU, whose memory it is."""
    if device_type != "cpu":
        return []
    found = []
    if config.offload_optimizer_state and config.effective_zero_stage >= 1:
        found.append(("offload_optimizer_state", "the device is the CPU, whose memory is the host memory: "
                                                 "optimizer states stay where they are"))
    if config.offload_activations:
        found.append(("offload_activations", "the device is the CPU, whose memory is the host memory: "
                                             "checkpointed activations stay where they are"))
    return found


def ineffective_settings(config: ShardwiseConfig) -> list[tuple[str, str]]:
    """(key, what it needs) for every key set away from its default that has no effect here."""
    return [*_pipeline(config), *_others(config), *_metrics(config), *_smp(config)]


def ineffective_notice(config: ShardwiseConfig) -> Optional[str]:
    """One line naming every such key and why, or None when every setting counts."""
    return notice_of(ineffective_settings(config))


def notice_of(found: list[tuple[str, str]]) -> Optional[str]:
    """The notice for (key, what it needs) pairs, or None for none: also for what only the model tells."""
    if not found:
        return None
    return ("these settings have no effect in this layout: " + ", ".join(f"{key} ({why})" for key, why in found)
            + "; fix: remove them, or set what they need")
