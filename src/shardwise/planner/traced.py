"""Spec of any `nn.Module`, from one traced forward on the meta device (the only planner module needing torch).

The forward runs on fake example inputs through the pipeline's own tracer
(`parallel/pipeline/graph_cut.py`): FLOPs by torch's `FlopCounterMode`, the bytes
autograd saves for backward, and parameters, per called module. A model with a
list of repeated blocks (the runtime's `find_blocks`: what the pipeline and
FSDP2 cut along) is one block's costs × blocks, plus what runs before and after
them; a model without one is one block, and for every pipeline degree its
stages are the module-graph cut the runtime would make (`pipeline_cut: graph`,
`memory_weight` at its default). Costs are per token: per sample, times `seq`
positions when the inputs have them.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..config.schema import ShardwiseConfig
from ..parallel.pipeline.graph_cut import Call, captured, cut_units, split_units, trace_calls
from ..parallel.pipeline.blocks import Blocks
from ..parallel.pipeline.partition import find_blocks, has_block_list
from .errors import PlanError
from .spec import ModelSpec, StageCost, Traced

TRACE_BATCH = 2  # samples traced: costs are per token, and a batch of one takes shortcuts in some models
MAX_STAGES = 32  # module-graph cuts made ahead, for pipeline degrees up to this
_FP32 = 4


def example_inputs(model: nn.Module, target: str, module: ModuleType, input_shape: Optional[Sequence[int]],
                   seq: int) -> dict[str, Any]:
    """The forward's inputs for `TRACE_BATCH` samples, by parameter name: a float tensor of `input_shape` per
    sample, else what the builder's module's `example_inputs(batch, seq)` returns (a tensor, a tuple of
    positional arguments or a dict of keyword arguments)."""
    if input_shape:
        args: Any = torch.zeros(TRACE_BATCH, *input_shape)
    elif callable(getattr(module, "example_inputs", None)):
        args = module.example_inputs(TRACE_BATCH, seq)
    else:
        raise PlanError(f"model {target!r}: {type(model).__name__} has no Hugging Face config, so the planner traces "
                        f"its forward and needs example inputs; pass --input-shape with one sample's shape (e.g. "
                        f"--input-shape 1024), or define example_inputs(batch, seq) in module {module.__name__!r}")
    if isinstance(args, dict):
        return args
    args = args if isinstance(args, tuple) else (args,)
    try:
        return dict(inspect.signature(model.forward).bind(*args).arguments)
    except TypeError as err:
        raise PlanError(f"model {target!r}: the example inputs do not fit {type(model).__name__}.forward ({err}); "
                        "return a dict of keyword arguments from example_inputs(batch, seq)") from None


def _calls(root: Call) -> dict[str, Call]:
    found, pending = {}, [root]
    while pending:
        call = pending.pop()
        found[call.path] = call
        pending.extend(call.children)
    return found


def _tensors(model: nn.Module, paths: Sequence[str]) -> tuple[int, ...]:
    return tuple(p.numel() for path in paths for p in model.get_submodule(path).parameters())


def _stage_costs(root: Call, stages: int, tokens: int) -> Optional[tuple[StageCost, ...]]:
    """The module-graph cut into `stages` as the runtime makes it, per token; None when too few units."""
    units = cut_units(root, stages)
    if len(units) < stages:
        return None
    _, stage_of = split_units(units, stages, ShardwiseConfig().effective_memory_weight)
    runs = [[u for u, s in zip(units, stage_of) if s == stage] for stage in range(stages)]
    return tuple(StageCost(tuple(t for u in run for t in u.tensors), sum(u.flops for u in run) / tokens,
                           sum(u.saved_bytes for u in run) / tokens, run[-1].output_bytes / _FP32 / tokens)
                 for run in runs)


def _graph_cuts(root: Call, tokens: int) -> tuple[tuple[StageCost, ...], ...]:
    cuts: list[tuple[StageCost, ...]] = []
    while len(cuts) + 1 < MAX_STAGES and (cut := _stage_costs(root, len(cuts) + 2, tokens)) is not None:
        cuts.append(cut)
    return tuple(cuts)


def _block_list(model: nn.Module) -> Optional[Blocks]:
    """The blocks the runtime's pipeline cuts along; None where it cuts the module graph instead."""
    try:
        return find_blocks(model) if has_block_list(model) else None
    except ValueError:  # parameters beside the blocks on a module enclosing them: no block-list cut
        return None


def _groupable(blocks: nn.Module) -> bool:
    """Whether set_activation_checkpointing can group these blocks: an nn.Sequential running them in turn."""
    return isinstance(blocks, nn.Sequential) and type(blocks).forward is nn.Sequential.forward


def spec_from_module(model: nn.Module, name: str, inputs: dict[str, Any], seq: int) -> ModelSpec:
    """The spec of `model` from one traced forward of `inputs` (`TRACE_BATCH` samples of `seq` positions)."""
    root, _ = captured(model, "trace", lambda: trace_calls(model, inputs))
    tokens = TRACE_BATCH * seq
    counted = sum(p.numel() for p in model.parameters())
    shape = dict(name=name, family="module", heads=1, kv_heads=1, ffn=0, vocab=0, seq_len=seq, activation="relu",
                 gated_mlp=False, norm="layernorm", attention_dropout=0.0, hidden_dropout=0.0, parameters=counted,
                 tied_head=False, head_outputs=0)
    blocks = _block_list(model)
    if blocks is None:
        traced = Traced(root.flops / tokens, root.saved_bytes / tokens, 0.0, 0.0, 0.0, _graph_cuts(root, tokens))
        return ModelSpec(**shape, hidden=root.output_bytes / _FP32 / tokens, layers=1, layer_tensors=root.tensors,
                         embedding_tensors=(), head_tensors=(), traced=traced)
    calls = _calls(root)
    block_calls = [calls[f"{blocks.path}.{i}"] for i in range(blocks.count) if f"{blocks.path}.{i}" in calls]
    before = [calls[p] for p in blocks.before if p in calls]
    block_flops = sum(c.flops for c in block_calls) / max(len(block_calls), 1)
    block_saved = sum(c.saved_bytes for c in block_calls) / max(len(block_calls), 1)
    first_saved = sum(c.saved_bytes for c in before)
    traced = Traced(block_flops / tokens, block_saved / tokens, (root.flops - blocks.count * block_flops) / tokens,
                    first_saved / tokens, (root.saved_bytes - blocks.count * block_saved - first_saved) / tokens)
    hidden = block_calls[0].output_bytes / _FP32 / tokens if block_calls else 0
    return ModelSpec(**shape, hidden=hidden, layers=blocks.count,
                     layer_tensors=_tensors(model, [f"{blocks.path}.0"]),
                     embedding_tensors=_tensors(model, blocks.before), head_tensors=_tensors(model, blocks.after),
                     traced=traced, sequential_blocks=_groupable(model.get_submodule(blocks.path)))
