"""A pipeline stage cut from the module graph torch captured: what it receives, runs and sends on.

`torch.distributed.pipelining.pipeline` captures the model's forward (torch.export)
and splits the graph at the cut's modules into one `GraphModule` per stage, whose
parameters keep the model's names. Its root graph says which values each stage
takes: the model's inputs (every stage gets them by name from the schedule) and
values earlier stages computed. A stage sends on every value a later stage or the
model's output still needs, its own and those it received (a skip connection
passes through), so each stage receives only from the one before, as the
schedules expect. The last stage returns the model's outputs as flat tensors;
`rebuild` gives them the model's structure (a Hugging Face `ModelOutput`, a dict).

A rank running several stages (virtual stages) reads them as one module under the
model's names (`join_stages`): torch gives every stage module its own copy of the
containers a cut runs through (each stage's `bert` runs a different graph), so
these are joined, while each stage's graph module keeps calling its own.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, MutableMapping
from typing import Any, Callable, ContextManager

import torch
from torch import fx, nn

from ...torch_internals import children_table, tensor_tables, tree_unflatten, use_tensor_tables
from .graph_cut import TENSOR, GraphCut

Source = tuple[str, str]  # ("input", argument name) or ("value", root-graph node name)


class Wiring:
    """Per stage: the sources of its graph module's arguments, its outputs by value name, what it receives and
    what it sends (read off the root graph of the split model)."""

    def __init__(self, root: fx.GraphModule):
        nodes = list(root.graph.nodes)
        calls = [n for n in nodes if n.op == "call_module"]
        stage_of = {n: k for k, n in enumerate(calls)}
        produced: dict[str, int] = {}  # value name -> stage computing it
        self.outputs: list[dict[Any, str]] = [{} for _ in calls]  # stage -> {output index (None: whole) -> value}
        for node in nodes:
            if node in stage_of:
                produced[node.name] = stage_of[node]
            elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in stage_of:
                produced[node.name] = stage_of[node.args[0]]
                self.outputs[stage_of[node.args[0]]][node.args[1]] = node.name
        for node, k in stage_of.items():
            if not self.outputs[k]:
                self.outputs[k][None] = node.name
        self.args: list[list[Source]] = [[_source(a) for a in node.args] for node in calls]
        result = next(n for n in nodes if n.op == "output").args[0]
        self.results: list[Source] = [_source(a) for a in (result if isinstance(result, (tuple, list)) else [result])]
        self.module_names = [node.target for node in calls]
        order = {n.name: i for i, n in enumerate(nodes)}
        self.sends: list[list[str]] = []
        for k in range(len(calls)):
            later = [src for args in self.args[k + 1:] for src in args] + self.results
            needed = {key for kind, key in later if kind == "value" and produced[key] <= k}
            self.sends.append(sorted(needed, key=order.__getitem__))

    @property
    def stages(self) -> int:
        return len(self.args)


def _source(node: Any) -> Source:
    if not isinstance(node, fx.Node):
        raise ValueError(f"the captured pipeline passes a constant ({node!r}) between stages; pipeline parallelism "
                         "needs every value between stages to be a tensor")
    return ("input", node.target) if node.op == "placeholder" else ("value", node.name)


def _sendable(value: Any) -> Any:
    """A value as a stage sends it: contiguous (receive buffers are made with the sent tensors' layout, and gloo/NCCL
    need them contiguous: an attention mask is often an expanded view), and a tensor of its own (`_Sent`)."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.contiguous()
    return _Sent.apply(value) if value.requires_grad else value.detach()


class _Sent(torch.autograd.Function):
    """The identity, as a tensor of its own over the same memory: the split-backward schedules detach a stage's
    outputs in place, which a view refuses and which would cut the history of a value the stage computes with too."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: the previous stage receives it into a buffer laid out as
    the gradient, and gloo/NCCL need that buffer contiguous (a gradient through a transpose is not)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GraphStage(nn.Module):
    """Stage `index` of the split model: `forward(*received, **model_inputs)` → what the next stage receives, or
    on the last stage the model's outputs as tensors."""

    def __init__(self, module: nn.Module, wiring: Wiring, index: int, cut: GraphCut):
        super().__init__()
        self.module = module
        self.index = index
        self.is_first = index == 0
        self.is_last = index == wiring.stages - 1
        self._args = wiring.args[index]
        self._outputs = wiring.outputs[index]
        self._receives = wiring.sends[index - 1] if index else []
        self._sends: list[Source] = wiring.results if self.is_last else [("value", v) for v in wiring.sends[index]]
        self._cut = cut
        self.precision: Callable[[], ContextManager] = contextlib.nullcontext

    def install_hooks(self) -> None:
        """Nothing to hook: the graph module takes and returns exactly what crosses the stage's edges."""

    def forward(self, *received: torch.Tensor, **inputs: Any) -> Any:
        received = tuple(_ContiguousGrad.apply(t) if t.requires_grad else t for t in received)
        values = dict(zip(self._receives, received))

        def get(source: Source) -> Any:
            kind, key = source
            return inputs[key] if kind == "input" else values[key]

        with self.precision():
            output = self.module(*(get(source) for source in self._args))
        for index, name in self._outputs.items():
            values[name] = output if index is None else output[index]
        sent = tuple(_sendable(get(source)) for source in self._sends)
        return sent[0] if len(sent) == 1 else sent

    def rebuild(self, output: Any) -> Any:
        """The last stage's output (tensor or tuple of tensors) in the structure the model returned."""
        tensors = iter(output if isinstance(output, tuple) else (output,))
        leaves = [next(tensors) if leaf is TENSOR else leaf for leaf in self._cut.output_leaves]
        return tree_unflatten(leaves, self._cut.output_spec)


class _Joined(MutableMapping):
    """The tensor tables of the modules several stages hold at one path, read as one: a tensor is read from, and
    replaced in, the stage module holding it (sharding replaces parameters there), a new one goes to the first."""

    def __init__(self, tables: list[dict[str, Any]]):
        self.tables = tables

    def _holders(self, name: str) -> list[dict[str, Any]]:
        return [table for table in self.tables if name in table]

    def __getitem__(self, name: str) -> Any:
        holders = self._holders(name)
        if not holders:
            raise KeyError(name)
        return holders[0][name]

    def __setitem__(self, name: str, value: Any) -> None:
        for table in self._holders(name) or self.tables[:1]:
            table[name] = value

    def __delitem__(self, name: str) -> None:
        for table in self._holders(name):
            del table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(name for table in self.tables for name in table))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def join_stages(modules: list[nn.Module]) -> nn.Module:
    """One module tree over the modules of this rank's stages, named as in the model. A path one stage holds is
    that stage's module itself; a path several hold (the containers around a cut) is a container joining their
    children and tensor tables, so every parameter shows as the stage holding it has it."""
    if len(modules) == 1:
        return modules[0]
    joined = nn.Module()
    parameters, buffers, non_persistent = zip(*(tensor_tables(m) for m in modules))
    use_tensor_tables(joined, _Joined(list(parameters)), _Joined(list(buffers)), set().union(*non_persistent))
    children = [children_table(m) for m in modules]
    for name in dict.fromkeys(name for table in children for name in table):
        joined.add_module(name, join_stages([table[name] for table in children if name in table]))
    return joined
