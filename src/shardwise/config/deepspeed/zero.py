"""DeepSpeed's `zero_optimization` section, key by key (DeepSpeedZeroConfig of 0.19.8, its aliases and the keys of
earlier releases), into shardwise's ZeRO: FSDP2 for stages 2 and 3 and MiCS, shardwise's own ZeRO-1."""

from __future__ import annotations

from typing import Any, Mapping

from .translation import Translation, check_keys, rest

_FSDP2 = "ZeRO-2/3 run on FSDP2, which always does this"
_UNITS = "FSDP2 gathers and reduces one sharding unit at a time; size the units with auto_wrap_min_params"
_PIN = "host offload keeps its buffers as FSDP2's CPUOffloadPolicy does (pinned)"
_TUNING = ("shardwise's host offload keeps the whole optimizer state in host memory and steps it there (FSDP2's "
           "CPUOffloadPolicy under ZeRO-2/3); DeepSpeed's offload engine and its settings are not used")
_QUANTIZED = ("ZeRO++'s quantized communication is not built: all-gathers carry the compute dtype and gradients "
              "are reduced in fp32")
_HIERARCHICAL = ("each partition group's parameters are all-gathered by one torch collective over the group, which "
                 "stays inside a node when the group fits in one; across nodes the collective library chooses the "
                 "route, not a two-level gather")
_OFFLOAD_PARAM = ("FSDP2's CPUOffloadPolicy keeps the parameter shards, their gradients and the optimizer state in "
                  "host memory together, and the optimizer steps there (offload_optimizer_state)")
_SAVED_WHOLE = ("a sharded model's weights are gathered whole when saved: model.state_dict() is the whole model, "
                "and `shardwise export` writes consolidated weights")

# Keys always true in shardwise: listed only when false.
_ALWAYS_TRUE = {"overlap_comm": _FSDP2, "contiguous_gradients": _FSDP2, "reduce_scatter": _FSDP2,
                "allgather_partitions": _FSDP2, "use_multi_rank_bucket_allreduce": _UNITS,
                "load_from_fp32_weights": "checkpoints keep the fp32 master weights and load them",
                "compute_grad_norm": "the gradient norm is computed whenever the step clips or records it",
                "ignore_unused_parameters": "a parameter without a gradient is left as it is, as in one process"}
# Keys off in shardwise: listed only when true.
_ALWAYS_FALSE = {"legacy_stage1": "shardwise's ZeRO-1 is its own",
                 "round_robin_gradients": "FSDP2 copies gradient shards to the host per sharding unit",
                 "parameter_alignment": "FSDP2 lays out each unit's parameters itself",
                 "zero_quantized_weights": _QUANTIZED, "zero_quantized_gradients": _QUANTIZED,
                 "zero_quantized_nontrainable_weights": _QUANTIZED,
                 "pipeline_loading_checkpoint": "checkpoints load at any layout, pipelines included",
                 "enable_sanity_checks": "shardwise's own checks: replica_check_interval, "
                                         "control_flow_check_interval",
                 "log_trace_cache_warnings": "FSDP2 keeps no trace cache",
                 "save_muon_momentum_buffer_in_memory": "Muon is not built"}
# Tuning knobs of DeepSpeed's own machinery, listed whatever their value.
_KNOBS = {**{key: _UNITS for key in (
    "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "param_persistence_threshold",
    "model_persistence_threshold", "max_live_parameters", "max_reuse_distance", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential")},
    "sub_group_size": "the optimizer steps each rank's shards whole",
    "memory_efficient_linear": "FSDP2 frees each unit's gathered parameters after its forward and gathers them again "
                               "for backward, whichever linear the model uses",
    "override_module_apply": "FSDP2 gathers a unit's parameters for its forward, not for nn.Module.apply",
    "leaf_module": "FSDP2's units are the model's blocks (or auto_wrap_min_params)",
    "zenflow": "ZenFlow's stall-free offloading is not built; offload_optimizer_state steps on the host each step",
    "zeropp_loco_param": "removed from DeepSpeed (0.19 refuses the key); LoCo error feedback is not built",
    "elastic_checkpoint": "shardwise's checkpoints reshard to any layout on load"}
_ALIASES = {f"stage3_{key}": key for key in (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential")}
_OFFLOADS = ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param", "cpu_offload_params",
             "cpu_offload_use_pin_memory")
_OWN = ("stage", "mics_shard_size", "mics_hierarchical_params_gather", "zero_hpz_partition_size",
        "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")
ZERO_KEYS = (*_OWN, *_OFFLOADS, *_ALWAYS_TRUE, *_ALWAYS_FALSE, *_KNOBS, *_ALIASES)
OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                          "fast_init", "ratio", "super_offload", "cpuadam_cores_perc")
OFFLOAD_PARAM_KEYS = ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")


def _hpz(t: Translation, section: Any, stage: Any) -> None:
    """ZeRO++'s secondary partition: DeepSpeed reads 0 and 1 as none, and only stage 3 uses one."""
    size = section.get("zero_hpz_partition_size", 1)
    if size in (0, 1):
        return
    path = "zero_optimization.zero_hpz_partition_size"
    if stage != 3:
        t.ignore(path, f"{size}: only ZeRO-3 keeps a secondary partition of the parameters (DeepSpeed uses it at "
                       "stage 3 only)")
        return
    t.set("zero_hpz_partition_size", size, path)


def translate_zero(t: Translation, section: Any) -> None:
    """The stage, MiCS, hpZ and offloading are honoured; FSDP2 does the rest its own way (each key listed)."""
    name = "zero_optimization"
    if isinstance(section, bool):  # DeepSpeed's first form: true is ZeRO-1
        t.set("zero_stage", 1 if section else 0, name)
        return
    if not isinstance(section, Mapping):
        t.problem(name, section, "must be a dict of ZeRO settings", 'write e.g. "zero_optimization": {"stage": 2}')
        return
    if not check_keys(t, name, section, ZERO_KEYS):
        return
    stage = section.get("stage", 0)
    if "stage" in section:
        t.set("zero_stage", stage, f"{name}.stage")
    _mics(t, section, stage)
    _hpz(t, section, stage)
    _offload(t, section, stage)
    for key, value in section.items():
        path = f"{name}.{key}"
        key = _ALIASES.get(key, key)
        if key in _ALWAYS_TRUE:
            t.always(path, value, True, _ALWAYS_TRUE[key])
        elif key in _ALWAYS_FALSE:
            t.always(path, value, False, _ALWAYS_FALSE[key])
        elif key in _KNOBS:
            t.ignore(path, _KNOBS[key])
        elif key in ("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save") and value:
            t.note(path, _SAVED_WHOLE)


def _mics(t: Translation, section: Mapping[str, Any], stage: Any) -> None:
    """MiCS as DeepSpeed's releases that had it read it: partition groups of mics_shard_size ranks under stage 3,
    off when it is -1 (their default) or 0. DeepSpeed 0.19 removed MiCS and refuses the keys."""
    size = section.get("mics_shard_size", -1)
    path = "zero_optimization.mics_shard_size"
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        if stage == 3:
            t.set("sharded_data_parallel_degree", size, path)
        else:
            t.ignore(path, f"DeepSpeed builds MiCS under stage 3 only, and ignores it under stage {stage!r}")
    elif not (isinstance(size, int) and size <= 0):
        t.problem(path, size, "must be a whole number: the ranks of a MiCS partition group, or -1 for no MiCS",
                  "write e.g. 8, or -1")
    if section.get("mics_hierarchical_params_gather"):
        if "sharded_data_parallel_degree" in t.config:
            t.note("zero_optimization.mics_hierarchical_params_gather", _HIERARCHICAL)
        else:
            t.ignore("zero_optimization.mics_hierarchical_params_gather", "needs MiCS (mics_shard_size > 0, stage 3)")


def _offload(t: Translation, section: Mapping[str, Any], stage: Any) -> None:
    """offload_optimizer and offload_param, and the keys they replaced (cpu_offload, cpu_offload_param(s)), as
    DeepSpeed maps them: cpu_offload is offload_optimizer on cpu, cpu_offload_param(s) offload_param on cpu."""
    name = "zero_optimization"
    optimizer, param = section.get("offload_optimizer"), section.get("offload_param")
    legacy_param = next((k for k in ("cpu_offload_param", "cpu_offload_params") if k in section), None)
    for old, new, given in (("cpu_offload", "offload_optimizer", optimizer), (legacy_param, "offload_param", param)):
        if old in section and given is not None:
            t.problem(f"{name}.{old}", section[old], f"is the old spelling of {new}, which is given too (DeepSpeed "
                      "refuses both together)", f"keep {new} only")
    for key in ("cpu_offload", legacy_param, "cpu_offload_use_pin_memory"):
        if key in section and not isinstance(section[key], bool):
            t.problem(f"{name}.{key}", section[key], "must be true or false", "write true or false")
            return
    for key, given in (("offload_optimizer", optimizer), ("offload_param", param)):
        if given is not None and not isinstance(given, Mapping):
            t.problem(f"{name}.{key}", given, "must be a dict of offload settings", f'write e.g. "{key}": '
                      '{"device": "cpu"}')
            return
    if section.get("cpu_offload") and optimizer is None:
        optimizer = {"device": "cpu"}
        t.set("offload_optimizer_state", True, f"{name}.cpu_offload")
    elif isinstance(optimizer, Mapping) and check_keys(t, f"{name}.offload_optimizer", optimizer,
                                                        OFFLOAD_OPTIMIZER_KEYS):
        _device(t, optimizer, f"{name}.offload_optimizer", "offload_optimizer_state")
        rest(t, f"{name}.offload_optimizer", optimizer, ("device", "pin_memory"), _TUNING)
    if legacy_param and section[legacy_param] and param is None:
        param = {"device": "cpu"}
        _param(t, stage, f"{name}.{legacy_param}")
    elif isinstance(param, Mapping) and check_keys(t, f"{name}.offload_param", param, OFFLOAD_PARAM_KEYS):
        if param.get("device", "none") == "cpu":
            _param(t, stage, f"{name}.offload_param.device")
        elif param.get("device", "none") != "none":
            t.ignore(f"{name}.offload_param.device", f"{param['device']!r}: only host memory (cpu) is built")
        rest(t, f"{name}.offload_param", param, ("device", "pin_memory"), _TUNING)
    for offload, where in ((optimizer, "offload_optimizer"), (param, "offload_param")):
        if isinstance(offload, Mapping) and "pin_memory" in offload:
            t.always(f"{name}.{where}.pin_memory", offload["pin_memory"], True, _PIN)
    if "cpu_offload_use_pin_memory" in section:  # DeepSpeed maps it nowhere: the offloads' own pin_memory decides
        t.always(f"{name}.cpu_offload_use_pin_memory", section["cpu_offload_use_pin_memory"], True, _PIN)


def _device(t: Translation, offload: Mapping[str, Any], path: str, target: str) -> None:
    device = offload.get("device", "none")
    if device == "cpu":
        t.set(target, True, f"{path}.device")
    elif device != "none":
        t.ignore(f"{path}.device", f"{device!r}: only host memory (cpu) is built")


def _param(t: Translation, stage: Any, origin: str) -> None:
    """Parameters to host memory: DeepSpeed does it under stage 3 only; FSDP2 moves the optimizer state with them."""
    if stage != 3:
        t.ignore(origin, f"DeepSpeed offloads parameters under stage 3 only, and ignores it under stage {stage!r}")
        return
    if t.config.get("offload_optimizer_state") is not True:
        t.set("offload_optimizer_state", True, origin)
    t.note(origin, _OFFLOAD_PARAM)
