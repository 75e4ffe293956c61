"""Only `torch_internals.py` names private torch: every other module of the package reaches torch's internals
through it, so `tests/test_torch_internals.py` checks each one a torch upgrade could move.

Read from each module's syntax tree: private torch modules and names imported, attribute chains off a name bound
to torch (`torch._foreach_add_`, `dist.distributed_c10d._world`), private members of torch's classes read on any
object (`module._parameters`, `tensor._base`) or on `self` in a subclass of one, and strings naming one (a state-dict
key, an op). A subclass may override or read on `self` the members `torch_internals.py`'s docstring lists.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import warnings

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

import shardwise.torch_internals

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "shardwise"
INTERNALS = "torch_internals.py"

# The torch classes whose objects the package handles: their private members are what `x._name` would read.
TORCH_CLASSES = [torch.Tensor, nn.Parameter, nn.Module, DTensor, DeviceMesh, torch.UntypedStorage, dist.ProcessGroup,
                 torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler, ShardedGradScaler,
                 FSDPModule, ParallelStyle, ColwiseParallel, RowwiseParallel, SequenceParallel, PipelineStage,
                 PipelineScheduleSingle, PipelineScheduleMulti, torch.fx.GraphModule, torch.fx.Graph, torch.fx.Node,
                 torch.autograd.Function, torch.utils.data.DataLoader, torch.Generator]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _members(owner: object) -> set[str]:
    """`owner`'s private members: its class's (or its own, for a class) and, for an object, its instance's."""
    names = set(dir(owner)) | set(getattr(owner, "__dict__", {}))
    return {name for name in names if _private(name)}


def _class_members(cls: type) -> set[str]:
    """The private members of `cls` and of an instance built without arguments, where one can be."""
    try:
        with warnings.catch_warnings():  # a scaler built for CUDA warns where there is none
            warnings.simplefilter("ignore")
            return _members(cls) | _members(cls())
    except Exception:  # abstract, or needs arguments: the class's own members only
        return _members(cls)


def _torch_members() -> set[str]:
    layer = nn.Linear(1, 1)
    objects = [*TORCH_CLASSES, layer, torch.optim.SGD(layer.parameters(), lr=0.1), torch.ones(1),
               torch.amp.GradScaler("cpu")]
    return set().union(*map(_members, objects))


TORCH_MEMBERS = _torch_members()


def _overrides(doc: str) -> set[tuple[str, str]]:
    """(class, member) a subclass may override or read on self: `Class._name` (and `._name` after it, of the same
    class) in torch_internals' docstring."""
    pairs, owner = set(), None
    for cls, member in re.findall(r"`(\w*)\.(_\w+)`", doc):
        owner = cls or owner
        pairs.add((owner, member))
    return pairs


OVERRIDES = _overrides(shardwise.torch_internals.__doc__)


def _op_name(text: str) -> bool:
    """A private aten or c10d op, or a private op namespace (`_c10d_functional`), by name."""
    return _private(text) and (text in dir(torch.ops) or hasattr(torch.ops.aten, text)
                               or hasattr(torch.ops.c10d, text))


def _chain(node: ast.AST) -> list[str]:
    """`a.b.c` as ["a", "b", "c"]; [] where the chain starts at no plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def _torch_module(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


class _Reader(ast.NodeVisitor):
    """Collects one module's private torch names as `line: what`."""

    def __init__(self, tree: ast.Module):
        self.found: list[str] = []
        self.torch_names = self._bindings(tree)
        self.bases: list[object] = []  # the torch class each enclosing class derives from, or None

    def _bindings(self, tree: ast.Module) -> dict[str, object]:
        """Each name the module binds to torch, with the torch object where it can be named (else None)."""
        bound: dict[str, object] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _torch_module(alias.name):
                        bound[alias.asname or "torch"] = torch if not alias.asname else _resolve(alias.name)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and _torch_module(node.module or ""):
                for alias in node.names:
                    bound[alias.asname or alias.name] = _resolve(f"{node.module}.{alias.name}")
        for node in ast.walk(tree):  # `_aten = torch.ops.aten`: names given a torch chain
            if isinstance(node, ast.Assign):
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                targets = [t for target in node.targets
                           for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
                for target, value in zip(targets, values):
                    if isinstance(target, ast.Name) and _chain(value)[:1] and _chain(value)[0] in bound:
                        bound[target.id] = None
        return bound

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _torch_module(alias.name) and any(map(_private, alias.name.split("."))):
                self.found.append(f"{node.lineno}: import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not _torch_module(node.module or ""):
            return
        names = [alias.name for alias in node.names]
        if any(map(_private, node.module.split("."))) or any(map(_private, names)):
            self.found.append(f"{node.lineno}: from {node.module} import {', '.join(names)}")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [_resolve_chain(_chain(base), self.torch_names) for base in node.bases]
        self.bases.append(next((base for base in bases if isinstance(base, type)), None))
        self.generic_visit(node)
        self.bases.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _chain(node)
        if chain and chain[0] in self.torch_names:
            if any(map(_private, chain[1:])):
                self.found.append(f"{node.lineno}: {'.'.join(chain)}")
            return  # the whole chain is judged here
        if _private(node.attr) and node.attr in TORCH_MEMBERS:
            on_self = (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                       or isinstance(node.value, ast.Call) and _chain(node.value.func) == ["super"])
            if not on_self:
                self.found.append(f"{node.lineno}: {ast.unparse(node)}")
            elif self.bases and self.bases[-1] is not None and node.attr in _class_members(self.bases[-1]) \
                    and not any((cls.__name__, node.attr) in OVERRIDES for cls in self.bases[-1].__mro__):
                self.found.append(f"{node.lineno}: {ast.unparse(node)} (of {self.bases[-1].__name__})")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and _private(node.value) and (node.value in TORCH_MEMBERS
                                                                     or _op_name(node.value)):
            self.found.append(f"{node.lineno}: {node.value!r}")


def _resolve(dotted: str) -> object:
    """The torch object at `dotted` (a module or a member of one), or None where it cannot be reached."""
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None


def _resolve_chain(chain: list[str], bound: dict[str, object]) -> object:
    if not chain or bound.get(chain[0]) is None:
        return None
    found = bound[chain[0]]
    for part in chain[1:]:
        found = getattr(found, part, None)
    return found


def offenders(root: pathlib.Path) -> list[str]:
    """`path:line: what` for each private torch name used in `root`'s modules but its torch_internals.py."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == INTERNALS:
            continue
        tree = ast.parse(path.read_text())
        reader = _Reader(tree)
        reader.visit(tree)
        found += [f"{path.relative_to(root).as_posix()}:{line}" for line in reader.found]
    return found


def test_only_torch_internals_names_private_torch():
    found = offenders(PACKAGE)
    assert not found, "route these through shardwise/torch_internals.py, with a smoke test:\n" + "\n".join(found)


def test_the_check_names_each_kind_of_private_torch_use(tmp_path):
    (tmp_path / "parallel").mkdir()
    (tmp_path / INTERNALS).write_text("import torch\nforeach_add_ = torch._foreach_add_\n")
    (tmp_path / "parallel" / "rogue.py").write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch import nn\n"
        "from torch._ops import OpOverload\n"
        "import torch.distributed._functional_collectives\n"
        "from torch.utils.checkpoint import _checkpoint_without_reentrant\n"
        "_aten = torch.ops.aten\n"
        "KERNEL = _aten._scaled_dot_product_flash_attention.default\n"
        "\n"
        "def step(tensors, module, tensor):\n"
        "    torch._foreach_add_(tensors, 1.0)\n"
        "    dist.distributed_c10d._world.pg_names.clear()\n"
        "    return module._parameters, tensor._base, {'_growth_tracker': 0}, '_allgather_base_'\n"
        "\n"
        "class Layer(nn.Module):\n"
        "    def forward(self, x):\n"
        "        return self._modules, super()._apply(lambda t: t)\n")
    (tmp_path / "fine.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "from torch.distributed.tensor.parallel import ParallelStyle\n"
        "\n"
        "class Own:\n"
        "    def __init__(self):\n"
        "        self._next, self._scale = 0, 1.0  # own members, though torch classes have some of these names\n"
        "\n"
        "class Style(ParallelStyle):\n"
        "    def _apply(self, module, mesh):  # the documented override\n"
        "        return super()._apply(module, mesh)\n"
        "\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self._args = ()  # no member of nn.Module\n"
        "\n"
        "LABEL = '_' + torch.__version__ + '_bytes'\n")
    assert offenders(tmp_path) == [
        "parallel/rogue.py:4: from torch._ops import OpOverload",
        "parallel/rogue.py:5: import torch.distributed._functional_collectives",
        "parallel/rogue.py:6: from torch.utils.checkpoint import _checkpoint_without_reentrant",
        "parallel/rogue.py:8: _aten._scaled_dot_product_flash_attention.default",
        "parallel/rogue.py:11: torch._foreach_add_",
        "parallel/rogue.py:12: dist.distributed_c10d._world.pg_names.clear",
        "parallel/rogue.py:13: module._parameters",
        "parallel/rogue.py:13: tensor._base",
        "parallel/rogue.py:13: '_growth_tracker'",
        "parallel/rogue.py:13: '_allgather_base_'",
        "parallel/rogue.py:17: self._modules (of Module)",
        "parallel/rogue.py:17: super()._apply (of Module)",
    ]
