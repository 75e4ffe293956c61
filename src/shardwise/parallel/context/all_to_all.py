"""All-to-all (Ulysses) attention: trade the sequence split for a head split around each attention.

Before attention one all-to-all gives every rank the whole sequence for 1/n of the heads; attention runs as in one
process (torch's SDPA, any device); a second all-to-all gives the sequence split back. Traffic per rank is fixed
(about 4 × activations × (n-1)/n² of q, k, v and out) whatever n, where the ring's grows with the key/value size;
the cost is that the heads must divide by n.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.parallel.context import documents as docs
from shardwise.torch_internals import all_to_all_autograd
from shardwise.parallel.context.sharding import shard_order


def _exchange(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Send slice i along dim 0 to rank i and receive rank i's as slice i (autograd-aware)."""
    splits = [1] * tensor.shape[0]
    return all_to_all_autograd(tensor.contiguous(), splits, splits, group)


def _to_heads(tensor: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """(batch, heads, local seq, dim) → (batch, heads/n, whole seq in shard order, dim)."""
    batch, heads, seq, dim = tensor.shape
    parts = tensor.reshape(batch, size, heads // size, seq, dim).transpose(0, 1)
    received = _exchange(parts, group)  # slice i: rank i's tokens, this rank's heads
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * seq, dim)


def _to_sequence(tensor: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `_to_heads`."""
    batch, heads, seq, dim = tensor.shape
    parts = tensor.reshape(batch, heads, size, seq // size, dim).permute(2, 0, 1, 3, 4)
    received = _exchange(parts, group)  # slice i: this rank's tokens, rank i's heads
    return received.transpose(0, 1).reshape(batch, size * heads, seq // size, dim)


def all_to_all_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup, *,
                         scale: float, causal: bool = True, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Attention (batch, heads, local seq, dim) of this rank's load-balanced share of the sequence over the whole
    sequence of its group; `documents` (batch, local seq) keeps packed documents apart. Heads must divide by the
    group's size; grouped key/value heads that do not are repeated until they do."""
    size = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size:
        raise ValueError(f"{heads} attention heads do not split over context_parallel_degree {size} in "
                         f"all_to_all mode: choose a degree dividing {heads}, or context_parallel_mode ring")
    if kv_heads % size:
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    if documents is not None:
        query = docs.with_documents(query, documents)
    query, key, value = (_to_heads(t, size, group) for t in (query, key, value))
    order = shard_order(query.shape[2], size, query.device)
    natural = torch.argsort(order)
    query, key, value = (t.index_select(2, natural) for t in (query, key, value))
    if documents is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale,
                                             enable_gqa=key.shape[1] != query.shape[1])
    else:
        query, whole_documents = docs.without_documents(query)
        allowed = docs.mask(whole_documents, whole_documents, causal)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale,
                                             enable_gqa=key.shape[1] != query.shape[1])
    return _to_sequence(out.index_select(2, order), size, group)
