"""`deepspeed.runtime.*`: the module paths scripts import DeepSpeed's runtime names from.

Its submodules are reached as attributes too (`deepspeed.runtime.utils.set_random_seed`), as in DeepSpeed.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = {"utils", "dataloader", "engine", "lr_schedules", "pipe"}


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'shardwise.deepspeed.runtime' has no attribute {name!r}")
    module = importlib.import_module(f".{name}", __name__)
    globals()[name] = module
    return module
