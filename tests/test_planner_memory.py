"""The memory model: seed 003's per-parameter formulas, seed 002's 100B arithmetic, activation counts."""

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise.config import parse_config
from shardwise.planner import (Kernels, block_activations, cluster_preset, model_state_bytes, predict_memory,
                               rank_activations, resolve_model)
from shardwise.planner.activations import edge_activations
from shardwise.planner.memory import in_flight_microbatches
from shardwise.topology import Cluster, Layout, layout_for

A = 1_000_000_000  # parameters on a rank


def _states(config: dict, dp: int) -> dict:
    parsed = parse_config(config)
    return model_state_bytes(A, parsed, layout_for(parsed, Cluster(1, dp)))


def _sum(states: dict) -> float:
    return sum(states.values())


def test_ddp_fp32_is_20a_and_mixed_precision_is_18a():
    spec = replace(resolve_model("gpt2"), parameters=A)   # one stage holds every parameter
    for config, per_param in (({}, 20), ({"fp16": True}, 18), ({"bf16": True}, 18)):
        parsed = parse_config(config)
        memory = predict_memory(spec, parsed, layout_for(parsed, Cluster(1, 8)), 1, 8)
        assert memory.model_states + memory.comm_buffers == per_param * A
    mixed = _states({"fp16": True}, 8)
    assert mixed == {"parameters": 2 * A, "gradients": 2 * A, "optimizer": 8 * A, "master_params": 4 * A}


@given(n=st.integers(2, 64))
def test_zero_stages_follow_seed_003(n):
    assert _sum(_states({"shard_optimizer_state": True}, n)) == pytest.approx(4 * A + 4 * A + 8 * A / n)
    assert _sum(_states({"zero_stage": 2, "sharded_data_parallel_degree": n}, n)) == pytest.approx(4 * A + 12 * A / n)
    assert _sum(_states({"sharded_data_parallel_degree": n}, n)) == pytest.approx(16 * A / n)


def test_mics_shards_over_the_partition_group_only():
    # 32 ranks in groups of 4 (seed 000): each rank holds 1/4 of the model states, not 1/32.
    assert _sum(_states({"sharded_data_parallel_degree": 4}, 32)) == pytest.approx(16 * A / 4)


def test_100b_parameters_need_2tb_and_50_devices_of_40gb():
    """Seed 002: ~200 GB for 10B, ~2 TB for 100B, so one copy spans 50 × 40 GB devices."""
    spec = replace(resolve_model("gpt2"), parameters=100 * A)
    parsed = parse_config({})
    memory = predict_memory(spec, parsed, layout_for(parsed, Cluster(1, 2)), 1, 8)
    assert memory.model_states + memory.comm_buffers == 2e12
    assert (memory.model_states + memory.comm_buffers) / 40e9 == 50


GPU_MATH_ATTENTION = Kernels(dropout_mask_bytes=1, flash_attention=False)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_block_activations_reproduce_korthikanti(tp):
    """fp16, dropout, GELU: sbh(10 + 24/t + 5as/(ht)) per layer, plus LayerNorm statistics (16 bytes)."""
    spec = resolve_model("gpt2:activation_function=gelu")
    h, a, s = spec.hidden, spec.heads, 1024
    per_token = block_activations(spec, s, 2, GPU_MATH_ATTENTION).per_rank(tp)
    assert per_token == pytest.approx(10 * h + 24 * h / tp + 5 * a * s / tp + 16)


def test_flash_attention_keeps_no_probabilities():
    spec = resolve_model("gpt2:activation_function=gelu")
    h, a = spec.hidden, spec.heads
    assert block_activations(spec, 1024, 2, Kernels()).per_rank(1) == 34 * h + 4 * a + 16


def _acts(spec, **kw):
    base = dict(seq=512, micro_batch=2, dtype_bytes=2, tp=1, pp=1, in_flight=1, checkpointing="none")
    return rank_activations(spec, **{**base, **kw})


def test_checkpointing_keeps_block_inputs_and_recomputes_one_group():
    spec = resolve_model("gpt2-10b")
    tokens, h, layers = 2 * 512, spec.hidden, spec.layers
    block = block_activations(spec, 512, 2).per_rank(1) * tokens
    edges = _acts(spec).device - layers * block
    assert _acts(spec, checkpointing="per_layer").device == pytest.approx(layers * h * 2 * tokens + block + edges)
    assert _acts(spec, checkpointing="group_2").device == pytest.approx(layers / 2 * h * 2 * tokens + 2 * block + edges)


def test_pipeline_stage_zero_holds_the_in_flight_microbatches():
    layout = Layout(pp=4, tp=1)
    assert in_flight_microbatches(parse_config({"pipeline_parallel_degree": 4, "microbatches": 8}), layout) == 4
    assert in_flight_microbatches(parse_config({"pipeline_parallel_degree": 4, "microbatches": 8,
                                                "active_microbatches": 2}), layout) == 2
    spec = resolve_model("gpt2-10b")
    two, three, four = (_acts(spec, pp=4, in_flight=k).device for k in (2, 3, 4))
    tokens = 2 * 512
    one_microbatch = (spec.stage_layers(4) * block_activations(spec, 512, 2).per_rank(1)
                      + edge_activations(spec, 2)[0]) * tokens
    assert four - three == pytest.approx(one_microbatch) and three - two == pytest.approx(one_microbatch)


def test_offload_moves_kept_inputs_to_the_host():
    spec = resolve_model("gpt2-10b")
    kept = _acts(spec, pp=2, in_flight=2, checkpointing="per_layer")
    offloaded = _acts(spec, pp=2, in_flight=2, checkpointing="per_layer", offload=True, loading_horizon=4)
    stage_inputs = spec.stage_layers(2) * spec.hidden * 2 * 2 * 512
    assert offloaded.host == 2 * stage_inputs
    assert offloaded.device < kept.device


def test_other_is_buffers_runtime_and_fragmentation():
    spec = resolve_model("gpt2-10b")
    config = parse_config({"tensor_parallel_degree": 4, "shard_optimizer_state": True, "bf16": True})
    device = cluster_preset("p4d.24xlarge").device
    memory = predict_memory(spec, config, layout_for(config, Cluster(16, 8)), 40, 512, "per_layer", device)
    summary = memory.summary()
    assert summary["other"] == memory.comm_buffers + device.runtime_reserve_bytes + memory.fragmentation
    accounted = memory.model_states + memory.activations + memory.comm_buffers
    assert memory.fragmentation == pytest.approx(0.10 * accounted)
    assert summary["total"] == pytest.approx(sum(v for k, v in summary.items() if k != "total"))
