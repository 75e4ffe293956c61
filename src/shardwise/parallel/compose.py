"""The one place that fixes the order techniques are applied in.

Order: every rank starts from rank 0's weights → tensor parallel (layers split
over the `tp` axis, the batch gathered inside each TP group) → data parallel /
sharding over the other axes (FSDP2 composes with TP's DTensors). With pipeline
parallelism the model is first cut into stages, and each stage then gets tensor
parallel → data parallel in the same order (pipeline/apply.py). Activation
checkpointing is applied afterwards by the user's `set_activation_checkpointing`
calls, which works on a split and sharded model (see checkpointing.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..config.schema import ShardwiseConfig
from ..runtime.mesh import ParallelMesh
from .pipeline import PipelineParallel, apply_pipeline
from .sharding import DataParallel, apply_data_parallel
from .tensor import PlanLike, TensorParallelBatch, apply_tensor_parallel


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    """Make every rank hold rank 0's parameters and buffers, whatever seed each rank used."""
    if dist.get_world_size() == 1:
        return
    for tensor in list(module.parameters()) + list(module.buffers()):
        if not tensor.is_meta:  # delayed initialisation gives meta tensors equal values without it
            dist.broadcast(tensor.data, src=0)


def parallelize(module: nn.Module, mesh: ParallelMesh, config: ShardwiseConfig,
                tp_plan: PlanLike = None) -> DataParallel | PipelineParallel:
    """`tp_plan`: the user's tensor-parallel plan, for models without a built-in one."""
    broadcast_from_rank0(module)
    if config.pipeline_parallel_degree > 1:  # cuts the model into stages, then TP and DP per stage
        return apply_pipeline(module, mesh, config, tp_plan)
    if config.tensor_parallel_degree > 1:
        apply_tensor_parallel(module, mesh["tp"], config, tp_plan)
        TensorParallelBatch(mesh["tp"], config.prescaled_batch).install(module)
    return apply_data_parallel(module, mesh, config)
