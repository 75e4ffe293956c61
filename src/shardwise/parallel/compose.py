"""The one place that fixes the order techniques are applied in, and the only one under `parallel/` that reads the config.

Order: the model goes to this rank's device (a model built on the meta device
is materialised there, see materialize.py) → every rank starts from the first
data-parallel rank's weights → tensor parallel (layers split over the `tp` axis,
the batch gathered inside each TP group) → per part, `wrap_part`: mixed precision,
data parallel / sharding over the other axes (FSDP2 composes with TP's DTensors),
and ZeRO-1's optimizer side. With pipeline parallelism the model is first cut
into stages, and each rank's stages then get the same steps in the same order
(pipeline/apply.py calls `split_part` and `wrap_part`), so no rank places the
whole model. A meta-built model under ZeRO-2/3 or MiCS without tensor parallelism
skips the placing: each sharding unit is materialised right before FSDP2 shards
it. Activation checkpointing is applied afterwards by the user's
`set_activation_checkpointing` calls, which works on a split and sharded model
(see recompute/). What each part gets is decided by `topology.decisions.Decisions`,
which the planner reads too; everything called from here gets plain values.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config.schema import ShardwiseConfig
from .mesh import ParallelMesh
from ..config.decisions import Decisions, PrecisionMode
from ..config.effects import changed
from . import precision
from .precision import ScalingRule
from .experts import (apply_expert_parallel, expert_parallel_modules, has_experts, require_experts,
                      use_global_load_balancing)
from .context import apply_context_parallel
from .context.batch import split_sequences
from .materialize import has_meta, mesh_device, place, unit_materialiser
from .param_mapping import OriginalNames, adopt_model_parameters
from .pipeline.partition import has_block_list
from .pipeline.settings import PipelineSettings
from .recompute import apply_activation_checkpointing, checkpoint_in_groups, checkpointed, group_size
from .recompute.offload import OffloadSchedule, first_step_check, schedule_for_device
from .sharding import HostOffload, apply_data_parallel
from .strategy import Strategy
from .sharding.units import known_blocks
from .stand_in import Elsewhere
from .tensor import PlanLike, TensorParallelBatch, apply_tensor_parallel, replace_registered
from .zero1.update import apply_zero1


def parallelize(module: nn.Module, mesh: ParallelMesh, config: ShardwiseConfig, tp_plan: PlanLike = None,
                ddp_options: Optional[Mapping[str, Any]] = None) -> Strategy:
    """`tp_plan`: the user's tensor-parallel plan, for models without a built-in one; `ddp_options`: what
    torch's DistributedDataParallel takes, where the composition chooses it (SMP's DistributedModel arguments)."""
    decisions = Decisions(config, mesh.layout)
    if decisions.expert_parallel:
        require_experts(module)
    wrap = functools.partial(wrap_part, mesh=mesh, decisions=decisions, ddp_options=ddp_options)
    split = functools.partial(split_part, mesh=mesh, decisions=decisions)
    # ZeRO-1 under a pipeline: steps once the schedule's microbatches are all back, tied copies summed first
    zero1 = functools.partial(_zero1, mesh, decisions, config.microbatches) if (
        decisions.pipelining and decisions.shards_optimizer_state) else None
    if decisions.graph_cut(has_block_list(module)):  # cut from the module graph at the first @step
        if decisions.context_parallel:  # its stages are graphs: no attention module left to split
            raise ValueError(f"context parallelism: {type(module).__name__} has no block list, and a pipeline cut "
                             "from its module graph keeps no attention modules; fix: give it a list of blocks (an "
                             "nn.ModuleList), or set context_parallel_degree to 1")
        if decisions.expert_parallel:  # its stages are graphs: no experts module left to split
            raise ValueError(f"expert parallelism: {type(module).__name__} has no block list, and a pipeline cut "
                             "from its module graph keeps no experts modules; fix: give it a list of blocks (an "
                             "nn.ModuleList), or set expert_parallel_degree to 1")
        from .pipeline.graph import GraphPipeline  # torch's pipelining is imported by pipelines only

        return GraphPipeline(module, mesh, pipeline_settings(decisions), wrap, zero1, tp_plan=tp_plan)
    if decisions.pipelining:  # cuts the model into stages, then the same steps per stage
        from .pipeline.apply import apply_pipeline  # torch's pipelining is imported by pipelines only

        return apply_pipeline(module, mesh, pipeline_settings(decisions), tp_plan, split, wrap, zero1)
    if decisions.materialises_per_unit(has_meta(module)):
        # delayed initialisation under ZeRO-2/3 and MiCS: each unit is materialised just before it is sharded. No
        # tensor or expert parallelism here, so what `split` installs (context parallelism's attention and hooks, the
        # global load-balancing loss) needs no weights.
        split(module, [module], tp_plan)
        return wrap(module, before_shard=unit_materialiser(module, mesh))
    place(module, mesh)
    split(module, [module], tp_plan)
    return wrap(module)


# What the API layer and the front ends use from `parallel/` besides `strategy`: this module is its one door.
__all__ = ["OffloadSchedule", "OriginalNames", "PlanLike", "ScalingRule", "activation_offload",
           "adopt_model_parameters", "apply_activation_checkpointing", "checkpoint_in_groups", "checkpointed",
           "compute_dtype", "first_step_check", "group_size", "ineffective_for_model", "is_stand_in", "loss_scaler",
           "parallelize", "replace_registered"]


def ineffective_for_model(module: nn.Module, config: ShardwiseConfig) -> list[tuple[str, str]]:
    """Settings only the model makes ineffective: `init` cannot see them."""
    found = []
    if config.delayed_parameter_initialization and not has_meta(module):
        found.append(("delayed_parameter_initialization", "needs the model built inside sw.delay_param_initialization()"))
    if config.effective_zero_stage >= 2 and changed(config, "auto_wrap_min_params") and known_blocks(module):
        found.append(("auto_wrap_min_params", f"{type(module).__name__} is sharded by its own blocks"))
    return found


def is_stand_in(module: nn.Module) -> bool:
    """A pipeline stage's stand-in for a module another stage holds."""
    return isinstance(module, Elsewhere)


def compute_dtype(config: ShardwiseConfig) -> Optional[torch.dtype]:
    """Mixed precision's compute dtype, None in fp32."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


def loss_scaler(config: ShardwiseConfig, device: torch.device) -> Optional[precision.LossScaler]:
    """Dynamic loss scaling for fp16 over every rank, torch's rule until an optimizer configures another."""
    if not config.fp16:
        return None
    return precision.LossScaler(device.type, dist.group.WORLD)


def activation_offload(config: ShardwiseConfig, device: torch.device) -> Optional[OffloadSchedule]:
    """Where checkpointed regions keep their inputs: host memory with offload_activations (on a CPU device, where
    they are), else None."""
    if not config.offload_activations:
        return None
    return schedule_for_device(device, config.activation_loading_horizon)


def pipeline_settings(decisions: Decisions) -> PipelineSettings:
    config = decisions.config
    dtype = compute_dtype(config)
    stored = decisions.precision_mode() in (PrecisionMode.CAST, PrecisionMode.STORED)
    return PipelineSettings(
        stages_per_rank=config.stages_per_rank, balance=config.pipeline_balance,
        split_points=config.pipeline_split_points, auto_partition=config.auto_partition,
        default_partition=config.default_partition, schedule=config.pipeline_schedule, round=config.pipeline_round,
        tensor_parallel_degree=config.tensor_parallel_degree, prescaled_batch=config.prescaled_batch,
        memory_weight=config.effective_memory_weight, compute_dtype=dtype, stage_dtype=dtype if stored else None,
        group_timeout=timedelta(seconds=config.collective_timeout_seconds))


def split_part(module: nn.Module, callees: list[nn.Module], tp_plan: PlanLike, *, mesh: ParallelMesh,
               decisions: Decisions, starts: Optional[list[nn.Module]] = None,
               ends: Optional[list[nn.Module]] = None) -> None:
    """Tensor, expert and context parallelism over `module` (placed, equal on every rank); each of `callees`, the
    modules the step calls, gathers or splits the batch inside the tensor-parallel group and splits its sequences
    over the cp group; `starts` and `ends`, those of them whose inputs and outputs are the model's (a pipeline's
    first and last stage; all of them by default), enter the sequence-parallel region and leave it, and `ends` take
    the loss over the sequence."""
    starts = callees if starts is None else starts
    ends = callees if ends is None else ends
    if decisions.tensor_parallel:
        apply_tensor_parallel(module, mesh["tp"], tp_plan, sequence_parallel=decisions.sequence_parallel,
                              regather=decisions.sequence_parallel_regather, region_starts=starts,
                              region_ends=ends)
        for callee in callees:
            TensorParallelBatch(mesh["tp"], decisions.config.prescaled_batch).install(callee)
    split_experts(module, mesh, decisions)
    split_context(module, callees, ends, mesh, decisions)


def wrap_part(part: nn.Module, *, mesh: ParallelMesh, decisions: Decisions, reshard_after_forward: bool = True,
              before_shard: Optional[Callable[[nn.Module], None]] = None,
              ddp_options: Optional[Mapping[str, Any]] = None) -> Strategy:
    """Mixed precision, data parallelism and ZeRO-1 for one part: the whole model, or a pipeline stage.
    `reshard_after_forward=False` keeps ZeRO-3's gathered parameters until backward (split-backward schedules);
    else ZeRO-3 re-shards them after forward, under ZeRO++ hpZ only down to its secondary group."""
    config = decisions.config
    trains = any(p.requires_grad for p in part.parameters())
    how, mode = decisions.wrapping(trains), decisions.precision_mode(trains)
    dtype = compute_dtype(config)
    if mode is PrecisionMode.STORED:
        precision.store_in_compute_dtype(part, dtype)
    autocast = None
    if mode is PrecisionMode.AUTOCAST:
        autocast = functools.partial(precision.autocast, dtype, mesh_device(mesh))
    plain_zero1 = decisions.shards_optimizer_state and not decisions.pipelining  # a pipeline binds its own
    strategy = apply_data_parallel(part, mesh, how, dtype if mode is PrecisionMode.CAST else None,
                                   auto_wrap_min_params=config.auto_wrap_min_params, before_shard=before_shard,
                                   reshard_after_forward=decisions.reshard_after_forward(not reshard_after_forward),
                                   cross_group=decisions.cross_group, hybrid=decisions.hybrid_sharding,
                                   offload=_host_offload(mesh, decisions), autocast=autocast,
                                   whole_steps_only=config.non_finite_gradients != "off", ddp_options=ddp_options,
                                   binding=_zero1(mesh, decisions) if plain_zero1 else None,
                                   separately=_expert_shares(part, mesh, decisions))
    return strategy


def split_experts(module: nn.Module, mesh: ParallelMesh, decisions: Decisions) -> None:
    """Expert parallelism: each experts module of `module` (the model, or what a pipeline rank keeps of it) split
    over `ep`. A model with experts computes its load-balancing loss over the global batch whenever data-parallel
    or cp ranks split it (`rdp` spans both), as one process would."""
    data = mesh["rdp"].get_group() if mesh.layout.dp * mesh.layout.cp > 1 else None
    if not has_experts(module):
        return
    if decisions.expert_parallel:
        apply_expert_parallel(module, mesh["ep"], data)
    elif data is not None:
        use_global_load_balancing(module, data)


def _expert_shares(part: nn.Module, mesh: ParallelMesh, decisions: Decisions) -> list[tuple[nn.Module, Any]]:
    """Each expert share with the ranks that hold copies of it, which shard and reduce it apart from the rest
    (over the replicas too where FSDP2's hybrid sharding reduces across them; else MiCS's reduction does)."""
    if not decisions.expert_parallel:
        return []
    ranks = mesh["expert_dp"] if decisions.hybrid_sharding else mesh["expert_shard"]
    return [(share, ranks) for share in expert_parallel_modules(part)]


def split_context(module: nn.Module, callees: list[nn.Module], ends: list[nn.Module], mesh: ParallelMesh,
                  decisions: Decisions) -> None:
    """Context parallelism: attention over the whole sequence of the cp ranks, whole rows split before each of
    `callees` runs and the loss of `ends` taken over the sequence (parallel/context/)."""
    if decisions.context_parallel:
        group = mesh["cp"].get_group()
        apply_context_parallel(module, group, decisions.context_parallel_mode, mesh.layout.tp)
        for callee in callees:
            split_sequences(callee, group, ends_model=any(callee is end for end in ends))


def _host_offload(mesh: ParallelMesh, decisions: Decisions) -> Optional[HostOffload]:
    return HostOffload.for_device(mesh_device(mesh)) if decisions.offload_optimizer_state else None


def _zero1(mesh: ParallelMesh, decisions: Decisions, passes: Optional[int] = None,
           deferred: frozenset[int] = frozenset()):
    return apply_zero1(mesh["rdp"].get_group(), masters=decisions.config.sharded_master_weights,
                       tp_rank=mesh["tp"].get_local_rank(), passes=passes, deferred=deferred,
                       offload=_host_offload(mesh, decisions),
                       accumulate_locally=decisions.config.accumulate_gradients_locally)
