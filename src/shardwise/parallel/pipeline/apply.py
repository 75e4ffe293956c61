"""`apply_pipeline`: cut the user's model into stages and give this rank its own.

Order: partition (printed on rank 0) → untie weights shared across stages →
drop what other ranks hold → place this rank's part on its device (initialising
it there when the model was built on the meta device) → one view per local
stage → tensor parallel on the stages (a plan reduced to the modules they hold)
→ data parallel / sharding per stage module → `PipelineStage`s and the schedule.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ...config.schema import ShardwiseConfig
from ...runtime.mesh import ParallelMesh
from .. import precision
from ..materialize import place
from ..sharding import apply_data_parallel
from ..tensor import PlanLike, TensorParallelBatch, TensorParallelPlan, apply_tensor_parallel, plan_for
from ..tensor.plan import match
from .partition import partition
from .runner import PipelineParallel
from .schedule import SPLIT_BACKWARD, EvalSafeStage, build_schedule, stage_ranks
from .stage import Elsewhere, StageModule, prune, stage_view
from .ties import TiedWeights


def stage_plan(model: nn.Module, plan: PlanLike = None) -> TensorParallelPlan:
    """The model's tensor-parallel plan without the patterns that match only modules other stages hold."""
    names = [name for name, module in model.named_modules() if not isinstance(module, Elsewhere)]
    plan = plan_for(model, plan)

    def held(patterns):
        return {p: v for p, v in patterns.items() if any(match(p, name) for name in names)}

    return dataclasses.replace(plan, styles=held(plan.styles), local_attrs=held(plan.local_attrs))


def apply_pipeline(model: nn.Module, mesh: ParallelMesh, config: ShardwiseConfig,
                   tp_plan: PlanLike = None) -> PipelineParallel:
    """Reduce `model` in place to this rank's pipeline stages and return what runs them."""
    pp_mesh = mesh["pp"]
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    total = pp * config.stages_per_rank
    part = partition(model, total, config.pipeline_balance, config.pipeline_split_points, config.stages_per_rank)
    ranks = stage_ranks(config.pipeline_schedule, pp, total)
    if dist.get_rank() == 0:
        print(part.describe(ranks), flush=True)
    local = [s for s in range(total) if ranks[s] == pp_rank]
    ties = TiedWeights(model, part, local)
    prune(model, part, local)
    device = place(model, mesh)
    ties.connect(mesh.layout, dist.get_rank(), ranks)
    ties.broadcast_values()
    stages = [StageModule(stage_view(model, part, s), part, s) for s in local]
    if config.tensor_parallel_degree > 1:
        apply_tensor_parallel(model, mesh["tp"], config, stage_plan(model, tp_plan))
        for stage in stages:
            TensorParallelBatch(mesh["tp"], config.prescaled_batch).install(stage.module)
    wrapped = []
    for stage in stages:
        # A schedule that splits backward in two needs a stage's gathered parameters between the halves.
        dp = apply_data_parallel(stage, mesh, config,
                                 reshard_after_forward=config.pipeline_schedule not in SPLIT_BACKWARD)
        # FSDP2 casts by its own policy, ZeRO-1's half-precision parameters by hooks alike (as without stages)
        if not (isinstance(dp.module, FSDPModule) or config.sharded_master_weights):
            stage.precision = lambda: precision.autocast(config, device)
        elif precision.compute_dtype(config) is not None:
            for stand_in in (m for m in stage.module.modules() if isinstance(m, Elsewhere)):
                stand_in.compute_in(precision.compute_dtype(config))
        stage.install_hooks()
        wrapped.append(dp.module)
    runner = PipelineParallel(model, stages, wrapped, ties, config, pp_mesh.get_group())
    pipeline_stages = [EvalSafeStage(module, stage.index, total, device, group=pp_mesh.get_group())
                       for module, stage in zip(wrapped, stages)]
    runner.schedule = build_schedule(config.pipeline_schedule, pipeline_stages, config.pipeline_round, runner.loss)
    return runner
