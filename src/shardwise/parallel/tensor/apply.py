"""`apply_tensor_parallel`: split a model's layers over the `tp` mesh axis.

Order inside: pick the plan, check every rule (no collective has run yet), with
`sequence_parallel` shard the blocks' activations over the sequence (sequence.py),
split with `parallelize_module`, re-tie shared weights, make per-rank head counts
local. Parameters keep their names and become DTensors, so `state_dict()` reads
like the unsplit model's and `full_tensor()` gives the whole weight back.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from ...errors import ConfigError, Problem
from .loss import VOCAB_SHARDED_OUTPUT
from .modules import carriers, compose_plan
from .plan import PLAN_KEY, TensorParallelPlan, assignments, resolve
from .registry import BUILTIN_MODEL_TYPES, builtin_plan
from .rules import check_tensor_parallel, tied_parameters
from .sequence import shard_sequence
from .styles import StyleSpec, make_style

log = logging.getLogger(__name__)

PlanLike = Union[TensorParallelPlan, Mapping[str, StyleSpec], None]


def plan_for(model: nn.Module, plan: PlanLike = None, tp: Optional[int] = None) -> TensorParallelPlan:
    """The user's plan (a dict is shorthand for its styles), else the built-in one for the model — with the
    modules marked off left out and the plans of the modules that carry their own added (modules.py).
    `tp`, when known, leaves whole the plan-carrying modules it does not divide."""
    if plan is not None and not isinstance(plan, TensorParallelPlan):
        plan = TensorParallelPlan(dict(plan))
    base = plan if plan is not None or carriers(model) else builtin_plan(model)
    found = compose_plan(model, base, tp)
    if found is None:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError([Problem(PLAN_KEY, kind, "no built-in plan for this model "
                                   f"(built in: {', '.join(BUILTIN_MODEL_TYPES)})",
                                   "pass sw.DistributedModel(model, tensor_parallel_plan={'module.path.pattern': "
                                   "'colwise' | 'rowwise' | …}) (see docs/tensor_parallel.md), or build it from "
                                   "shardwise.nn modules")])
    return found


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: PlanLike = None, *,
                          sequence_parallel: bool = False, regather: bool = False,
                          region_starts: Optional[Sequence[nn.Module]] = None,
                          region_ends: Optional[Sequence[nn.Module]] = None, loss_parallel: bool = True) -> nn.Module:
    """Split `model` in place over the 1-D `tp_mesh` and return it.

    Call it before data-parallel sharding (FSDP2 composes over the other axes) and
    after every rank holds the same weights: split weights are scattered from the
    group's first rank, replicated ones are left as they are. With `loss_parallel`,
    a vocabulary head returns logits as a DTensor sharded over the vocabulary, to
    be consumed under `loss_context(model)`; otherwise the head gathers full logits.
    With `regather` (and `sequence_parallel`) the blocks keep their gathered inputs as
    sequence shards, gathering them again in backward (regather.py). The sequence-parallel
    region begins at the first block of each of `region_starts` and ends at the last block
    of each of `region_ends` (a pipeline's first and last stage views, which share `model`'s
    blocks; stages between pass sequence shards); `model` by default.
    """
    tp = tp_mesh.size()
    if tp == 1:
        return model
    plan = plan_for(model, plan, tp)
    for note in check_tensor_parallel(model, tp, plan):
        log.warning(note)
    entries = assignments(model, plan)
    tied = tied_parameters(model)
    styles = {path: make_style(entry.spec, loss_parallel=loss_parallel) for path, entry in entries.items()}
    if sequence_parallel:
        styles = shard_sequence(model, tp_mesh, plan, entries, styles, regather, region_starts, region_ends)
    parallelize_module(model, tp_mesh, styles)
    _retie(model, tied)
    _localize(model, plan, tp)
    has_vocab_head = any(entry.spec == "vocab_head" for entry in entries.values())
    setattr(model, VOCAB_SHARDED_OUTPUT, loss_parallel and has_vocab_head)
    return model


def _retie(model: nn.Module, tied: list[list[str]]) -> None:
    """Point every alias of a tied weight at one split parameter again.

    Each split module got its own DTensor copy; without this, GPT-2's wte and
    lm_head would train as two separate weights. The rules check has made sure
    the split aliases are split alike; unsplit ones (BERT's head `bias`) follow.
    """
    for names in tied:
        params = [model.get_parameter(name) for name in names]
        param = next((p for p in params if isinstance(p, DTensor)), params[0])
        for name in names:
            path, _, pname = name.rpartition(".")
            model.get_submodule(path).register_parameter(pname, param)


def _localize(model: nn.Module, plan: TensorParallelPlan, tp: int) -> None:
    """Head counts and split sizes an attention module keeps become per-rank values."""
    for pattern, paths in resolve(model, plan.local_attrs).items():
        for path in paths:
            module = model.get_submodule(path)
            for attr in plan.local_attrs[pattern]:
                value = getattr(module, attr, None)
                if isinstance(value, int):
                    setattr(module, attr, value // tp)
