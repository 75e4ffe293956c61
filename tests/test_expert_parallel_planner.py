"""planner/experts.py: expert memory per rank, all-to-all bytes and the EP degrees possible (pure arithmetic;
test_expert_parallel.py checks the bytes against measured traffic)."""

from dataclasses import replace

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
    from shardwise.planner.experts import step_seconds
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
    # the step pays the all-to-alls, and EP 8 leaves each expert share on one rank: nothing of it gathered or reduced
    all_to_all = step_seconds(spec, split, layout, cluster, 1, 1024, 2)
    assert all_to_all > 0
    split_time = predict_step_time(spec, split, layout, cluster, 1, 1024)
    assert not [c for c in split_time.collectives if c.name.startswith("expert")]
    plain_time = predict_step_time(spec, plain, layout, cluster, 1, 1024)
    assert split_time.data_parallel - all_to_all < plain_time.data_parallel
    # every microbatch exchanges its own tokens, paying each exchange's latency; and each of the 5 exchanges per
    # MoE layer, every microbatch, costs the rank its host time
    four = parse_config({**split.model_dump(exclude_defaults=True), "microbatches": 4})
    assert step_seconds(spec, four, layout, cluster, 1, 1024, 2) == pytest.approx(4 * all_to_all)
    charged = replace(cluster, critical_op_seconds=1e-3)
    charged_time, plain_time = (step_seconds(spec, four, layout, c, 1, 1024, 2) for c in (charged, cluster))
    assert charged_time - plain_time == pytest.approx(5 * 4 * 4 * 1e-3)


# MemTracker against the planner: a tiny Mixtral trained through shardwise's API on 2 gloo ranks, its memory in the
# second AdamW step by category, held to tests/test_planner_measured.py's tolerances (`pytest -s` prints the table
# in docs/expert_parallel.md).
MEASURED_WORLD, MEASURED_ROWS, MEASURED_SEQ = 2, 4, 256
MEASURED = {
    "EP 2 ZeRO-3": {"sharded_data_parallel_degree": 2, "expert_parallel_degree": 2},
    "EP 2 ZeRO-2": {"zero_stage": 2, "sharded_data_parallel_degree": 2, "expert_parallel_degree": 2},
}


def _tiny_mixtral_config():
    import transformers

    return transformers.MixtralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=256, num_local_experts=4,
                                      num_experts_per_tok=2, vocab_size=256, max_position_embeddings=256)


def measure_experts(configs: dict) -> dict:
    """This rank's memory in the second AdamW step of the tiny Mixtral under each config."""
    import torch
    import transformers

    import shardwise as sw
    from shardwise.runtime import state
    from test_planner_measured import measure_distributed_step

    measured = {}
    for name, config in configs.items():
        sw.init(config)
        torch.manual_seed(0)
        ids = torch.randint(1, 256, (MEASURED_ROWS, MEASURED_SEQ), generator=torch.Generator().manual_seed(0))
        measured[name] = measure_distributed_step(transformers.MixtralForCausalLM(_tiny_mixtral_config()),
                                                  {"input_ids": ids, "labels": ids})
        state.set_current(None)  # the next config starts afresh on the same process group
    return measured


@pytest.fixture(scope="module")
def expert_runs() -> dict:
    from shardwise.testing import run_distributed

    from test_planner_measured import most_over_ranks

    return most_over_ranks(run_distributed(measure_experts, MEASURED_WORLD, MEASURED, timeout=300), MEASURED)


@pytest.mark.parametrize("name", list(MEASURED))
def test_expert_parallel_memory_matches_memtracker(name, expert_runs):
    from shardwise.config import parse_config
    from shardwise.config.layout import layout_for
    from shardwise.planner import spec_from_hf
    from shardwise.planner.memory import predict_memory
    from shardwise.topology import Cluster
    from test_planner_measured import CPU, _check

    config = parse_config(MEASURED[name])
    layout = layout_for(config, Cluster(1, MEASURED_WORLD))
    spec = spec_from_hf(_tiny_mixtral_config().to_dict(), "mixtral")
    predicted = predict_memory(spec, config, layout, MEASURED_ROWS, MEASURED_SEQ, device=CPU)
    _check(name, predicted, expert_runs[name])


def test_tensor_parallelism_leaves_the_experts_whole_in_memory():
    """Mixtral's built-in plan splits the attention, embedding and head over tp and keeps every MoE block whole on
    each tensor-parallel rank: the planner divides only the rest by tp, gathered blocks included."""
    from shardwise.config import parse_config
    from shardwise.planner import spec_from_hf
    from shardwise.planner.memory import predict_memory
    from shardwise.topology import Layout

    spec = spec_from_hf({"model_type": "mixtral", "num_hidden_layers": 4}, "mixtral-4-layers")
    config = parse_config({"zero_stage": 3, "sharded_data_parallel_degree": 4, "bf16": True,
                           "tensor_parallel_degree": 2})
    alone = predict_memory(spec, config, Layout(dp_shard=4), 1, 1024)
    split = predict_memory(spec, config, Layout(dp_shard=4, tp=2), 1, 1024)
    experts = spec.experts.parameters
    rest = spec.parameters - experts
    assert split.parameters / alone.parameters == pytest.approx((rest / 2 + experts) / spec.parameters)
    # ZeRO-3's two gathered blocks (bf16): their experts whole, the rest halved; what no block holds halved too
    per_layer, layer_experts = spec.layer_parameters, experts / spec.layers
    outside = spec.parameters - spec.layers * per_layer
    assert split.gathered_params == pytest.approx(2 * (outside / 2 + 2 * (per_layer - layer_experts) / 2
                                                       + 2 * layer_experts))
    assert alone.gathered_params == pytest.approx(2 * (outside + 2 * per_layer))


def test_zero3_gathers_and_reduces_each_expert_share_over_its_copies_only():
    """With EP each expert share is an FSDP2 unit of its own over `expert_shard` (every ep-th rank of the sharding
    group): its all-gathers move 1/ep of the experts on that group, the rest of the model's the sharding group."""
    from shardwise.config import parse_config
    from shardwise.planner import cluster_preset, spec_from_hf
    from shardwise.planner.collectives import GroupShape
    from shardwise.planner.experts import expert_shard_shape
    from shardwise.planner.timing import predict_step_time
    from shardwise.topology import Layout

    assert expert_shard_shape(Layout(dp_shard=8), 8, 4) == GroupShape(2, 2, 1)
    assert expert_shard_shape(Layout(dp_shard=16), 8, 2) == GroupShape(8, 4, 2)  # ranks 0, 2, ..., 14
    assert expert_shard_shape(Layout(dp_shard=2, cp=4), 4, 4) == GroupShape(2, 1, 2)  # ep takes the cp ranks first

    spec = spec_from_hf({"model_type": "mixtral", "num_hidden_layers": 4}, "mixtral-4-layers")
    cluster, layout = cluster_preset("p4d.24xlarge"), Layout(dp_shard=8)
    collectives = {}
    for ep in (1, 4):
        config = parse_config({"sharded_data_parallel_degree": 8, "bf16": True, "expert_parallel_degree": ep})
        collectives[ep] = {c.name: c for c in predict_step_time(spec, config, layout, cluster, 1, 1024).collectives}
    experts = spec.experts.parameters
    share = collectives[4]["expert parameter all-gather (overlaps forward)"]
    assert share.axis == "expert_shard" and share.bytes_per_step == pytest.approx(2 * experts / 4)
    rest = collectives[4]["parameter all-gather (overlaps forward)"]
    assert rest.axis == "dp_shard" and rest.bytes_per_step == pytest.approx(2 * (spec.parameters - experts))
    assert collectives[1]["parameter all-gather (overlaps forward)"].bytes_per_step == pytest.approx(
        2 * spec.parameters)
    assert "expert gradient reduce-scatter (overlaps backward)" in collectives[4]
