"""`apply_pipeline`: cut the user's model into stages and give this rank its own.

Order: partition (printed on rank 0) → untie weights shared across stages →
drop what other ranks hold → place this rank's part on its device (initialising
it there when the model was built on the meta device) → one view per local
stage → the composition's `split_part` (tensor parallel, a plan reduced to the
modules the stages hold) → its `wrap_part` per stage module (precision, data
parallel / sharding) → `PipelineStage`s and the schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch.distributed as dist
from torch import nn

from ..experts import load_balancing_of, use_global_load_balancing
from ..mesh import ParallelMesh
from ..materialize import place
from ..stage_split import stage_ranks
from ..strategy import OptimizerBinding
from ..tensor import PlanLike, TensorParallelPlan, plan_for
from ..tensor.plan import match
from .partition import partition
from .runner import PipelineParallel
from .schedule import SPLIT_BACKWARD
from .settings import PipelineSettings
from .stage import Elsewhere, StageModule, prune, stage_view
from .ties import TiedWeights, tied_groups


def stage_plan(model: nn.Module, plan: PlanLike, tp: int) -> TensorParallelPlan:
    """The model's tensor-parallel plan without the patterns that match only modules other stages hold
    (and without the plan-carrying modules `tp` does not divide, which stay whole as without a pipeline)."""
    names = [name for name, module in model.named_modules() if not isinstance(module, Elsewhere)]
    plan = plan_for(model, plan, tp)

    def held(patterns):
        return {p: v for p, v in patterns.items() if any(match(p, name) for name in names)}

    return dataclasses.replace(plan, styles=held(plan.styles), local_attrs=held(plan.local_attrs))


def apply_pipeline(model: nn.Module, mesh: ParallelMesh, settings: PipelineSettings, tp_plan: PlanLike,
                   split_part: Callable, wrap_part: Callable,
                   zero1: Optional[Callable[..., OptimizerBinding]] = None) -> PipelineParallel:
    """Reduce `model` in place to this rank's pipeline stages and return what runs them. `split_part(model,
    callees, plan, starts=..., ends=...)` and `wrap_part(part, reshard_after_forward=...)` are the composition's own
    steps (compose.py), applied here to the stages (the first and last stages take the model's inputs and give its
    outputs); `zero1(deferred=...)`: ZeRO-1's binding given the tied copies the pipeline sums itself (None without
    ZeRO-1)."""
    pp_mesh = mesh["pp"]
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    total = pp * settings.stages_per_rank
    part = partition(model, total, settings.balance, settings.split_points, settings.stages_per_rank,
                     settings.auto_partition, settings.default_partition)
    ranks = stage_ranks(settings.schedule, pp, total)
    if dist.get_rank() == 0:
        print(part.describe(ranks), flush=True)
    local = [s for s in range(total) if ranks[s] == pp_rank]
    ties = TiedWeights(model, tied_groups(model, part), local)
    prune(model, part, local)
    device = place(model, mesh)
    ties.connect(mesh.layout, dist.get_rank(), ranks, settings.group_timeout)
    ties.broadcast_values()
    stages = [StageModule(stage_view(model, part, s), part, s) for s in local]
    tp = settings.tensor_parallel_degree
    plan = stage_plan(model, tp_plan, tp) if tp > 1 else None
    split_part(model, [stage.module for stage in stages], plan,
               starts=[stage.module for stage in stages if stage.is_first],
               ends=[stage.module for stage in stages if stage.is_last])
    # A mixture of experts' load-balancing sums run over every stage's layers: split_part installs them over the
    # data-parallel ranks; with one data-parallel rank they still span the stages.
    if load_balancing_of(model) is None:
        use_global_load_balancing(model, None)
    for stage in stages:
        stage.carry = load_balancing_of(model)
    wrapped = []
    for stage in stages:
        # A schedule that splits backward in two needs a stage's gathered parameters between the halves.
        strategy = wrap_part(stage, reshard_after_forward=settings.schedule not in SPLIT_BACKWARD)
        if strategy.autocast is not None:
            stage.precision = strategy.autocast
        elif settings.compute_dtype is not None:  # the stage stores or casts parameters in it
            for stand_in in (m for m in stage.module.modules() if isinstance(m, Elsewhere)):
                stand_in.compute_in(settings.compute_dtype)
        stage.install_hooks()
        wrapped.append(strategy.module)
    binding = zero1(deferred=ties.held()) if zero1 is not None else None
    return PipelineParallel(model, stages, wrapped, ties, pp_mesh.get_group(), settings.schedule, total,
                            settings.round, device, binding=binding)
