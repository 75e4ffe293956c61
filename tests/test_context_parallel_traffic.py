"""Context parallelism's traffic: the bytes each rank sends, counted at the collectives, equal the planner's.

One attention layer forward and backward on 4 gloo ranks, ring and all-to-all, CP 2 and 4, with and without
packed documents (their ids ride on queries and keys): bench/context_parallel.py's `attention_traffic` counts the
bytes of every all-to-all that go to other ranks, and planner/context.py's `wire_bytes` must give them exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardwise.planner.context import AttentionShape, splits, wire_bytes
from shardwise.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from context_parallel import attention_traffic  # noqa: E402


def traffic_cases() -> dict:
    return {(mode, cp, documents): attention_traffic(mode, cp, 64, documents, heads=4, kv_heads=2, head_dim=8)
            for mode in ("ring", "all_to_all") for cp in (2, 4) for documents in (False, True)}


def test_bytes_on_the_wire_per_rank_equal_the_planners_theory():
    for by_case in run_distributed(traffic_cases, 4, timeout=300):
        for case, got in by_case.items():
            assert got["forward"] == got["theory_forward"] > 0, case
            assert got["backward"] == got["theory_backward"] > 0, case


def test_ring_sends_the_key_value_blocks_and_all_to_all_a_fixed_share():
    shape = AttentionShape(batch=1, seq=1024, heads=8, kv_heads=8, head_dim=64, element_bytes=2)
    block = 2 * 1024 // 4 * 8 * 64 * 2  # keys and values of a quarter of the sequence, bf16
    assert wire_bytes("ring", 4, shape) == {"forward": 3 * block, "backward": 3 * block + 4 * block * 2}
    assert wire_bytes("all_to_all", 4, shape)["forward"] == 2 * block * 3 / 4  # q, k, v, out: 3/4 of each


def test_what_does_not_split_is_said():
    assert splits("all_to_all", 4, 6, 64) == ("6 attention heads do not split over context_parallel_degree 4 in "
                                             "all_to_all mode")
    assert splits("ring", 4, 6, 64) is None
    assert splits("ring", 4, 6, 60).startswith("sequence length 60 does not split")
    with pytest.raises(ValueError, match="context_parallel_mode 'tree'"):
        wire_bytes("tree", 2, AttentionShape(1, 8, 2, 2, 4))
