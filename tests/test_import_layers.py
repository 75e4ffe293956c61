"""Imports run down the layers only, and no module imports itself back through another.

A package may import from its own folder and from the layers below it, never from one
beside or above it: the core never depends on a front end, and the pure layers (topology,
config, planner) load no runtime. `shardwise/__init__.py`, the façade, is outside the layers.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "shardwise"

# Bottom first. Each entry: the top-level modules and packages of that layer.
LAYERS = [
    {"errors", "families", "torch_internals", "rundir"},   # vocabulary with no shardwise imports
    {"topology"},                                          # cluster and layout of ranks, pure
    {"config"},                                            # the config, its validation and decisions, pure
    {"parallel", "optimizers"},                            # the techniques, given plain values
    {"runtime"},                                           # the live process: init, mesh, ranks, checks
    {"checkpoint", "observe"},                             # training state on disk; metrics
    {"api"},                                               # DistributedModel, DistributedOptimizer, @step
    {"smp", "deepspeed", "hf"},                           # front ends: SMP v1, DeepSpeed, the Trainer
    {"launcher", "planner", "demo", "testing"},
    {"tune"},                                              # trials of the planner's layouts through launches
    {"cli"},
]
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def module_imports(root: pathlib.Path) -> dict[str, set[str]]:
    """Each module's (dotted, from the package root) shardwise modules it imports, at any depth of its code."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[:-1]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
                found[name].update(".".join(target + ([] if node.module else [alias.name])) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardwise."):
                found[name].add(node.module.removeprefix("shardwise."))
    return found


def layer_violations(root: pathlib.Path) -> list[str]:
    problems = []
    for module, targets in sorted(module_imports(root).items()):
        own = module.split(".")[0]
        if not module or own not in LEVEL:
            continue
        for target in sorted(targets):
            other = target.split(".")[0]
            if other and other != own and other in LEVEL and LEVEL[other] >= LEVEL[own]:
                problems.append(f"{module} imports {target}: {other} is not below {own}")
    return problems


def cycles(root: pathlib.Path) -> list[list[str]]:
    """Modules that import each other round a loop (a package's __init__ re-exporting its modules aside)."""
    imports = module_imports(root)
    packages = {".".join(p.relative_to(root).parts[:-1]) for p in root.rglob("__init__.py")}
    graph = {m: {t for t in ts if t in imports and t not in packages and t != m}
             for m, ts in imports.items() if m not in packages}
    found, index, low, stack, on = [], {}, {}, [], set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            loop = []
            while not loop or loop[-1] != v:
                loop.append(stack.pop())
                on.discard(loop[-1])
            if len(loop) > 1:
                found.append(sorted(loop))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_top_level_module_is_in_a_layer():
    names = {p.stem for p in SRC.glob("*.py")} | {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert names - {"__init__", "__main__"} <= set(LEVEL), sorted(names - set(LEVEL) - {"__init__", "__main__"})


def test_imports_run_down_the_layers():
    problems = layer_violations(SRC)
    assert not problems, "\n".join(problems)


def test_no_module_imports_itself_back():
    assert cycles(SRC) == []


@pytest.mark.parametrize("files,expected", [
    ({"parallel/a.py": "from ..api.model import DistributedModel\n", "api/model.py": ""},
     ["parallel.a imports api.model: api is not below parallel"]),
    ({"config/a.py": "from ..topology import Layout\n", "topology/__init__.py": ""}, []),
])
def test_the_layer_check_names_an_import_running_up(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert layer_violations(tmp_path) == expected


def test_the_cycle_check_finds_two_modules_importing_each_other(tmp_path):
    (tmp_path / "observe").mkdir()
    (tmp_path / "observe" / "__init__.py").write_text("")
    (tmp_path / "observe" / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "observe" / "b.py").write_text("from .a import f\n")
    assert cycles(tmp_path) == [["observe.a", "observe.b"]]
