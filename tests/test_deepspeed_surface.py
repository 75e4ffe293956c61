"""DeepSpeed's public names a training script uses, walked against `shardwise.deepspeed`.

docs/deepspeed.md's "Python API" table has one row per name with its status. An honoured name (also
"honoured differently") resolves under `shardwise.deepspeed` as it does under `deepspeed` in a script: a
module path by import, then attributes; `DeepSpeedEngine.x` / `PipelineEngine.x` on the class (an instance
attribute counts when the class declares it with an annotation). A refused name does not resolve. Where
DeepSpeed itself is installed, every name of the table resolves there too, so the table names nothing
DeepSpeed lacks.
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "deepspeed.md"
STATUSES = ("honoured", "honoured differently", "refused")
ENGINES = {"DeepSpeedEngine": "engine", "PipelineEngine": "pipeline_engine"}
REAL_ENGINES = {"DeepSpeedEngine": "deepspeed.runtime.engine", "PipelineEngine": "deepspeed.runtime.pipe.engine"}


def api_rows() -> list[tuple[str, str, str]]:
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("### Python API", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+)` \| ([^|]+) \|(.*)\|$", line)
        if match:
            rows.append((match[1], match[2].strip(), match[3].strip()))
    return rows


def _resolve(root: str, dotted: str) -> Any:
    """`root.dotted` as a script reaches it: the longest importable module prefix, then attributes."""
    parts = dotted.split(".") if dotted else []
    for cut in range(len(parts), -1, -1):
        try:
            value: Any = importlib.import_module(".".join([root, *parts[:cut]]))
        except ImportError:
            continue
        for name in parts[cut:]:
            value = getattr(value, name)
        return value
    raise ImportError(root)


def _declared(cls: type, name: str, by_assignment: bool) -> bool:
    """`name` is a class attribute, an annotated instance attribute, or (`by_assignment`, for DeepSpeed's own
    classes, which annotate none) assigned as `self.name` in the class's source."""
    if hasattr(cls, name) or any(name in getattr(klass, "__annotations__", {}) for klass in cls.__mro__):
        return True
    return by_assignment and any(f"self.{name} =" in source or f"self.__dict__['{name}'] =" in source
                                 for source in (inspect.getsource(klass) for klass in cls.__mro__
                                                if klass.__module__.startswith("deepspeed")))


def _resolves(name: str, root: str, engines: dict[str, str]) -> bool:
    head, _, rest = name.partition(".")
    try:
        if head in engines:
            cls = getattr(importlib.import_module(engines[head]), head)
            return _declared(cls, rest, by_assignment=root == "deepspeed")
        _resolve(root, rest)
        return True
    except (ImportError, AttributeError):
        return False


def test_the_table_lists_every_name_once_with_a_known_status():
    rows = api_rows()
    names = [name for name, _, _ in rows]
    assert len(rows) > 60 and len(names) == len(set(names))
    assert {status for _, status, _ in rows} <= set(STATUSES)
    assert all(why for _, status, why in rows if status != "honoured"), "every other status says how or why"


@pytest.mark.parametrize("name,status", [(name, status) for name, status, _ in api_rows()])
def test_each_name_resolves_as_its_status_says(name, status):
    engines = {head: f"shardwise.deepspeed.{module}" for head, module in ENGINES.items()}
    assert _resolves(name, "shardwise.deepspeed", engines) == (status != "refused"), name


@pytest.mark.deepspeed
def test_every_name_exists_in_deepspeed_itself(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    missing = [name for name, status, _ in api_rows()
               if status != "refused" and not _resolves(name, "deepspeed", REAL_ENGINES)]
    assert not missing


def test_names_resolve_in_a_script_order_in_a_fresh_process():
    """A script touches `add_config_arguments` or `init_distributed` before `initialize`, and reaches
    submodules as attributes (`deepspeed.runtime.utils.set_random_seed`): each stays what DeepSpeed has."""
    script = ("import shardwise.deepspeed as deepspeed\n"
              "deepspeed.add_config_arguments, deepspeed.init_distributed\n"
              "assert callable(deepspeed.initialize), deepspeed.initialize\n"
              "assert callable(deepspeed.runtime.utils.set_random_seed)\n"
              "assert callable(deepspeed.runtime.pipe.module.PipelineModule)\n"
              "groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer("
              "{'params': [1, 2], 'lr': 0.1})\n"
              "assert groups == [{'params': [1, 2], 'lr': 0.1}], groups\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
