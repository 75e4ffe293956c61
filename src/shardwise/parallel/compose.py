"""The one place that fixes the order techniques are applied in.

Order: the model goes to this rank's device (a model built on the meta device
is materialised there, see materialize.py) → every rank starts from the first
data-parallel rank's weights → tensor parallel (layers split over the `tp` axis,
the batch gathered inside each TP group) → data parallel / sharding over the
other axes (FSDP2 composes with TP's DTensors). With pipeline parallelism the
model is first cut into stages, and each rank's stages then get the same steps
in the same order (pipeline/apply.py), so no rank places the whole model. A
meta-built model under ZeRO-2/3 or MiCS without tensor parallelism skips the
placing: each sharding unit is materialised right before FSDP2 shards it. Activation
checkpointing is applied afterwards by the user's `set_activation_checkpointing`
calls, which works on a split and sharded model (see checkpointing.py).
"""

from __future__ import annotations

from torch import nn

from ..config.schema import ShardwiseConfig
from ..runtime.mesh import ParallelMesh
from .materialize import has_meta, place, unit_materialiser
from .pipeline import PipelineParallel, apply_pipeline
from .sharding import DataParallel, apply_data_parallel
from .tensor import PlanLike, TensorParallelBatch, apply_tensor_parallel


def parallelize(module: nn.Module, mesh: ParallelMesh, config: ShardwiseConfig,
                tp_plan: PlanLike = None) -> DataParallel | PipelineParallel:
    """`tp_plan`: the user's tensor-parallel plan, for models without a built-in one."""
    if config.pipeline_parallel_degree > 1:  # cuts the model into stages, then the same steps per stage
        return apply_pipeline(module, mesh, config, tp_plan)
    if has_meta(module) and config.effective_zero_stage >= 2 and config.tensor_parallel_degree == 1:
        # delayed initialisation under ZeRO-2/3 and MiCS: each unit is materialised just before it is sharded
        return apply_data_parallel(module, mesh, config, before_shard=unit_materialiser(module, mesh))
    place(module, mesh)
    if config.tensor_parallel_degree > 1:
        apply_tensor_parallel(module, mesh["tp"], config, tp_plan)
        TensorParallelBatch(mesh["tp"], config.prescaled_batch).install(module)
    return apply_data_parallel(module, mesh, config)
