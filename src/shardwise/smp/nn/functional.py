"""Attention as SMP's modules compute it, on torch's `scaled_dot_product_attention`, and GPT-J's rotary embedding.

SDPA picks the kernel for the device: FlashAttention or memory-efficient kernels on
GPUs, a fused CPU kernel or the plain math on CPU — the same result each time, up
to rounding. No kernel is written here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor] = None,
              causal: bool = False, scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(query · keyᵀ · scale + mask) · value over [..., heads, seq, head_size] tensors.

    `mask` is additive (or boolean, True where a key takes part) and broadcasts to
    [..., heads, query_seq, key_seq]. `causal` hides the keys after each query, the
    last query aligned with the last key (as SMP slices its causal mask).
    """
    if causal:
        q_len, k_len = query.shape[-2], key.shape[-2]
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        mask = allowed if mask is None else torch.where(allowed, _additive(mask, query.dtype), float("-inf"))
    elif mask is not None:
        mask = _additive(mask, query.dtype)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def rotary_embedding(x: torch.Tensor, position_ids: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """GPT-J's rotary position embedding of [N, heads, S, head size] `x` at `position_ids` ([N or 1, S]): the
    first `rotary_dim` dims, taken in pairs (2i, 2i + 1) — GPT-J's interleaved form, not GPT-NeoX's halves —
    turned by the angle position · 10000^(−2i / rotary_dim); the other dims pass. Angles are computed in fp32,
    as Hugging Face's table is."""
    inverse_frequency = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=x.device).float() / rotary_dim))
    angles = position_ids[:, None, :, None].float() * inverse_frequency
    sin, cos = (f(angles).to(x.dtype).repeat_interleave(2, dim=-1) for f in (torch.sin, torch.cos))
    turned, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    pairs = turned.unflatten(-1, (-1, 2))
    quarter_turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return torch.cat((turned * cos + quarter_turned * sin, passed), dim=-1)
