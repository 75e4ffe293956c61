"""Ring attention: each rank keeps its queries while key/value blocks travel around the context-parallel group.

The ring itself (send the block on, attend to the one that arrived, merge by logsumexp, and the mirrored backward)
is torch's templated ring attention; shardwise supplies the per-block attention, which adds what torch's lacks on
CPU: a document mask. Document ids ride on queries and keys as extra channels (see `documents`), so each block
knows whose keys it holds wherever in the ring it is. A block runs the device's fused kernel where one returns the
logsumexp the ring merges by and takes a mask (`FUSED_KERNELS`: CPU's flash kernel), else the same math in plain
tensor ops, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise import torch_internals
from shardwise.parallel.context import documents as docs


def _whole_heads(query: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.repeat_interleave(query.shape[1] // tensor.shape[1], dim=1)


def _scores(query, key, is_causal, attn_mask, scale) -> torch.Tensor:
    scores = query.float() @ _whole_heads(query, key).float().transpose(-1, -2) * scale
    if is_causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril(),
                                    float("-inf"))
    return scores if attn_mask is None else scores + attn_mask.float()


def _weights(scores: torch.Tensor, logsumexp: torch.Tensor) -> torch.Tensor:
    return torch.exp(scores - logsumexp.unsqueeze(-1)).nan_to_num(0.0)  # a fully masked row weighs nothing


def math_attention(query, key, value, *, is_causal, attn_mask, scale, **_):
    """One block's (out, logsumexp) in plain tensor ops: any device."""
    scores = _scores(query, key, is_causal, attn_mask, scale)
    lse = scores.logsumexp(-1)
    return (_weights(scores, lse) @ _whole_heads(query, value).float()).to(query.dtype), lse


def math_attention_backward(grad_out, query, key, value, out, logsumexp, *, is_causal, attn_mask, scale, **_):
    """`math_attention`'s gradients for (query, key, value), given the merged out and logsumexp."""
    weights = _weights(_scores(query, key, is_causal, attn_mask, scale), logsumexp)
    grad_out = grad_out.float()
    grad_weights = grad_out @ _whole_heads(query, value).float().transpose(-1, -2)
    grad_scores = weights * (grad_weights - (grad_out * out.float()).sum(-1, keepdim=True)) * scale
    grad_key = grad_scores.transpose(-1, -2) @ query.float()
    grad_value = weights.transpose(-1, -2) @ grad_out

    def per_kv_head(grad: torch.Tensor) -> torch.Tensor:  # grouped-query heads: each key/value head sums its group
        batch, heads, seq, dim = grad.shape
        return grad.view(batch, key.shape[1], heads // key.shape[1], seq, dim).sum(2)

    return ((grad_scores @ _whole_heads(query, key).float()).to(query.dtype), per_kv_head(grad_key).to(key.dtype),
            per_kv_head(grad_value).to(value.dtype))


# device type -> (forward, backward) of a fused kernel returning the logsumexp and taking an additive mask
FUSED_KERNELS = {"cpu": (torch_internals.flash_attention_cpu, torch_internals.flash_attention_cpu_backward)}


@dataclass(frozen=True)
class _Block:
    """The per-block attention torch's ring calls, over queries/keys that may carry document ids."""

    with_documents: bool
    device_type: str

    @property
    def kernels(self):
        return FUSED_KERNELS.get(self.device_type, (math_attention, math_attention_backward))

    def _mask(self, query: torch.Tensor, key: torch.Tensor, is_causal: bool):
        if not self.with_documents:
            return query, key, None, is_causal
        query, query_documents = docs.without_documents(query)
        key, key_documents = docs.without_documents(key)
        allowed = docs.mask(query_documents, key_documents, is_causal)
        # The CPU kernel takes an additive mask of the query's dtype; causality is in it already.
        additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
        additive = additive.masked_fill(~allowed, float("-inf"))
        return query, key, (additive, allowed), False

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool,
                scale: float, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
        query, key, masks, is_causal = self._mask(query, key, is_causal)
        out, lse = self.kernels[0](query, key, value, is_causal=is_causal, attn_mask=masks and masks[0], scale=scale)
        if masks is not None:
            # A query whose document has no key in this block: weight nothing here (the kernel says lse 0).
            lse = lse.masked_fill(~masks[1].any(-1), float("-inf"))
        return out, lse

    def backward(self, *, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool, scale: float,
                 **_: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, masks, is_causal = self._mask(query, key, is_causal)
        grad_query, grad_key, grad_value = self.kernels[1](
            grad_out, query, key, value, out, logsumexp, is_causal=is_causal, attn_mask=masks and masks[0],
            scale=scale)
        if masks is not None:
            grad_query, grad_key = docs.pad_documents(grad_query), docs.pad_documents(grad_key)
        return grad_query, grad_key, grad_value


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, scale, causal, documents):
        block = _Block(documents is not None, query.device.type)
        if documents is not None:
            query, key = docs.with_documents(query, documents), docs.with_documents(key, documents)
        out, lse = torch_internals.ring_attention(group, block.forward, query, key, value, causal, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.scale, ctx.causal, ctx.block = group, scale, causal, block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        grad_query, grad_key, grad_value = torch_internals.ring_attention_backward(
            ctx.group, ctx.block.backward, grad_out.contiguous(), query, key, value, out, lse, ctx.causal,
            scale=ctx.scale)
        if ctx.block.with_documents:
            grad_query, grad_key = grad_query[..., :-docs.CHANNELS], grad_key[..., :-docs.CHANNELS]
        return grad_query, grad_key, grad_value, None, None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup, *,
                   scale: float, causal: bool = True, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Attention (batch, heads, local seq, dim) of this rank's load-balanced share of the sequence over the whole
    sequence of its group; `documents` (batch, local seq) keeps packed documents apart. Keys and values may have
    fewer heads (grouped-query attention): they travel as they are."""
    return _RingAttention.apply(query, key, value, group, scale, causal, documents)
