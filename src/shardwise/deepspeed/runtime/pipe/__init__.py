"""`deepspeed.runtime.pipe`: where DeepSpeed defines its pipeline names (shardwise.deepspeed.pipe)."""

from ...pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
