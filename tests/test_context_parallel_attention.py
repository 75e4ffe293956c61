"""Context-parallel attention against one process's SDPA: ring and all-to-all, CP 2 and 4 on 4 gloo ranks.

Each rank holds its load-balanced share of the sequence; outputs and the gradients of queries, keys and values,
gathered back into sequence order, must equal SDPA over the whole sequence (causal, grouped-query heads, and packed
documents that must not see each other), the ring also with the plain-ops block devices without a fused kernel use.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.parallel.context import documents as docs
from shardwise.parallel.context.all_to_all import all_to_all_attention
from shardwise.parallel.context import ring
from shardwise.parallel.context.ring import ring_attention
from shardwise.parallel.context.sharding import global_positions, shard, shard_batch, unshard
from shardwise.testing import run_distributed

BATCH, HEADS, KV_HEADS, SEQ, DIM = 2, 4, 2, 16, 8
PACKED = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2], [0] * 9 + [1] * 7])


def _reference(q, k, v, documents, grad):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    allowed = None if documents is None else docs.mask(documents, documents, True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None, enable_gqa=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _split(mode: str, cp: int, packed: bool, fused: bool = True) -> float:
    """The largest difference from one process for this rank's group of `cp` (world split into 4/cp groups)."""
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(start, start + cp))) for start in range(0, 4, cp)]
    group, cp_rank = groups[rank // cp], rank % cp
    torch.manual_seed(0)
    q, grad = torch.randn(BATCH, HEADS, SEQ, DIM), torch.randn(BATCH, HEADS, SEQ, DIM)
    k, v = torch.randn(BATCH, KV_HEADS, SEQ, DIM), torch.randn(BATCH, KV_HEADS, SEQ, DIM)
    documents = PACKED if packed else None
    want = _reference(q, k, v, documents, grad)
    local = [shard(t, 2, cp_rank, cp).requires_grad_() for t in (q, k, v)]
    split = ring_attention if mode == "ring" else all_to_all_attention
    with mock.patch.dict(ring.FUSED_KERNELS, {} if fused else {"cpu": (ring.math_attention,
                                                                       ring.math_attention_backward)}):
        out = split(*local, group, scale=DIM ** -0.5, causal=True,
                    documents=None if documents is None else shard(documents, 1, cp_rank, cp))
    out.backward(shard(grad, 2, cp_rank, cp))
    errors = []
    for got, expected in zip([out.detach()] + [t.grad for t in local], want):
        pieces = [torch.empty_like(got) for _ in range(cp)]
        dist.all_gather(pieces, got.contiguous(), group=group)
        errors.append((unshard(torch.cat(pieces, 2), 2, cp) - expected).abs().max().item())
    return max(errors)


def split_errors() -> dict:
    errors = {(mode, cp, packed): _split(mode, cp, packed)
              for mode in ("ring", "all_to_all") for cp in (2, 4) for packed in (False, True)}
    # the plain-ops block other devices use, run here on CPU
    errors.update({("ring-math", cp, packed): _split("ring", cp, packed, fused=False)
                   for cp in (2, 4) for packed in (False, True)})
    return errors


def test_ring_and_all_to_all_equal_one_process_attention_and_gradients():
    for errors in run_distributed(split_errors, 4, timeout=300):
        assert max(errors.values()) < 1e-5, errors


def test_load_balanced_split_mirrors_chunks_and_unshards():
    assert global_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert global_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    row = torch.arange(16).unsqueeze(0)
    assert torch.equal(unshard(torch.cat([shard(row, 1, r, 4) for r in range(4)], 1), 1, 4), row)


def test_a_sequence_that_does_not_split_into_two_chunks_per_rank_is_refused():
    with pytest.raises(ValueError, match=r"sequence length 12 does not split into 2 x context_parallel_degree = 8 "
                                         r"equal chunks: pad sequences to a multiple of 8"):
        shard_batch(torch.zeros(1, 12, dtype=torch.long), 0, 4)


def test_documents_from_restarting_positions_and_from_cu_seqlens_agree():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert docs.from_position_ids(positions).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert docs.from_cu_seqlens(torch.tensor([0, 3, 5, 8]), 8).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    inputs, _ = shard_batch(torch.zeros(1, 8, dtype=torch.long), 0, 1, cu_seqlens=torch.tensor([0, 3, 5, 8]))
    assert inputs["position_ids"].tolist() == positions.tolist()
    ids = torch.tensor([[0, 300, 70000 % 65536]])
    assert torch.equal(docs.without_documents(docs.with_documents(torch.zeros(1, 2, 3, 4), ids))[1], ids)


def test_labels_are_shifted_on_the_whole_row_before_the_split():
    _, labels = shard_batch(torch.arange(8).unsqueeze(0), 1, 2, labels=torch.arange(8).unsqueeze(0), pad_token_id=5)
    # rank 1 of 2 holds positions 2, 3, 4, 5: their next tokens are 3, 4, 5 (padding: -100), 6
    assert labels.tolist() == [[3, 4, -100, 6]]
