"""`deepspeed.initialize`, `init_distributed` and `add_config_arguments`, with DeepSpeed's arguments.

`initialize` starts shardwise's runtime from the DeepSpeed config the first time (its layout then holds for the
process, as DeepSpeed's process groups do), wraps the model in a `DistributedModel`, builds or wraps the
optimizer and scheduler, and returns DeepSpeed's 4-tuple. A later engine in the same script (a GAN's two) joins
that runtime: its config may choose its own optimizer, scheduler and batch sizes, but not another layout.
"""

from __future__ import annotations

import argparse
import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.constants import default_pg_timeout

from ..api.configured import _torch_optimizer, build_scheduler
from ..api.model import DistributedModel
from ..api.optimizer import DistributedOptimizer
from ..config import ConfigError, ShardwiseConfig
from ..config.sources import read_deepspeed, read_file
from ..runtime import state
from ..runtime.devices import backend_for, local_device
from ..runtime.init import init as start_runtime, joined
from .engine import DeepSpeedEngine, EngineSettings

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's `--deepspeed`, `--deepspeed_config FILE` and their deprecated `--deepscale*` spellings."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: use --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: use --deepspeed_config")
    return parser


def _backend(asked: Optional[str], own: str) -> str:
    """The backend the script names, keeping what exists here: of "cpu:gloo,cuda:nccl" the pairs whose backend
    is available; a backend not available at all (the seed's 'hccl' on a GPU or CPU) gives this device's, said
    in a warning."""
    if asked is None or asked == own:
        return own
    pairs = [pair for pair in asked.split(",") if dist.is_backend_available(pair.rpartition(":")[2])]
    if pairs:
        return ",".join(pairs)
    warnings.warn(f"deepspeed.init_distributed(dist_backend={asked!r}): not available here; using {own!r}, this "
                  "device's", stacklevel=3)
    return own


def _one_process_world() -> bool:
    return "WORLD_SIZE" not in os.environ or ("MASTER_ADDR" not in os.environ and os.environ["WORLD_SIZE"] == "1")


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True,
                     timeout: timedelta = default_pg_timeout, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the launcher's world (torchrun's or `shardwise run`'s variables), or make a one-process world when
    the script runs alone; nothing when a process group exists. The backend defaults to the device's (NCCL on
    CUDA, gloo on CPU). MPI discovery is not attempted: start the ranks with `shardwise run` or torchrun."""
    if dist.is_initialized() or dist_init_required is False:
        return
    backend = _backend(dist_backend, backend_for(local_device(int(os.environ.get("LOCAL_RANK", 0)))))
    if init_method is None and _one_process_world():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank, world_size=world_size)


def _config_source(args: Any, config: Any, config_params: Any) -> Union[str, Mapping[str, Any]]:
    config = config if config is not None else config_params
    path = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if path is not None and config is not None:
        raise ValueError("deepspeed.initialize: the config is given twice, by --deepspeed_config "
                         f"({path}) and by config=; pass only one")
    source = path if path is not None else config
    if source is None:
        raise ValueError("deepspeed.initialize: no DeepSpeed config; pass --deepspeed_config FILE (parsed by "
                         "deepspeed.add_config_arguments(parser)) as args=, or config=<dict or path>")
    return source


def _config_dict(source: Union[str, os.PathLike, Mapping[str, Any]]) -> dict[str, Any]:
    return dict(source) if isinstance(source, Mapping) else read_file(source)


def _engine_config(data: Mapping[str, Any]) -> ShardwiseConfig:
    """This engine's resolved config: the runtime's when it starts here, else validated against the runtime's
    layout (a different one is refused, naming each key that differs)."""
    if not state.is_initialized():
        return start_runtime(data)
    config, problems = joined(data, ": every engine of a process shares one layout",
                              "give every engine the same parallelism, precision and ZeRO keys")
    if problems:
        raise ConfigError(problems)
    return config


def _pipeline_keys(model: nn.Module) -> dict[str, Any]:
    """A PipelineModule brings what a DeepSpeed config never holds: its stages (pipeline_parallel_degree) and
    DeepSpeed's rank order (pipe outermost), so its topology and shardwise's ranks agree."""
    return model.shardwise_config() if _is_pipeline_module(model) else {}


def _is_pipeline_module(model: nn.Module) -> bool:
    from .pipe import PipelineModule

    return isinstance(model, PipelineModule)


def _optimizer(client: Any, config: ShardwiseConfig, params: list[Any]) -> Optional[torch.optim.Optimizer]:
    """DeepSpeed's order: the client's optimizer (or its callable on the parameters), else the config's block."""
    if client is not None:
        return client if isinstance(client, torch.optim.Optimizer) else client(params)
    if config.optimizer is not None:
        return _torch_optimizer(config.optimizer, params)
    return None


def _scheduler(client: Any, config: ShardwiseConfig, optimizer: Optional[DistributedOptimizer]) -> Any:
    if client is not None:
        return client(optimizer) if callable(client) and not hasattr(client, "step") else client
    if config.scheduler is not None and optimizer is not None:
        return build_scheduler(config.scheduler, optimizer)
    return None


def _refuse(name: str, value: Any, why: str) -> None:
    if value is not None:
        raise ValueError(f"deepspeed.initialize({name}=...): {why}")


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer: Any = None,
               model_parameters: Optional[Iterable[Any]] = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None) -> tuple:
    """DeepSpeed's `initialize`: returns `(engine, optimizer, training_dataloader, lr_scheduler)`.

    The config comes from `args.deepspeed_config`, `config` or `config_params` (a dict or a JSON path). The
    optimizer is the one given (an optimizer, or a callable taking the parameters), else the config's block
    over `model_parameters` (parameters or param-group dicts; the model's parameters when None); the scheduler
    likewise. `training_data` becomes a loader of `train_micro_batch_size_per_gpu` samples per data-parallel
    rank (`collate_fn` as given)."""
    if model is None:
        raise ValueError("deepspeed.initialize requires a model: pass model=<torch.nn.Module>")
    _refuse("mpu", mpu, "shardwise builds its own tensor-parallel groups from tensor_parallel_degree; pass "
            "mpu=None and set tensor_parallel_degree in the config")
    _refuse("mesh_param", mesh_param, "sequence-parallel meshes are not built by this front end; pass None")
    data = _config_dict(_config_source(args, config, config_params))
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    resolved = _engine_config({**read_deepspeed(data), **_pipeline_keys(model)})
    distributed = DistributedModel(model)
    params = list(model_parameters) if model_parameters is not None else list(distributed.parameters())
    torch_optimizer = _optimizer(optimizer, resolved, params)
    wrapped = DistributedOptimizer(torch_optimizer) if torch_optimizer is not None else None
    scheduler = _scheduler(lr_scheduler, resolved, wrapped)
    settings = EngineSettings.of(resolved, data)
    engine_class = DeepSpeedEngine
    if _is_pipeline_module(model):
        from .pipeline_engine import PipelineEngine

        engine_class = PipelineEngine
    engine = engine_class(distributed, wrapped, scheduler, settings, collate_fn=collate_fn)
    loader = engine.training_loader(training_data) if training_data is not None else None
    engine.training_dataloader = loader
    return engine, wrapped, loader, scheduler
