"""DeepSpeed's `deepspeed.pipe` over shardwise's pipeline: PipelineModule, LayerSpec, TiedLayerSpec, topologies.

    from shardwise.deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec

    net = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 16), nn.ReLU(), LayerSpec(nn.Linear, 16, 4)],
                         num_stages=2, loss_fn=nn.MSELoss())

The stage boundaries are DeepSpeed's for the same layers (partition.py); the
layers run on shardwise's block-list pipeline cut (module.py says how, and where
shardwise does otherwise).
"""

from .module import PipelineModule, PipelineModuleLayer, checkpoint
from .partition import partition_balanced, partition_uniform
from .spec import LayerSpec, TiedLayerSpec
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule",
           "PipelineModuleLayer", "ProcessTopology", "TiedLayerSpec", "checkpoint", "partition_balanced",
           "partition_uniform"]
