"""Packed documents: which document each token belongs to, and the mask that keeps them apart.

A packed row holds several documents back to back; one process's Hugging Face model keeps them apart when
`position_ids` restart at each document. Once the row is split over ranks no rank sees where documents start, so
document ids are found on the whole row before the split and then travel with the tokens. Attention kernels move
queries and keys between ranks without any side data, so the ids ride along as extra channels of the head
dimension (`with_documents`), which the attention block takes off again (`without_documents`) before its kernel.
"""

from __future__ import annotations

import torch

# Ids travel as base-256 digits: exact in bf16 and fp16 (integers up to 256 are), 65536 documents per row.
CHANNELS, _BASE = 2, 256  # channels appended per token


def from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids (batch, seq) from position ids: a new document wherever a position does not follow the
    previous one by 1 (a restart at 0, as packing collators write them, or any jump)."""
    steps = torch.diff(position_ids, dim=-1, prepend=position_ids[..., :1] - 1)
    return (steps != 1).long().cumsum(-1)


def from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Document ids (1, seq) from cumulative document lengths ([0, len0, len0+len1, ..., seq]), as flash-attention
    kernels take them."""
    positions = torch.arange(seq_len, device=cu_seqlens.device)
    return torch.bucketize(positions, cu_seqlens[1:-1], right=True).unsqueeze(0)


def with_documents(tensor: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """`tensor` (batch, heads, seq, dim) with each token's document id appended to its head dimension."""
    digits = torch.stack([(documents // _BASE**i) % _BASE for i in range(CHANNELS)], dim=-1)
    digits = digits.unsqueeze(1).expand(-1, tensor.shape[1], -1, -1).to(tensor.dtype)
    return torch.cat([tensor, digits], dim=-1)


def without_documents(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo `with_documents`: the tensor as it was and the document ids (batch, seq)."""
    digits = tensor[:, 0, :, -CHANNELS:].round().long()
    documents = sum(digits[..., i] * _BASE**i for i in range(CHANNELS))
    return tensor[..., :-CHANNELS], documents


def pad_documents(gradient: torch.Tensor) -> torch.Tensor:
    """A gradient for a tensor carrying document ids: zero for the id channels (they are no parameters' outputs)."""
    return torch.nn.functional.pad(gradient, (0, CHANNELS))


def mask(query_documents: torch.Tensor, key_documents: torch.Tensor, causal: bool) -> torch.Tensor:
    """Which keys each query may see (batch, 1, q, k): its own document only, and (causal) not ahead of itself.

    `causal` compares places within this block; the caller passes blocks in sequence order."""
    allowed = query_documents.unsqueeze(-1) == key_documents.unsqueeze(-2)
    if causal:
        allowed = allowed & torch.ones(allowed.shape[-2:], dtype=torch.bool, device=allowed.device).tril()
    return allowed.unsqueeze(1)
