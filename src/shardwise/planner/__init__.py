"""The planner: per-rank memory and step time of every configuration of a model on a cluster.

Pure Python like `config` and `topology`: importing it loads neither torch nor
`torch.distributed`. Plans are dicts of the same config keys `shardwise run` reads,
checked by the same validation, laid out by the same `Layout`.

    from shardwise.planner import resolve_model, cluster_preset, plan
    best = plan(resolve_model("gpt2-10b"), cluster_preset("16xp4d.24xlarge"), global_batch=1280).best
"""

from .activations import CHECKPOINTING, block_activations, rank_activations
from .errors import PlanError
from .hardware import PRESETS as CLUSTER_PRESETS
from .hardware import ClusterSpec, DeviceSpec, Kernels, cluster_preset, custom_cluster
from .memory import MemoryBreakdown, model_state_bytes, predict_memory
from .models import PRESETS as MODEL_PRESETS
from .models import resolve_model, spec_from_builder
from .families import spec_from_hf
from .report import print_plan, to_json, write_config
from .search import Evaluation, Plan, config_dict, evaluate, plan
from .spec import ModelSpec
from .timing import StepTime, predict_step_time

__all__ = [
    "CHECKPOINTING", "CLUSTER_PRESETS", "ClusterSpec", "DeviceSpec", "Evaluation", "Kernels", "MODEL_PRESETS",
    "MemoryBreakdown", "ModelSpec", "Plan", "PlanError", "StepTime", "block_activations", "cluster_preset",
    "config_dict", "custom_cluster", "evaluate", "model_state_bytes", "plan", "predict_memory",
    "predict_step_time", "print_plan", "rank_activations", "resolve_model", "spec_from_builder", "spec_from_hf",
    "to_json", "write_config",
]
