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
import importlib.abc
import importlib.util
import sys
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
    "model_creation": "smp.nn.creation",
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
# SMP v1's submodules, reached as attributes (`smp.nn.FusedLayerNorm`) as well as by import
# (`from shardwise.nn import FusedLayerNorm`). All but `optimizers` (whose rules DeepSpeed's Lamb shares) live in
# the SMP front end, `shardwise/smp/`, and are served under SMP's paths by `_SmpPaths`.
_SMP_FRONT_END = {"nn", "amp", "utils", "patches"}
_SUBMODULES = _SMP_FRONT_END | {"optimizers"}
# SMP's tensor-parallel marks replace a marked Hugging Face model by SMP's stand-in (`nn.huggingface` registers them):
# naming one of these loads the stand-ins too, so the core never imports the SMP front end.
_MARKS = {"tensor_parallelism", "set_tensor_parallelism", "tp_register", "tp_register_with_module", "DistributedModel"}

__all__ = sorted(_EXPORTS)


class _SmpPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`shardwise.nn.huggingface.gpt2` and the like (an SMP script's `smdistributed.modelparallel.torch.nn...`
    with only the import changed) as the very module `shardwise.smp.nn.huggingface.gpt2`, loaded on first use."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        parts = fullname.split(".")
        if len(parts) > 1 and parts[0] == __name__ and parts[1] in _SMP_FRONT_END:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(f"{__name__}.smp.{spec.name.split('.', 1)[1]}")

    def exec_module(self, module: Any) -> None:
        """The module ran under its own name already."""


if not any(isinstance(finder, _SmpPaths) for finder in sys.meta_path):
    sys.meta_path.insert(0, _SmpPaths())


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
        globals()[name] = value
        return value
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
    if name in _MARKS:
        importlib.import_module(".smp.nn.huggingface", __name__)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
