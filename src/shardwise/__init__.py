"""shardwise: train large PyTorch models across devices and nodes by changing a config.

    import shardwise as sw
    sw.init({"sharded_data_parallel_degree": 2})
    model = sw.DistributedModel(build_model())
    optimizer = sw.DistributedOptimizer(torch.optim.AdamW(model.parameters()))

Names are resolved on first use, so `import shardwise.planner` (or `shardwise
plan`) never loads torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "data_loader": "api.data",
    "delay_param_initialization": "api.delayed_init",
    "DistributedModel": "api.model",
    "DistributedOptimizer": "api.optimizer",
    "StepOutput": "api.step",
    "step": "api.step",
    "save_checkpoint": "checkpoint.save",
    "resume_from_checkpoint": "checkpoint.resume",
    "CheckpointError": "checkpoint",
    "save": "checkpoint.legacy",
    "load": "checkpoint.legacy",
    "ConfigError": "config",
    "ShardwiseConfig": "config",
    "set_activation_checkpointing": "api.recompute",
    "tensor_parallelism": "parallel.tensor.marks",
    "set_tensor_parallelism": "parallel.tensor.marks",
    "tp_register": "parallel.tensor.registration",
    "tp_register_with_module": "parallel.tensor.registration",
    "register_experts": "parallel.experts",
    "register_experts_with_module": "parallel.experts",
    "model_creation": "nn.creation",
    "partition": "parallel.pipeline.placement",
    "set_partition": "parallel.pipeline.placement",
    "ConfigMismatchError": "runtime.agreement",
    "NonFiniteGradientError": "runtime.non_finite",
    "ControlFlowMismatchError": "runtime.control_flow",
    "init": "runtime.init",
    "shutdown": "runtime.init",
    "is_initialized": "runtime.state",
    "configured_optimizer": "api.configured",
    "configured_scheduler": "api.configured",
    "configured_batch_size": "api.configured",
    "Job": "launcher.job",
    "metrics": "observe",
    "progress": "observe.recorder",
    **{name: "runtime.ranks" for name in (
        "rank", "local_rank", "size", "local_size", "dp_rank", "dp_size", "tp_rank", "tp_size", "pp_rank", "pp_size",
        "rdp_rank", "rdp_size", "get_world_process_group", "get_dp_process_group", "get_rdp_process_group",
        "get_tp_process_group", "get_pp_process_group")},
    **{name: "runtime.ranks" for name in (
        "mp_rank", "mp_size", "get_mp_process_group", "get_mp_group", "get_dp_group", "get_rdp_group", "get_tp_group",
        "get_pp_group", "is_tracing")},
    **{name: "runtime.comms" for name in (
        "CommGroup", "RankType", "WORLD", "MP_GROUP", "DP_GROUP", "RDP_GROUP", "TP_GROUP", "PP_GROUP", "broadcast",
        "send", "recv_from", "allgather", "barrier", "dp_barrier", "mp_barrier")},
}
# SMP v1's submodules, reached as attributes (`smp.nn.FusedLayerNorm`) as well as by import.
_SUBMODULES = {"nn", "amp", "optimizers", "utils", "patches"}
# SMP's tensor-parallel marks replace a marked Hugging Face model by SMP's stand-in (`nn.huggingface` registers them):
# naming one of these loads the stand-ins too, so the core never imports the SMP front end.
_MARKS = {"tensor_parallelism", "set_tensor_parallelism", "tp_register", "tp_register_with_module", "DistributedModel"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
        globals()[name] = value
        return value
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
    if name in _MARKS:
        importlib.import_module(".nn.huggingface", __name__)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
