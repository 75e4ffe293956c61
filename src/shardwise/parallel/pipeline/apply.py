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
from typing import Callable

import torch.distributed as dist
from torch import nn

from ...config.schema import ShardwiseConfig
from ...runtime.mesh import ParallelMesh
from .. import precision
from ..materialize import place
from ..tensor import PlanLike, TensorParallelPlan, plan_for
from ..tensor.plan import match
from .partition import partition
from .runner import PipelineParallel
from .schedule import SPLIT_BACKWARD, EvalSafeStage, build_schedule, stage_ranks
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


def apply_pipeline(model: nn.Module, mesh: ParallelMesh, config: ShardwiseConfig, tp_plan: PlanLike,
                   split_part: Callable, wrap_part: Callable) -> PipelineParallel:
    """Reduce `model` in place to this rank's pipeline stages and return what runs them. `split_part` and
    `wrap_part` are the composition's own steps (compose.py), applied here to the stages."""
    pp_mesh = mesh["pp"]
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    total = pp * config.stages_per_rank
    part = partition(model, total, config.pipeline_balance, config.pipeline_split_points, config.stages_per_rank,
                     config.auto_partition, config.default_partition)
    ranks = stage_ranks(config.pipeline_schedule, pp, total)
    if dist.get_rank() == 0:
        print(part.describe(ranks), flush=True)
    local = [s for s in range(total) if ranks[s] == pp_rank]
    ties = TiedWeights(model, tied_groups(model, part), local)
    prune(model, part, local)
    device = place(model, mesh)
    ties.connect(mesh.layout, dist.get_rank(), ranks)
    ties.broadcast_values()
    stages = [StageModule(stage_view(model, part, s), part, s) for s in local]
    tp = config.tensor_parallel_degree
    plan = stage_plan(model, tp_plan, tp) if tp > 1 else None
    split_part(model, [stage.module for stage in stages], mesh, config, plan)
    wrapped = []
    for stage in stages:
        # A schedule that splits backward in two needs a stage's gathered parameters between the halves.
        strategy = wrap_part(stage, mesh, config, reshard_after_forward=config.pipeline_schedule not in SPLIT_BACKWARD)
        if strategy.autocast is not None:
            stage.precision = strategy.autocast
        elif precision.compute_dtype(config) is not None:  # the stage stores or casts parameters in it
            for stand_in in (m for m in stage.module.modules() if isinstance(m, Elsewhere)):
                stand_in.compute_in(precision.compute_dtype(config))
        stage.install_hooks()
        wrapped.append(strategy.module)
    runner = PipelineParallel(model, stages, wrapped, ties, pp_mesh.get_group(), config.pipeline_round)
    pipeline_stages = [EvalSafeStage(module, stage.index, total, device, group=pp_mesh.get_group())
                       for module, stage in zip(wrapped, stages)]
    runner.schedule = build_schedule(config.pipeline_schedule, pipeline_stages, config.pipeline_round, runner.loss)
    return runner
