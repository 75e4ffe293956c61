"""planner/experts.py: expert memory per rank, all-to-all bytes and the EP degrees possible (pure arithmetic;
test_expert_parallel.py checks the bytes against measured traffic)."""

import pytest

from shardwise.planner.experts import (COUNT_BYTES, ROUTER_SKEW, all_to_all_bytes, crossing_bytes, ep_degrees,
                                       expert_parameters_per_rank, expert_shape, received_rows)

MIXTRAL_8X7B = expert_shape(experts=8, top_k=2, moe_layers=32, hidden=4096, expert_ffn=14336)


def test_mixtral_8x7b_experts_hold_its_published_share_of_parameters():
    # 32 layers × 8 experts × 3 × 4096 × 14336: 45.1 B of Mixtral 8x7B's 46.7 B
    assert MIXTRAL_8X7B.parameters == 32 * 8 * 3 * 4096 * 14336
    assert expert_parameters_per_rank(MIXTRAL_8X7B, ep=8, shards=2) == MIXTRAL_8X7B.parameters / 16


def test_all_to_all_bytes_count_dispatch_and_combine_both_ways_and_the_busiest_ranks_extra_rows():
    shape = expert_shape(experts=4, top_k=2, moe_layers=3, hidden=16, expert_ffn=32)
    rows = 100 * 2
    balanced = 3 * (4 * rows * 16 * 4 + 4 * COUNT_BYTES)
    assert all_to_all_bytes(shape, 100, ep=2, element_bytes=4, skew=1.0) == balanced
    assert all_to_all_bytes(shape, 100, ep=2, element_bytes=4) == 3 * (
        2 * (rows + ROUTER_SKEW * rows) * 16 * 4 + 4 * COUNT_BYTES)
    assert all_to_all_bytes(shape, 100, ep=1, element_bytes=4) == 0
    assert crossing_bytes(shape, 100, ep=4, element_bytes=4, skew=1.0) == balanced * 3 / 4
    assert received_rows(shape, 100) == ROUTER_SKEW * rows


@pytest.mark.parametrize("borrowable, experts, degrees", [(8, 8, [1, 2, 4, 8]), (4, 6, [1, 2]), (6, 60, [1, 2, 3, 6])])
def test_ep_degrees_divide_both_the_borrowed_ranks_and_the_experts(borrowable, experts, degrees):
    assert ep_degrees(borrowable, experts) == degrees
