"""Tensor parallelism inside pipeline stages cut from the module graph.

torch.export cannot trace DTensor's hooks (`DTensor.from_local`), and the graph it
captures bakes in every shape it saw: GPT-2's packed Q/K/V is split at the whole
width, heads are reshaped to whole sizes. So at the cut the model is first split as
without a pipeline (`apply_tensor_parallel`: DTensor weights, per-rank head counts),
and its forward is captured as one tensor-parallel rank computes it: each split
layer with this rank's shard and without its DTensor hooks, on the group's gathered
batch. The stage torch unflattens from that capture keeps the model's module names,
so each split layer in it becomes the model's own layer again, hooks and all: the
layers run split and communicate as without a pipeline, and what runs between them
runs as captured, on this rank's shapes.

A module whose style only moves activations (`fan_out`, on attention and MLP
modules) stays captured: the column-parallel layers below it each all-reduce their
input gradient, the same sum in one collective per layer instead of one per module.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.export.unflatten import InterpreterModule

from ...torch_internals import drop_forward_hooks
from ..tensor import PlanLike, TensorParallelBatch, apply_tensor_parallel, plan_for
from ..tensor.loss import VOCAB_SHARDED_OUTPUT
from ..tensor.plan import assignments


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


class GraphTensorParallel:
    """Split the model before the capture, capture it as one tensor-parallel rank, give the stage the split layers."""

    def __init__(self, tp_mesh: DeviceMesh, plan: PlanLike, prescaled_batch: bool):
        """`plan`: the user's tensor-parallel plan (None: the built-in one, or the plans modules carry)."""
        self.tp_mesh, self.plan = tp_mesh, plan
        self.active = tp_mesh.size() > 1  # else every step here does nothing
        self.batch = TensorParallelBatch(tp_mesh, prescaled_batch)
        self.styled: list[str] = []  # every module path the plan gives a style
        self.layers: dict[str, nn.Module] = {}  # path -> the model's split layer (a styled module with parameters)
        self.vocab_sharded = False

    def gathered(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """One microbatch's inputs as the tensor-parallel group computes them: the capture bakes the batch size."""
        return self.batch.gather((), inputs)[1]

    def split(self, model: nn.Module) -> None:
        """Split `model` in place over the tp axis, as without a pipeline."""
        if not self.active:
            return
        self.styled = list(assignments(model, plan_for(model, self.plan, self.tp_mesh.size())))
        apply_tensor_parallel(model, self.tp_mesh, self.plan)
        self.layers = {path: model.get_submodule(path) for path in self.styled
                       if _holds_parameters(model.get_submodule(path))}
        self.vocab_sharded = getattr(model, VOCAB_SHARDED_OUTPUT, False)

    def capturable(self, copy: nn.Module, model: nn.Module, inputs: dict[str, Any]) -> None:
        """Make the capture's copy of the split `model` compute this rank's shapes without DTensor, which torch.export
        cannot trace: each split layer's copy returns a tensor shaped as the layer's output on this rank (recorded
        from one forward of `model` on `inputs`), made from its input and its parameters, so torch places them and
        sees the weights stages share. The graph captured inside a layer is dropped again (`adopt`)."""
        for path in self.styled:
            drop_forward_hooks(copy.get_submodule(path))
        for path, shape in _output_shapes(model, self.layers, inputs).items():
            stand_in = copy.get_submodule(path)
            stand_in.forward = functools.partial(_shaped, stand_in, shape)

    def adopt(self, stage: nn.Module) -> None:
        """Put the model's split layers in place of their captured copies in `stage`."""
        if not self.active:
            return
        for path, layer in self.layers.items():
            try:
                captured = stage.get_submodule(path)
            except AttributeError:  # another stage's layer
                continue
            if not isinstance(captured, InterpreterModule):  # not called here: only owns a weight tied to one that is
                continue
            _check_one_in_one_out(captured, path, layer)
            parent, _, name = path.rpartition(".")
            setattr(stage.get_submodule(parent), name, layer)

    def mark_output(self, module: nn.Module) -> None:
        """Say on the module the runner computes the loss with (a rank's stages as one) whether the model's output
        is sharded over the vocabulary: the runner's loss_context reads it."""
        setattr(module, VOCAB_SHARDED_OUTPUT, self.vocab_sharded)

    def install(self, stage: nn.Module, is_last: bool) -> None:
        """Gather the model's inputs (keywords) in the group before the stage; on the last stage give each rank back
        its rows of the outputs. Values received from the previous stage already cover the group's rows."""
        if not self.batch.active:
            return
        stage.register_forward_pre_hook(lambda _, args, kwargs: (args, self.gathered(kwargs)), with_kwargs=True)
        if is_last:
            stage.register_forward_hook(lambda _, args, outputs: self.batch.split(outputs))


@torch.no_grad()
def _output_shapes(model: nn.Module, layers: dict[str, nn.Module], inputs: dict[str, Any]) -> dict[str, torch.Size]:
    """Each layer's output shape in one forward of `model`: a DTensor's is its whole shape, as the code after it
    sees it."""
    shapes: dict[str, torch.Size] = {}

    def record(path: str, output: torch.Tensor) -> None:  # returns None: the output stays as it is
        shapes.setdefault(path, output.shape)

    handles = [layer.register_forward_hook(lambda _, args, out, path=path: record(path, out))
               for path, layer in layers.items()]
    try:
        model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return shapes


def _shaped(layer: nn.Module, shape: torch.Size, x: torch.Tensor) -> torch.Tensor:
    """Zeros of `shape` in the parameters' dtype that depend on `x` and on the parameters of `layer` (read at the
    call: torch.export puts its own in while it captures)."""
    params = list(layer.parameters())
    anchor = sum(p.flatten()[0] for p in params) * 0 + x.flatten()[0] * 0
    return torch.zeros(shape, dtype=params[0].dtype, device=x.device) + anchor


def _check_one_in_one_out(captured: InterpreterModule, path: str, layer: nn.Module) -> None:
    """The model's layer can stand in for its captured copy only where the graph passes it one tensor and takes
    one back (its forward's input and output)."""
    nodes = list(captured.graph.nodes)
    inputs = sum(node.op == "placeholder" for node in nodes)
    output = next(node for node in nodes if node.op == "output").args[0]
    if inputs != 1 or not isinstance(output, torch.fx.Node):
        raise ValueError(f"tensor parallelism with the module-graph pipeline cut runs {path} "
                         f"({type(layer).__name__}) as the model's own layer, but the captured graph passes it "
                         f"{inputs} values; fix: give tensor-parallel styles only to layers that take one tensor and "
                         "return one, mark this module off (sw.set_tensor_parallelism(module, False)), or set "
                         "pipeline_cut: blocks")
