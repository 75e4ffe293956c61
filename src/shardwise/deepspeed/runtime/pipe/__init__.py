"""`deepspeed.runtime.pipe`: where DeepSpeed defines its pipeline names (shardwise.deepspeed.pipe)."""

from ...pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec
from . import engine, module, topology  # reached as attributes too, as in DeepSpeed

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "engine", "module", "topology"]
