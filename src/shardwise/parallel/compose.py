"""The one place that fixes the order techniques are applied in, and the only one here that reads the config.

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
(see checkpointing.py). What each part gets is decided in topology/decisions.py,
which the planner reads too.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

from torch import nn

from ..config.schema import ShardwiseConfig
from ..runtime.mesh import ParallelMesh
from ..topology.decisions import (PrecisionMode, precision_mode, secondary_partition, shards_optimizer_state,
                                  wrapping)
from . import precision
from .materialize import has_meta, mesh_device, place, unit_materialiser
from .pipeline import GraphPipeline, apply_pipeline, has_block_list
from .sharding import apply_data_parallel
from .strategy import Strategy
from .tensor import PlanLike, TensorParallelBatch, apply_tensor_parallel
from .zero1.update import apply_zero1


def parallelize(module: nn.Module, mesh: ParallelMesh, config: ShardwiseConfig, tp_plan: PlanLike = None,
                ddp_options: Optional[Mapping[str, Any]] = None) -> Strategy:
    """`tp_plan`: the user's tensor-parallel plan, for models without a built-in one; `ddp_options`: what
    torch's DistributedDataParallel takes, where the composition chooses it (SMP's DistributedModel arguments)."""
    wrap = functools.partial(wrap_part, ddp_options=ddp_options)
    if config.pipeline_parallel_degree > 1 and (config.pipeline_cut == "graph" or (
            config.pipeline_cut == "auto" and not has_block_list(module))):
        zero1 = functools.partial(_zero1, mesh, config, config.microbatches) if shards_optimizer_state(
            config, mesh.layout) else None
        # cut from the module graph at the first @step
        return GraphPipeline(module, mesh, config, wrap, zero1, tp_plan=tp_plan)
    if config.pipeline_parallel_degree > 1:  # cuts the model into stages, then the same steps per stage
        pipeline = apply_pipeline(module, mesh, config, tp_plan, split_part, wrap)
        if shards_optimizer_state(config, mesh.layout):
            pipeline.binding = _zero1(mesh, config, passes=config.microbatches, deferred=pipeline.ties.held())
        return pipeline
    if has_meta(module) and config.effective_zero_stage >= 2 and config.tensor_parallel_degree == 1:
        # delayed initialisation under ZeRO-2/3 and MiCS: each unit is materialised just before it is sharded
        return wrap(module, mesh, config, before_shard=unit_materialiser(module, mesh))
    place(module, mesh)
    split_part(module, [module], mesh, config, tp_plan)
    return wrap(module, mesh, config)


def split_part(module: nn.Module, callees: list[nn.Module], mesh: ParallelMesh, config: ShardwiseConfig,
               tp_plan: PlanLike) -> None:
    """Tensor parallelism over `module` (placed, equal on every rank); each of `callees`, the modules the
    step calls, gathers or splits the batch inside the tensor-parallel group."""
    if config.tensor_parallel_degree > 1:
        apply_tensor_parallel(module, mesh["tp"], tp_plan, sequence_parallel=config.sequence_parallel)
        for callee in callees:
            TensorParallelBatch(mesh["tp"], config.prescaled_batch).install(callee)


def wrap_part(part: nn.Module, mesh: ParallelMesh, config: ShardwiseConfig, reshard_after_forward: bool = True,
              before_shard: Optional[Callable[[nn.Module], None]] = None,
              ddp_options: Optional[Mapping[str, Any]] = None) -> Strategy:
    """Mixed precision, data parallelism and ZeRO-1 for one part: the whole model, or a pipeline stage.
    `reshard_after_forward=False` keeps ZeRO-3's gathered parameters until backward (split-backward schedules);
    else ZeRO-3 re-shards them after forward, under ZeRO++ hpZ only down to its secondary group."""
    trains = any(p.requires_grad for p in part.parameters())
    how, mode = wrapping(config, mesh.layout, trains), precision_mode(config, mesh.layout, trains)
    dtype = precision.compute_dtype(config)
    if mode is PrecisionMode.STORED:
        precision.store_in_compute_dtype(part, dtype)
    # ZeRO-3 re-shards after forward: over the whole sharding group, or under hpZ over a secondary group (an int)
    after_forward: bool | int = config.effective_zero_stage == 3 and reshard_after_forward
    if after_forward and secondary_partition(config, mesh.layout):
        after_forward = secondary_partition(config, mesh.layout)
    strategy = apply_data_parallel(part, mesh, how, dtype if mode is PrecisionMode.CAST else None,
                                   auto_wrap_min_params=config.auto_wrap_min_params, before_shard=before_shard,
                                   reshard_after_forward=after_forward, ddp_options=ddp_options)
    if mode is PrecisionMode.AUTOCAST:
        device = mesh_device(mesh)
        strategy.autocast = lambda: precision.autocast(dtype, device)
    if shards_optimizer_state(config, mesh.layout):  # ZeRO-1: never with sharding
        strategy.binding = _zero1(mesh, config)
    return strategy


def _zero1(mesh: ParallelMesh, config: ShardwiseConfig, passes: Optional[int] = None,
           deferred: frozenset[int] = frozenset()):
    return apply_zero1(mesh["rdp"].get_group(), masters=config.sharded_master_weights,
                       tp_rank=mesh["tp"].get_local_rank(), passes=passes, deferred=deferred)
