"""Sequence parallelism (Megatron-SP): the activations between tensor-parallel layers sharded over the sequence.

Plain tensor parallelism runs the norms, dropouts and residual adds between a
row-parallel output and the next column-parallel input on the full activations,
on every rank of the group. With `sequence_parallel` they run on 1/tp of the
sequence: row-parallel projections reduce-scatter their partial sums over the
sequence instead of all-reducing them, and the column-parallel entry points
(attention, MLP) all-gather the sequence back. An all-reduce is a reduce-scatter
plus an all-gather, so the traffic is unchanged while the region's activations
shrink by tp.

Where the region begins and ends is what lets Hugging Face models run unchanged:
their bodies derive masks and positions from the embedding output's sequence
length, and reshape or pool with the full sequence after the blocks. So the
embeddings, the final norm and the head stay as in plain tensor parallelism and
the region spans only the blocks (`SequencePlan.blocks`): the first block's input
is cut to this rank's slice (no communication; backward all-gathers the
gradient) and the last block's output is all-gathered (backward takes the slice).

Norm weights stay whole (Replicate DTensors, via torch's `SequenceParallel`);
each rank's gradient covers only its tokens, so it is summed over the group in
backward — one all-reduce of the norm's few weights, which FSDP2 does itself when
it has taken the parameters over.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from ...config.decisions import splits_evenly
from ...errors import ConfigError, Problem
from .plan import PLAN_KEY, Entry, TensorParallelPlan, resolve
from .regather import Regather
from .styles import Colwise, FanOut, Rowwise, map_input

KEY = "sequence_parallel"
SEQUENCE_DIM = 1
_FEEDS_REGION = ("colwise", "colwise_qkv", "colwise_gather", "fan_out")  # styles that can read the residual stream


def _edge_style(spec: str, regather: Optional[Regather]) -> ParallelStyle:
    """A fresh style for a layer at the edge of the region: it reads or writes sequence shards (and tells
    `regather` what it gathered)."""
    seq = Shard(SEQUENCE_DIM)
    return {
        "colwise": lambda: Colwise(input_layouts=seq, regather=regather),
        "colwise_qkv": lambda: Colwise(chunks=3, input_layouts=seq, regather=regather),
        "colwise_gather": lambda: Colwise(input_layouts=seq, output_layouts=Replicate(), regather=regather),
        "fan_out": lambda: FanOut(input_layouts=seq, regather=regather),
        "rowwise": lambda: Rowwise(output_layouts=seq),
    }[spec]()


def _sum_over_shards(grad: DTensor) -> DTensor:
    """A norm weight's gradient from this rank's tokens (Partial), summed over the group."""
    return grad.redistribute(grad.device_mesh, [Replicate()])


class SequenceNorm(SequenceParallel):
    """A norm on sequence shards (torch's `SequenceParallel`) returning a local tensor, as HF blocks expect;
    its weights' gradients are summed over the group in backward, so every later user sees whole gradients."""

    def __init__(self):
        super().__init__(sequence_dim=SEQUENCE_DIM, use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        for param in module.parameters():
            param.register_hook(_sum_over_shards)
        return module


def _check_length(t: torch.Tensor, tp: int) -> None:
    length = t.shape[SEQUENCE_DIM]
    if not splits_evenly(length, tp):
        raise ValueError(f"{KEY}: the sequence length {length} does not divide by tensor_parallel_degree {tp}; "
                         f"fix: pad or cut the inputs to a multiple of {tp} positions, or set {KEY} to false")


def _scatter(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's slice of the sequence of a full (replicated) activation."""
    _check_length(t, mesh.size())
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(
        mesh, [Shard(SEQUENCE_DIM)]).to_local()


def _gather(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The full sequence of a sequence-sharded activation."""
    return DTensor.from_local(t, mesh, [Shard(SEQUENCE_DIM)], run_check=False).redistribute(
        mesh, [Replicate()]).to_local()


def _map_output(outputs: Any, fn: Callable) -> Any:
    """A block's output with `fn` applied to its hidden states (the tensor, or a tuple's first item)."""
    if isinstance(outputs, tuple):
        return (fn(outputs[0]), *outputs[1:])
    return fn(outputs)


def _within(path: str, roots: Iterable[str]) -> bool:
    return any(path.startswith(f"{root}.") for root in roots)


def shard_sequence(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan, entries: Mapping[str, Entry],
                   styles: Mapping[str, ParallelStyle], regather: bool = False,
                   starts: Optional[Sequence[nn.Module]] = None,
                   ends: Optional[Sequence[nn.Module]] = None) -> dict[str, ParallelStyle]:
    """Install the region's edges, on the first block of each of `starts` and the last block of each of `ends`
    (the model itself by default, or a pipeline's first and last stage views: the stages between hand each other
    sequence shards); return `styles` for the sequence region.

    Inside the blocks, a row-parallel layer reduce-scatters over the sequence, and a
    column-parallel layer (or `fan_out`) that reads the residual stream all-gathers
    it; layers under a `fan_out` already get its gathered input. The plan's norms
    run on sequence shards. Styles given as ParallelStyle objects are kept as they are.
    With `regather` the blocks keep each gathered input as its shard and gather it again
    in backward (regather.py).
    """
    seq = plan.sequence
    if seq is None:
        raise ConfigError([Problem(KEY, True, f"the tensor-parallel plan {plan.name!r} does not say where the "
                                   "sequence may be sharded",
                                   "give TensorParallelPlan(..., sequence=SequencePlan(blocks=..., norms=...)), "
                                   f"or set {KEY} to false")])
    def blocks_of(module: nn.Module) -> list[str]:
        return resolve(module, {seq.blocks: "sequence blocks"})[seq.blocks]

    blocks = blocks_of(model)
    fan_outs = [path for path, entry in entries.items() if entry.spec == "fan_out"]
    keeper = Regather() if regather else None
    for path in blocks if keeper else ():
        keeper.attach(model.get_submodule(path))
    result = dict(styles)
    for path, entry in entries.items():
        if not _within(path, blocks) or not isinstance(entry.spec, str):
            continue
        if entry.spec == "rowwise" or (entry.spec in _FEEDS_REGION and not _within(path, fan_outs)):
            result[path] = _edge_style(entry.spec, keeper)
    problems = []
    for pattern, paths in resolve(model, dict.fromkeys(seq.norms, "sequence norm")).items():
        for path in paths:
            if path in result or not _within(path, blocks):
                problems.append(Problem(f"{PLAN_KEY}.sequence.norms[{pattern!r}]", path,
                                        f"must be a module inside the blocks {seq.blocks!r} without another style",
                                        "list only the norms inside the blocks"))
            result[path] = SequenceNorm()
    if problems:
        raise ConfigError(problems)
    for start in (model,) if starts is None else starts:
        first = start.get_submodule(blocks_of(start)[0])
        first.register_forward_pre_hook(
            lambda _, args, kwargs: map_input(args, kwargs, partial(_scatter, mesh=tp_mesh)), with_kwargs=True)
    for end in (model,) if ends is None else ends:
        last = end.get_submodule(blocks_of(end)[-1])
        last.register_forward_hook(lambda _, args, outputs: _map_output(outputs, partial(_gather, mesh=tp_mesh)))
    return result
