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


def test_a_mixtral_config_counts_every_expert_in_memory_and_the_top_k_in_flops():
    from shardwise.planner import spec_from_hf

    spec = spec_from_hf({"model_type": "mixtral"}, "mixtral-8x7b")
    assert round(spec.parameters / 1e9, 1) == 46.7  # Mixtral 8x7B's published 46.7 B
    active = spec.active_layer_parameters * spec.layers + spec.embedding_parameters + spec.head_parameters
    assert round(active / 1e9, 1) == 12.9  # and its 12.9 B active per token
    assert spec.experts == MIXTRAL_8X7B


def test_the_plan_tries_expert_parallelism_and_shows_it():
    from shardwise.planner import cluster_preset, spec_from_hf
    from shardwise.planner.report import _sharding
    from shardwise.planner.search import plan

    spec = spec_from_hf({"model_type": "mixtral", "num_hidden_layers": 4}, "mixtral-4-layers")
    result = plan(spec, cluster_preset("p4d.24xlarge"), global_batch=16, seq=1024, precision="bf16")
    chosen = [e for e in result.considered if e.config.get("expert_parallel_degree", 1) > 1]
    assert chosen and all(e.config["expert_parallel_degree"] in (2, 4, 8) for e in chosen)
    assert all(e.zero_stage >= 2 for e in chosen)
    assert any(f"EP {e.config['expert_parallel_degree']}" in _sharding(e) for e in chosen)


def test_expert_parallelism_spares_gathered_experts_and_costs_all_to_all_time():
    from shardwise.config import parse_config
    from shardwise.planner import cluster_preset, spec_from_hf
    from shardwise.planner.memory import predict_memory
    from shardwise.planner.timing import predict_step_time
    from shardwise.topology import Layout

    spec = spec_from_hf({"model_type": "mixtral", "num_hidden_layers": 4}, "mixtral-4-layers")
    cluster, layout = cluster_preset("p4d.24xlarge"), Layout(dp_shard=8)
    plain = parse_config({"zero_stage": 2, "sharded_data_parallel_degree": 8, "bf16": True})
    split = parse_config({"zero_stage": 2, "sharded_data_parallel_degree": 8, "bf16": True,
                          "expert_parallel_degree": 8})
    experts = MIXTRAL_8X7B.per_expert * 8 * 4  # ZeRO-2 gathers every layer: 7/8 of them stay on other ranks
    saved = (predict_memory(spec, plain, layout, 1, 1024).gathered_params
             - predict_memory(spec, split, layout, 1, 1024).gathered_params)
    assert saved == pytest.approx(2 * experts * 7 / 8)
    slower = (predict_step_time(spec, split, layout, cluster, 1, 1024).data_parallel
              - predict_step_time(spec, plain, layout, cluster, 1, 1024).data_parallel)
    assert slower > 0
