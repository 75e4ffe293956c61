"""DeepSpeed's names over shardwise: a DeepSpeed training script runs with its import changed.

    import shardwise.deepspeed as deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=model.parameters())
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

The engine is a front end over shardwise's own `DistributedModel`, `DistributedOptimizer`,
`data_loader` and checkpoints; the DeepSpeed JSON is read as DeepSpeed reads it
(`shardwise.config.deepspeed`). docs/deepspeed.md lists every public name and config key: honoured,
honoured differently (how), or refused (why).
"""

from __future__ import annotations

import importlib
from typing import Any

# The DeepSpeed release whose API and config this front end follows (scripts compare versions to pick features).
__version__ = "0.19.8"

_EXPORTS = {
    "initialize": "initialization",
    "init_distributed": "initialization",
    "add_config_arguments": "initialization",
    "DeepSpeedEngine": "engine",
    "PipelineEngine": "pipeline_engine",
    "PipelineModule": "pipe",
    "get_accelerator": "accelerator",
    "log_dist": "utils",
    "logger": "utils",
    "TORCH_DISTRIBUTED_DEFAULT_PORT": "initialization",
}
# DeepSpeed's submodules that scripts reach as attributes (`deepspeed.zero.Init`, `deepspeed.comm.get_rank`).
_SUBMODULES = {"comm", "zero", "pipe", "utils", "runtime", "accelerator", "ops", "checkpointing", "moe"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'shardwise.deepspeed' has no attribute {name!r}; docs/deepspeed.md lists "
                             "the DeepSpeed names shardwise provides")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__ + sorted(_SUBMODULES))
