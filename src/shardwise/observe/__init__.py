"""Observability: what a run records each step (recorder.py and the modules it uses) and the report of a
run directory (report*.py). `shardwise.observe.metrics` (`sw.metrics`) is loaded on first use, so that
importing the package loads neither."""

from __future__ import annotations

import importlib
from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    if name == "metrics":
        return importlib.import_module(".metrics", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
