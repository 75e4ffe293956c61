"""How one module is split over the tensor-parallel axis, and the style names plans use.

torch's `ColwiseParallel` / `RowwiseParallel` handle `nn.Linear` and `nn.Embedding`
and do the hard part (DTensor layouts, the one all-reduce per column→row pair).
The subclasses here add what the supported models need on top:

* HF `Conv1D` (GPT-2) stores its weight transposed (in × out), so a column split
  shards weight dim 1 and a row split dim 0 — the opposite of `nn.Linear`.
* Packed projections (GPT-2's `c_attn` holds Q, K and V side by side) must be cut
  chunk by chunk, or rank 0 would own all of Q and half of K. `_StridedShard`
  names exactly that layout, so `full_tensor()` and checkpoints keep the original
  column order and the weights stay interchangeable with the unsplit model.
  The packed bias stays replicated: FSDP2 shards dim 0 as well, and a dim-0 FSDP
  shard of a chunk-strided vector has no DTensor layout (its `full_tensor()`
  would come back scrambled); the bias is tiny, and DTensor slices it locally.
  For the same reason packing is offered for Conv1D only, whose packed dim is 1.
* `splits(module)` says which parameter dims a style cuts, so the rules check
  (`rules.py`) and the tied-weight check see the same split the partition makes.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional, Union

from torch import nn
from torch.distributed.tensor import DTensor, DeviceMesh, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from ...torch_internals import strided_shard, style_input_fn, style_output_fn
from .regather import Regather

# parameter name -> tensor dim that is split across the TP ranks
Splits = dict[str, int]


def is_conv1d(module: nn.Module) -> bool:
    """HF's transposed linear layer (GPT-2, OpenAI GPT), recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _unsupported(style: ParallelStyle, module: nn.Module,
                 supported: str = "nn.Linear, HF Conv1D and nn.Embedding") -> TypeError:
    return TypeError(f"{type(style).__name__} splits {supported}, not {type(module).__name__}; "
                     "give this module another style or leave it out of the plan")


def _placement(dim: int, chunks: int) -> Placement:
    return Shard(dim) if chunks == 1 else strided_shard(dim, chunks)


def _partition(splits: Splits, chunks: int, src_data_rank, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Replace the split parameters by DTensor shards; `distribute_module` replicates the rest."""
    if name:  # only the module's own parameters, never a child's
        return
    for pname, dim in splits.items():
        param = getattr(module, pname, None)
        if param is None:
            continue
        shard = distribute_tensor(param, mesh, [_placement(dim, chunks)], src_data_rank=src_data_rank)
        module.register_parameter(pname, nn.Parameter(shard, requires_grad=param.requires_grad))


class Colwise(ColwiseParallel):
    """Column (output-feature) split; the input is replicated, the output sharded on its last dim.

    `chunks` > 1 cuts a packed Conv1D projection chunk by chunk (each rank gets its
    part of every chunk). `output_layouts=Replicate()` all-gathers the output; with
    `use_local_output=False` the output stays a DTensor (a vocab-sharded head for
    `loss_parallel`).
    """

    def __init__(self, *, chunks: int = 1, regather: Optional[Regather] = None, **layouts):
        super().__init__(**layouts)
        self.chunks = chunks
        self.regather = regather

    def splits(self, module: nn.Module) -> Splits:
        if is_conv1d(module):
            return {"weight": 1} if self.chunks > 1 else {"weight": 1, "bias": 0}
        if self.chunks > 1:
            raise _unsupported(self, module, "HF Conv1D when packed")
        if isinstance(module, nn.Embedding):
            return {"weight": 1}
        if isinstance(module, nn.Linear):
            return {"weight": 0, "bias": 0}
        raise _unsupported(self, module)

    def _output(self, module, outputs, mesh):
        # A packed output is sharded chunk-wise; turning it into a plain Shard(-1) would reorder it.
        if self.chunks > 1:
            return outputs.to_local() if self.use_local_output else outputs
        return style_output_fn(self)(module, outputs, mesh)

    def _input(self, module, inputs, mesh):
        gathered = style_input_fn(self)(module, inputs, mesh)
        self.regather.note(inputs[0], gathered, mesh, self.input_layouts[0].dim)
        return gathered

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh,
            partial(_partition, self.splits(module), self.chunks, self.src_data_rank),
            self._input if self.regather else style_input_fn(self),
            self._output,
        )


class Rowwise(RowwiseParallel):
    """Row (input-feature) split; the output is a partial sum, all-reduced (or reduce-scattered).

    On an `nn.Embedding` this is the vocabulary-parallel embedding: each rank holds
    a slice of the rows and looks up only the ids that fall in it; its input (token
    ids) is taken as replicated unless `input_layouts` says otherwise.
    """

    def __init__(self, *, input_layouts: Optional[Placement] = None, **layouts):
        super().__init__(input_layouts=input_layouts, **layouts)
        self._ids_replicated = input_layouts is None

    def splits(self, module: nn.Module) -> Splits:
        if isinstance(module, nn.Embedding):
            return {"weight": 0}
        if isinstance(module, nn.Linear):
            return {"weight": 1}
        if is_conv1d(module):
            return {"weight": 0}
        raise _unsupported(self, module)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        splits = self.splits(module)
        embedding = isinstance(module, nn.Embedding)
        self.desired_input_layouts = (Replicate(),) if embedding else (Shard(-1),)
        if embedding and self._ids_replicated:
            self.input_layouts = (Replicate(),)
        return distribute_module(
            module, device_mesh,
            partial(_partition, splits, 1, self.src_data_rank),
            style_input_fn(self),
            style_output_fn(self),
        )


class FanOut(ParallelStyle):
    """Give a module's input to its column-parallel children as one replicated DTensor.

    When several column-parallel projections read the same input (Q, K and V; gate
    and up), each would all-reduce its own input gradient in backward. Wrapping the
    input once, here, lets autograd add their partial gradients first, so backward
    costs one all-reduce per attention or MLP, as forward does. The input is found
    by `map_input`. `input_layouts=Shard(1)` takes a sequence-sharded input and
    all-gathers it (sequence parallelism; backward reduce-scatters the summed gradient).
    """

    def __init__(self, *, input_layouts: Placement = Replicate(), regather: Optional[Regather] = None):
        super().__init__()
        self.input_layouts = input_layouts
        self.regather = regather

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(t):
            shard = t
            if not isinstance(t, DTensor):
                t = DTensor.from_local(t, device_mesh, [self.input_layouts], run_check=False)
            if t.placements == (Replicate(),):
                return t
            gathered = t.redistribute(device_mesh, [Replicate()])
            if self.regather:
                self.regather.note(shard, gathered, device_mesh, self.input_layouts.dim)
            return gathered

        module.register_forward_pre_hook(lambda _, args, kwargs: map_input(args, kwargs, replicate), with_kwargs=True)
        return module


def map_input(args: tuple, kwargs: dict, fn: Callable) -> tuple[tuple, dict]:
    """A forward pre-hook's (args, kwargs) with `fn` applied to the module's input: the first
    positional argument, else the `hidden_states=` keyword (HF's name)."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}


def _style_table(loss_parallel: bool) -> dict[str, ParallelStyle]:
    head = (Colwise(output_layouts=Shard(-1), use_local_output=False) if loss_parallel
            else Colwise(output_layouts=Replicate()))
    return {
        "colwise": Colwise(),
        "rowwise": Rowwise(),
        "colwise_qkv": Colwise(chunks=3),
        "colwise_gather": Colwise(output_layouts=Replicate()),
        "vocab": Rowwise(),
        "vocab_head": head,
        "fan_out": FanOut(),
    }


STYLE_NAMES = tuple(_style_table(True))

StyleSpec = Union[str, ParallelStyle]


def make_style(spec: StyleSpec, *, loss_parallel: bool) -> ParallelStyle:
    """A fresh style object for a plan entry: a name from STYLE_NAMES or a ParallelStyle itself.

    `loss_parallel` decides what "vocab_head" means: logits left sharded over the
    vocabulary (a DTensor for `loss_parallel()`), or all-gathered to full logits.
    """
    return spec if isinstance(spec, ParallelStyle) else _style_table(loss_parallel)[spec]


def style_splits(style: ParallelStyle, module: nn.Module) -> Splits:
    """Which parameter dims `style` cuts on `module` ({} for styles that only move activations)."""
    splits = getattr(style, "splits", None)
    return splits(module) if splits else {}


def style_chunks(style: ParallelStyle) -> int:
    return getattr(style, "chunks", 1)
