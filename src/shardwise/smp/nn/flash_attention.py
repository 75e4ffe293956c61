"""`FlashAttentionLayer`: SMP's FlashAttention entry point, on torch's `scaled_dot_product_attention`."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .functional import attention
from .module import note_ineffective


def attention_scale(attention_head_size: Optional[int], scale_attention_scores: bool, scale_attn_by_layer_idx: bool,
                    layer_idx: Optional[int], scale: Optional[float], owner: str) -> float:
    """SMP's scale factor: `scale` if given, else 1/sqrt(attention_head_size) and/or 1/(layer_idx + 1)."""
    if scale is not None:
        return float(scale)
    if scale_attention_scores and attention_head_size is None:
        raise ValueError(f"{owner}: scale_attention_scores=True needs attention_head_size; "
                         "fix: pass attention_head_size=..., or a scale=...")
    if scale_attn_by_layer_idx and layer_idx is None:
        raise ValueError(f"{owner}: scale_attn_by_layer_idx=True needs layer_idx; "
                         "fix: pass layer_idx=..., or a scale=...")
    factor = 1.0
    if scale_attention_scores:
        factor /= math.sqrt(attention_head_size)
    if scale_attn_by_layer_idx:
        factor /= layer_idx + 1
    return factor


class FlashAttentionLayer(nn.Module):
    """Attention of a packed q/k/v tensor, with SMP's arguments.

    torch's SDPA chooses the kernel: FlashAttention (or memory-efficient attention)
    on GPUs, and on CPU its fused CPU kernel or plain math — same results, no FlashAttention
    speed. `triton_flash_attention` therefore selects nothing (named once). `attn_mask`
    is always applied when given, additive (such as SMP's `generate_alibi_attn_mask`
    output) or boolean (True where a key takes part); in SMP it needed
    `triton_flash_attention` and `use_alibi`, which here change nothing beyond that.
    Dropout on the probabilities applies in training mode, also with `triton_flash_attention`.
    """

    def __init__(self, attention_dropout_prob: float = 0.1, attention_head_size: Optional[int] = None,
                 scale_attention_scores: bool = True, scale_attn_by_layer_idx: bool = False,
                 layer_idx: Optional[int] = None, scale: Optional[float] = None, triton_flash_attention: bool = False,
                 use_alibi: bool = False):
        super().__init__()
        self.attention_dropout_prob = attention_dropout_prob
        self.scale = attention_scale(attention_head_size, scale_attention_scores, scale_attn_by_layer_idx, layer_idx,
                                     scale, type(self).__name__)
        if triton_flash_attention:
            note_ineffective(type(self).__name__, {
                "triton_flash_attention": "torch's scaled_dot_product_attention picks the kernel for the device"})

    def forward(self, qkv: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                causal: bool = False) -> torch.Tensor:
        """`qkv`: [batch, seq, 3, heads, head_size] → [batch, heads, seq, head_size]."""
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"FlashAttentionLayer expects qkv of shape [batch, seq, 3, heads, head_size], got "
                             f"{list(qkv.shape)}; fix: stack query, key and value on dim 2")
        query, key, value = (t.transpose(1, 2) for t in qkv.unbind(2))
        dropout = self.attention_dropout_prob if self.training else 0.0
        return attention(query, key, value, attn_mask, causal, self.scale, dropout)
