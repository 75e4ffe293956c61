"""The planner under context parallelism: memory and time follow the layout's cp axis, the search proposes CP
where sequences are long and only configs validation accepts, and MemTracker agrees per category.

Pure cases predict on paper; the measured cases train tiny Hugging Face models under CP 2 on 2 gloo ranks through
shardwise's API (Llama: ring under DDP over the cp ranks, all-to-all under ZeRO-1 in bf16 dealing over them;
GPT-2: ring under ZeRO-3 sharded over them) and hold MemTracker's per-category memory of the second step to the
tolerances of tests/test_planner_measured.py (`pytest -s` prints the table in docs/context_parallel.md).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from shardwise.config import parse_config
from shardwise.config.layout import layout_for, validate
from shardwise.planner import cluster_preset, plan, predict_memory, predict_step_time, resolve_model, spec_from_hf
from shardwise.planner.context import LONG_SEQUENCE, layer_shape, wire_bytes
from shardwise.planner.hardware import GiB, custom_cluster
from shardwise.testing import run_distributed
from shardwise.topology import Cluster
from test_planner_measured import CPU, _check, measure_distributed_step, most_over_ranks

SMALL_LLAMA = resolve_model("llama:hidden_size=1024,num_hidden_layers=4,num_attention_heads=8,num_key_value_heads=4,"
                            "intermediate_size=2816,vocab_size=32000")
A100S = cluster_preset("p4d.24xlarge")


def _layout(config: dict, cluster=A100S):
    return validate(config, cluster.topology)


def test_activations_divide_by_the_degree_and_states_shard_over_it():
    """At the same rows per replica each rank keeps 1/cp of the activations; ZeRO-3 shards over dp_shard × cp."""
    memory = {cp: predict_memory(SMALL_LLAMA, *_layout({"context_parallel_degree": cp, "zero_stage": 3}), 2, 8192)
              for cp in (1, 2, 4)}
    for cp in (2, 4):
        assert memory[cp].activations == pytest.approx(memory[1].activations / cp, rel=1e-9)
        assert memory[cp].parameters == pytest.approx(memory[1].parameters)  # dp_shard × cp is 8 ranks either way
        assert memory[cp].total < memory[1].total
    alone = predict_memory(SMALL_LLAMA, *_layout({"context_parallel_degree": 8, "zero_stage": 3}), 2, 8192)
    assert alone.parameters == pytest.approx(4 * SMALL_LLAMA.parameters / 8)  # fp32 shards over the 8 cp ranks
    ddp = predict_memory(SMALL_LLAMA, *_layout({"context_parallel_degree": 8}), 2, 8192)
    assert ddp.comm_buffers >= 4 * SMALL_LLAMA.parameters  # DDP's buckets: gradients are reduced over the cp ranks


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_the_step_sends_what_planner_context_counts(mode):
    """Every layer's exchange, forward and backward, every microbatch: bytes as `wire_bytes` gives them; a
    recomputed block's forward sends its share again."""
    config, layout = _layout({"context_parallel_degree": 4, "context_parallel_mode": mode, "bf16": True,
                              "microbatches": 2})
    shape = layer_shape(SMALL_LLAMA.heads, SMALL_LLAMA.kv_heads, SMALL_LLAMA.hidden // SMALL_LLAMA.heads, 1, 1, 8192, 2)
    sent = wire_bytes(mode, 4, shape)
    per_step = {}
    for checkpointing in ("none", "each"):
        time = predict_step_time(SMALL_LLAMA, config, layout, A100S, 1, 8192, checkpointing)
        (record,) = [c for c in time.collectives if c.axis == "cp"]
        per_step[checkpointing] = record.bytes_per_step
        assert time.context_parallel > 0
    layers = SMALL_LLAMA.layers * config.microbatches
    assert per_step["none"] == (sent["forward"] + sent["backward"]) * layers
    assert per_step["each"] == (2 * sent["forward"] + sent["backward"]) * layers


def test_the_ring_hides_what_attention_outlasts_and_all_to_all_hides_nothing():
    times = {}
    for mode in ("ring", "all_to_all"):
        config, layout = _layout({"context_parallel_degree": 2, "context_parallel_mode": mode, "bf16": True},
                                 CPU_CLUSTER)
        times[mode] = predict_step_time(SMALL_LLAMA, config, layout, CPU_CLUSTER, 1, 8192)
    shape = layer_shape(SMALL_LLAMA.heads, SMALL_LLAMA.kv_heads, SMALL_LLAMA.hidden // SMALL_LLAMA.heads, 1, 1, 8192, 2)
    link = CPU_CLUSTER.intra_node_bandwidth * CPU_CLUSTER.link_efficiency
    sent = wire_bytes("all_to_all", 2, shape)
    latency = 8 * CPU_CLUSTER.intra_node_latency
    assert times["all_to_all"].context_parallel == pytest.approx(
        SMALL_LLAMA.layers * ((sent["forward"] + sent["backward"]) / link + latency))
    ring = wire_bytes("ring", 2, shape)
    assert times["ring"].context_parallel < SMALL_LLAMA.layers * (ring["forward"] + ring["backward"]) / link


def _cp_layouts(result) -> list:
    return [e for e in result.fitting if e.layout.cp > 1]


def test_the_search_proposes_cp_where_nothing_else_fits_and_only_what_validation_accepts():
    tight = custom_cluster(nodes=4, devices_per_node=1, device_memory_bytes=1.5 * GiB, peak_flops=100e12,
                           intra_node_bandwidth=100e9, inter_node_bandwidth=10e9)
    result = plan(SMALL_LLAMA, tight, global_batch=1, seq=4096, precision="fp32")
    assert 4096 < LONG_SEQUENCE and result.fitting and result.fitting == _cp_layouts(result)
    long = plan(SMALL_LLAMA, A100S, global_batch=8, seq=LONG_SEQUENCE * 2)
    assert _cp_layouts(long)  # a long sequence: searched beside the layouts without CP
    for cluster, proposed in ((tight, _cp_layouts(result)), (A100S, _cp_layouts(long))):
        for e in proposed:
            config, layout = validate(e.config, cluster.topology)
            assert layout == e.layout and config.context_parallel_degree == e.layout.cp


def test_short_sequences_that_fit_get_no_cp():
    result = plan(SMALL_LLAMA, A100S, global_batch=8, seq=2048)
    assert result.fitting and not [e for e in result.considered if e.layout.cp > 1]


def test_a_model_cp_cannot_split_gets_one_reason_instead():
    gpt2 = resolve_model("gpt2:n_layer=4,n_embd=1024,n_head=8,vocab_size=32000")  # attention dropout 0.1
    tight = custom_cluster(nodes=4, devices_per_node=1, device_memory_bytes=0.5 * GiB, peak_flops=100e12,
                           intra_node_bandwidth=100e9, inter_node_bandwidth=10e9)
    result = plan(gpt2, tight, global_batch=1, seq=1024, precision="fp32")
    (refused,) = [e for e in result.considered if e.layout.cp > 1]
    assert not result.fitting and "attention dropout 0.1 does not run under context parallelism" in refused.reason

LLAMA = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=160, vocab_size=256, max_position_embeddings=256)
GPT2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=256, attn_pdrop=0.0)
CPU_CLUSTER = cluster_preset("local", devices_per_node=2)
MODELS = {"llama": (transformers.LlamaForCausalLM, LLAMA), "gpt2": (transformers.GPT2LMHeadModel, GPT2)}
ROWS, SEQ, WORLD = 4, 256, 2
MEASURED = {
    "llama CP 2 ring": {"context_parallel_degree": 2},
    "llama CP 2 all-to-all ZeRO-1 bf16": {"context_parallel_degree": 2, "context_parallel_mode": "all_to_all",
                                          "shard_optimizer_state": True, "bf16": True},
    "gpt2 CP 2 ring ZeRO-3": {"context_parallel_degree": 2, "zero_stage": 3},
}


def measure_cp(configs: dict) -> dict:
    """This rank's memory in the second AdamW step of the tiny Llama under each config (whole rows in, the loss
    over the cp group's sequence)."""
    import shardwise as sw
    from shardwise.runtime import state

    measured = {}
    for name, config in configs.items():
        sw.init(config)
        torch.manual_seed(0)
        model_class, hf_config = MODELS[name.split()[0]]
        ids = torch.randint(1, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
        measured[name] = measure_distributed_step(model_class(hf_config), {"input_ids": ids, "labels": ids})
        state.set_current(None)  # the next config starts afresh on the same process group
    return measured


@pytest.fixture(scope="module")
def cp_runs() -> dict:
    return most_over_ranks(run_distributed(measure_cp, WORLD, MEASURED, timeout=300), MEASURED)


@pytest.mark.parametrize("name", list(MEASURED))
def test_cp_memory_matches_memtracker(name, cp_runs):
    config = parse_config(MEASURED[name])
    family = name.split()[0]
    layout = layout_for(config, Cluster(1, WORLD))
    predicted = predict_memory(spec_from_hf(MODELS[family][1].to_dict(), family), config, layout, ROWS, SEQ, device=CPU)
    _check(name, predicted, cp_runs[name])


def test_sharding_traffic_spans_the_cp_ranks_and_hpz_stays_inside_a_node():
    two_nodes = cluster_preset("2xp4d.24xlarge")
    config, layout = _layout({"context_parallel_degree": 2, "zero_stage": 3, "zero_hpz_partition_size": 8,
                              "bf16": True}, two_nodes)
    time = predict_step_time(SMALL_LLAMA, config, layout, two_nodes, 1, 16384)
    axes = {c.name: (c.axis, c.link) for c in time.collectives}
    assert axes["gradient reduce-scatter (overlaps backward)"] == ("dp_shard×cp", "intra+inter")
    assert axes["parameter all-gather (overlaps backward)"] == ("hpz", "intra")  # a node's 8 of the 16
    config, layout = _layout({"context_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2,
                              "shard_optimizer_state": True}, two_nodes)
    pipelined = predict_step_time(SMALL_LLAMA, config, layout, two_nodes, 1, 16384)
    assert {c.axis for c in pipelined.collectives} >= {"cp", "pp", "dp_replicate×cp"}
