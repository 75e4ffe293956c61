"""SMP v1's `smp.nn`: distributed modules that tensor parallelism splits, and SMP's fused-kernel stand-ins.

    model.encoder = sw.nn.DistributedTransformer(num_layers=12, num_attention_heads=16, attention_head_size=64,
                                                 hidden_size=1024, intermediate_size=4096)
    model = sw.DistributedModel(model)    # split over the `tp` axis when tensor_parallel_degree > 1

Each module computes in one process what SMP documents; `DistributedModel` splits
it Megatron-style with DTensor (module.py). `huggingface` holds SMP's state-dict
translation functions.
"""

from . import huggingface
from .attention import DistributedAttentionLayer
from .flash_attention import FlashAttentionLayer
from .layers import DistributedEmbedding, DistributedLinear
from .lm_head import DistributedTransformerLMHead
from .module import DistributedModule
from .norm import FusedLayerNorm
from .transformer import DistributedTransformer, DistributedTransformerLayer, DistributedTransformerOutputLayer

__all__ = [
    "DistributedAttentionLayer", "DistributedEmbedding", "DistributedLinear", "DistributedModule",
    "DistributedTransformer", "DistributedTransformerLMHead", "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer", "FlashAttentionLayer", "FusedLayerNorm", "huggingface",
]
