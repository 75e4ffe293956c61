"""The load-balanced split of a sequence over the context-parallel ranks, and its inverse.

Under causal attention late tokens cost more than early ones, so a rank holding one contiguous slice would keep
the others waiting. The sequence is cut into 2·n chunks and rank r keeps chunks r and 2n-1-r (a head chunk and its
mirror from the tail): every rank gets the same causal work. Ring attention (torch's) expects exactly this layout,
and the all-to-all mode uses it too, so the rest of the model never knows which mode runs.
"""

from __future__ import annotations

import torch

from shardwise.parallel.context import documents as docs
from shardwise.parallel.context.loss import shift_labels


def check_divisible(seq_len: int, size: int) -> None:
    """A sequence must cut into 2 × degree equal chunks."""
    if seq_len % (2 * size):
        raise ValueError(f"sequence length {seq_len} does not split into 2 x context_parallel_degree = {2 * size} "
                         f"equal chunks: pad sequences to a multiple of {2 * size}")


def global_positions(seq_len: int, rank: int, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The positions in the whole sequence of the tokens `rank` holds, in the order it holds them."""
    check_divisible(seq_len, size)
    chunk = seq_len // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([head, tail])


def shard_order(seq_len: int, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The positions of every rank's tokens, rank after rank: what concatenating the shards gives."""
    return torch.cat([global_positions(seq_len, rank, size, device) for rank in range(size)])


def shard(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """The part of `tensor` (whole sequences along `dim`) that `rank` of `size` holds."""
    return tensor.index_select(dim, global_positions(tensor.shape[dim], rank, size, tensor.device))


def unshard(gathered: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Every rank's shard concatenated along `dim` (rank after rank) back in sequence order."""
    order = shard_order(gathered.shape[dim], size, gathered.device)
    return gathered.index_select(dim, torch.argsort(order))


def shard_batch(input_ids: torch.Tensor, rank: int, size: int, *, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                pad_token_id: int | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """This rank's model inputs and shifted labels from whole rows (batch, seq).

    Positions, documents and next-token labels are worked out on the whole rows first, since no rank sees where
    its chunks sit: `position_ids` default to 0..seq-1, or restart per document of `cu_seqlens`; packed
    documents (positions restarting, or `cu_seqlens`) give `document_ids`, which the attention keeps apart.
    Returns (inputs for the model's forward, labels for `sequence_loss` or None)."""
    batch, seq = input_ids.shape
    check_divisible(seq, size)
    if cu_seqlens is not None:
        documents = docs.from_cu_seqlens(cu_seqlens, seq).expand(batch, -1)
        if position_ids is None:
            starts = cu_seqlens[:-1].index_select(0, documents[0])
            position_ids = (torch.arange(seq, device=input_ids.device) - starts).expand(batch, -1)
    elif position_ids is not None:
        documents = docs.from_position_ids(position_ids)
    else:
        documents = None
        position_ids = torch.arange(seq, device=input_ids.device).expand(batch, -1)
    inputs = {"input_ids": shard(input_ids, 1, rank, size), "position_ids": shard(position_ids, 1, rank, size)}
    if documents is not None and bool(documents[:, -1].any()):
        inputs["document_ids"] = shard(documents, 1, rank, size)
    shifted = None if labels is None else shard(shift_labels(labels, pad_token_id), 1, rank, size)
    return inputs, shifted
