"""shardwise: train large PyTorch models across devices and nodes by changing a config.

    import shardwise as sw
    sw.init({"sharded_data_parallel_degree": 2})
    model = sw.DistributedModel(build_model())
    optimizer = sw.DistributedOptimizer(torch.optim.AdamW(model.parameters()))
"""

from .api.data import data_loader
from .api.model import DistributedModel
from .api.optimizer import DistributedOptimizer
from .api.step import StepOutput, step
from .config import ConfigError, ShardwiseConfig
from .parallel.checkpointing import apply_activation_checkpointing as set_activation_checkpointing
from .runtime.agreement import ConfigMismatchError
from .runtime.init import init, shutdown
from .runtime.ranks import (
    dp_rank, dp_size, get_dp_process_group, get_pp_process_group, get_rdp_process_group, get_tp_process_group,
    get_world_process_group, local_rank, local_size, pp_rank, pp_size, rank, rdp_rank, rdp_size, size, tp_rank,
    tp_size,
)
from .runtime.state import is_initialized

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "ConfigMismatchError", "DistributedModel", "DistributedOptimizer", "ShardwiseConfig", "StepOutput",
    "data_loader", "dp_rank", "dp_size", "get_dp_process_group", "get_pp_process_group", "get_rdp_process_group",
    "get_tp_process_group", "get_world_process_group", "init", "is_initialized", "local_rank", "local_size",
    "pp_rank", "pp_size", "rank", "rdp_rank", "rdp_size", "set_activation_checkpointing", "shutdown", "size", "step",
    "tp_rank", "tp_size",
]
