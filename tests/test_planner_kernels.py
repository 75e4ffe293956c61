"""The time model's parts for GPUs: kernels by shape, pipeline schedules' bubbles, uneven splits, tree latency,
clocks and power limits (docs/planner.md, "Step time")."""

import json
from dataclasses import replace

import pytest

from shardwise.cli import main
from shardwise.config import parse_config
from shardwise.planner import assumptions as A
from shardwise.planner import cluster_preset, predict_step_time, resolve_model
from shardwise.planner.bubbles import bubble_share, busiest_rank, stage_sizes
from shardwise.planner.collectives import collective_time, group_shape
from shardwise.planner.efficiency import block_seconds
from shardwise.planner.hardware import H100_80GB, PlanError
from shardwise.planner.wrapping import numerics
from shardwise.topology import Layout

NODE = cluster_preset("p5.48xlarge")
LLAMA = resolve_model("llama:hidden_size=4096,num_hidden_layers=32,num_key_value_heads=8,intermediate_size=14336")


def _time(config: dict, cluster=NODE, spec=LLAMA, micro_batch=1, seq=4096, checkpointing="none"):
    """One node of 8: the pipeline's stages, the rest replicas."""
    parsed = parse_config(config)
    pp = parsed.pipeline_parallel_degree
    layout = Layout(pp=pp, dp_replicate=cluster.world_size // pp)
    return predict_step_time(spec, parsed, layout, cluster, micro_batch, seq, checkpointing)


def test_bubbles_follow_each_schedule():
    f, b, w = 1.0, 1.0, 1.0
    assert bubble_share("1f1b", 8, 1, f, b, w) == pytest.approx(7 * 3)
    assert bubble_share("interleaved_1f1b", 8, 4, f, b, w) == pytest.approx(7 * 3 / 4)
    assert bubble_share("interleaved_zero_bubble", 8, 2, f, b, w) == pytest.approx(7 * 1 / 2)
    assert bubble_share("zbv_zero_bubble", 8, 2, f, b, w) == 0.0
    assert bubble_share("1f1b", 1, 1, f, b, w) == 0.0


def test_interleaving_shrinks_the_predicted_bubble():
    base = {"bf16": True, "pipeline_parallel_degree": 4, "microbatches": 8}
    plain = _time({**base, "pipeline_schedule": "1f1b"})
    interleaved = _time({**base, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2})
    zero_bubble = _time({**base, "pipeline_schedule": "interleaved_zero_bubble", "virtual_stages": 2})
    assert interleaved.pipeline_bubble == pytest.approx(plain.pipeline_bubble / 2, rel=0.05)
    assert zero_bubble.pipeline_bubble < interleaved.pipeline_bubble
    assert interleaved.pipeline_p2p > plain.pipeline_p2p     # more chunk boundaries to cross


def test_split_points_set_the_busiest_rank():
    assert stage_sizes(LLAMA, 4, parse_config({"pipeline_parallel_degree": 4})) == [8, 8, 8, 8]
    assert stage_sizes(LLAMA, 4, parse_config({"pipeline_parallel_degree": 4,
                                               "pipeline_split_points": [2, 5, 8]})) == [2, 3, 3, 24]
    uneven = parse_config({"pipeline_parallel_degree": 4, "pipeline_split_points": [2, 12, 22]})
    assert busiest_rank(LLAMA, uneven, 4).blocks == 10
    even = _time({"bf16": True, "pipeline_parallel_degree": 4, "microbatches": 8})
    lopsided = _time({"bf16": True, "pipeline_parallel_degree": 4, "microbatches": 8,
                      "pipeline_split_points": [2, 4, 6]})       # 26 blocks on the last stage
    assert lopsided.compute > 3 * even.compute


def test_narrow_tensor_parallel_shards_lose_matmul_efficiency():
    """Per FLOP, a block split 8 ways runs slower than whole: its tiles fill fewer waves of SMs."""
    kinds = numerics(parse_config({"bf16": True}), Layout())
    whole = block_seconds(LLAMA, 4096, 4096, kinds, 1, False, H100_80GB, 989e12)
    split = block_seconds(LLAMA, 512, 4096, kinds, 8, False, H100_80GB, 989e12)
    assert split.matmul_forward * 8 * 8 > whole.matmul_forward


def test_causal_flash_attention_does_half_the_products():
    kinds = numerics(parse_config({"bf16": True}), Layout())
    bert = replace(LLAMA, family="bert")
    causal = block_seconds(LLAMA, 4096, 4096, kinds, 1, False, H100_80GB, 989e12)
    full = block_seconds(bert, 4096, 4096, kinds, 1, False, H100_80GB, 989e12)
    assert full.attention_forward == pytest.approx(2 * causal.attention_forward)


def test_the_triton_flash_kernel_runs_slower_than_flash_attention_2():
    """llm-foundry's `attn_impl: triton`: the same kernel's memory, at FlashAttention-2's rate over the factor its
    paper measured; the matmuls and streaming ops stay."""
    kinds = numerics(parse_config({"bf16": True}), Layout())
    triton = replace(H100_80GB, kernels=replace(H100_80GB.kernels, triton_flash_attention=True))
    flash2 = block_seconds(LLAMA, 4096, 4096, kinds, 1, False, H100_80GB, 989e12)
    older = block_seconds(LLAMA, 4096, 4096, kinds, 1, False, triton, 989e12)
    slowdown = A.TRITON_FLASH_ATTENTION_SLOWDOWN
    assert 1.3 < slowdown < 2.5
    assert older.attention_forward == pytest.approx(slowdown * flash2.attention_forward)
    assert older.attention_backward == pytest.approx(slowdown * flash2.attention_backward)
    assert (older.matmul_forward, older.memory) == (flash2.matmul_forward, flash2.memory)


def test_all_reduce_across_many_nodes_pays_tree_latency():
    cluster = cluster_preset("128xp5.48xlarge")
    shape = group_shape(Layout(dp_replicate=128, dp_shard=8), 8, ("dp_replicate",))
    small = 1e3
    reduce = collective_time("all_reduce", small, shape, cluster)
    gather = collective_time("all_gather", small, shape, cluster)
    assert reduce.inter < 2 * gather.inter / 8       # 2·log2(128) = 14 latencies against 127 of a ring


def test_a_clock_or_a_power_limit_scales_the_peak():
    assert H100_80GB.clocked(clock_mhz=1372.5).sustained_flops("bf16") == pytest.approx(989e12 * 0.75)
    assert H100_80GB.clocked(power_limit_watts=350).clock_fraction == pytest.approx(0.5 ** (1 / 3))
    capped = cluster_preset("p5.48xlarge", power_limit_watts=500)
    assert _time({"bf16": True}, cluster=capped).compute > _time({"bf16": True}).compute
    with pytest.raises(PlanError, match="--peak-tflops"):
        replace(H100_80GB, peak_clock_mhz=None).clocked(clock_mhz=1000)


def test_cli_power_limit_and_clock_lower_the_plan(capsys):
    def best(*extra):
        assert main(["plan", "--model", "gpt2", "--cluster", "p5.48xlarge", "--global-batch", "16", "--json",
                     *extra]) == 0
        return json.loads(capsys.readouterr().out)[0]["tokens_per_s"]
    full = best()
    assert best("--power-limit-w", "400") < full
    assert best("--clock-mhz", "1500") < full
    assert best("--clock-mhz", "1830") == full   # the clock the data sheet's 989 TFLOP/s is computed at


def test_sharding_under_a_pipeline_reduces_once_per_round():
    """torch's PipelineStage defers an FSDP2 stage's gradient sync to the round's end and keeps it gathered after
    backward: ZeRO-2 gathers and reduce-scatters once a round, ZeRO-3 gathers for each warm-up forward and the
    first backward."""
    parsed = parse_config({"bf16": True, "pipeline_parallel_degree": 2, "microbatches": 8, "zero_stage": 2,
                           "sharded_data_parallel_degree": 4})
    layout = Layout(pp=2, dp_shard=4)
    params = LLAMA.stage_parameters(2)

    def moved(config, kind):
        t = predict_step_time(LLAMA, config, layout, NODE, 1, 4096)
        return sum(c.bytes_per_step for c in t.collectives if kind in c.name)

    assert moved(parsed, "reduce-scatter") == pytest.approx(4 * params)          # fp32, once
    assert moved(parsed, "all-gather") == pytest.approx(2 * params)              # bf16, once
    zero3 = parse_config({**parsed.model_dump(exclude_defaults=True), "zero_stage": 3})
    assert moved(zero3, "all-gather") == pytest.approx((2 + 1) * 2 * params)     # two warm-up forwards, one backward


def test_sequence_parallel_stages_send_sequence_shards():
    base = {"bf16": True, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 4, "microbatches": 4}
    layout = Layout(pp=2, tp=4)
    whole, shards = (predict_step_time(LLAMA, parse_config({**base, "sequence_parallel": sp}), layout, NODE, 1, 4096)
                     for sp in (False, True))
    def sent(t):
        return sum(c.bytes_per_step for c in t.collectives if c.name.startswith("activation send"))
    assert sent(shards) == pytest.approx(sent(whole) / 4)
    assert shards.pipeline_p2p < whole.pipeline_p2p
