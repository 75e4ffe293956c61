"""The memory model: seed 003's per-parameter formulas, seed 002's 100B arithmetic, activation counts.

Where shardwise's runtime keeps more than seed 003's textbook accounting (mixed-precision
DDP, FSDP2's ZeRO-2), the tests state shardwise's numbers and the difference; docs/planner.md
explains both.
"""

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise.config import parse_config
from shardwise.planner import (Kernels, PlanError, block_activations, cluster_preset, model_state_bytes, plan, predict_memory,
                               rank_activations, resolve_model)
from shardwise.planner.activations import Numerics, distinct_strategies, edge_activations, logits_bytes
from shardwise.planner import memory
from shardwise.planner.memory import in_flight_microbatches, pipeline_stages, regathered_bytes
from shardwise.planner.wrapping import (comm_buffer_bytes, gathered_bytes, optimizer_share, reduce_buckets,
                                        root_unit_parameters)
from shardwise.config.layout import layout_for
from shardwise.topology import Cluster, Layout

A = 1_000_000_000  # parameters on a rank
SPEC = replace(resolve_model("gpt2"), parameters=A)   # one stage holds every parameter


def _states(config: dict, dp: int) -> dict:
    parsed = parse_config(config)
    return model_state_bytes(A, parsed, layout_for(parsed, Cluster(1, dp)))


def _at_peak(config: dict, dp: int) -> float:
    """Model states plus the parameter copies FSDP2 gathers for compute."""
    parsed = parse_config(config)
    return sum(_states(config, dp).values()) + gathered_bytes(SPEC, parsed, layout_for(parsed, Cluster(1, dp)))


def test_ddp_is_20a_in_fp32_and_in_mixed_precision():
    """Seed 003: fp32 DDP 4a + 4a + 8a + 4a buckets = 20a. Its half-precision 18a keeps fp16 parameters
    and gradients beside an fp32 master copy; shardwise's DDP autocasts fp32 parameters instead, so
    its states and buckets stay 20a, and autocast keeps a 2a low-precision copy of the weights for backward."""
    for config in ({}, {"fp16": True}, {"bf16": True}):
        parsed = parse_config(config)
        memory = predict_memory(SPEC, parsed, layout_for(parsed, Cluster(1, 8)), 1, 8)
        assert memory.model_states + memory.comm_buffers == 20 * A
    assert _states({"fp16": True}, 8) == {"parameters": 4 * A, "gradients": 4 * A, "optimizer": 8 * A}
    autocast = dict(seq=8, micro_batch=1, tp=1, pp=1, in_flight=1, checkpointing="none")
    copies = (rank_activations(SPEC, numerics=Numerics(2, residual=4, weight_copies=2), **autocast).device
              - rank_activations(SPEC, numerics=Numerics(2, residual=4), **autocast).device)
    assert copies == pytest.approx(2 * A)


@given(n=st.integers(2, 64))
def test_zero_stages_follow_seed_003(n):
    """ZeRO-1 4a + 4a + 8a/n and ZeRO-3 16a/n as in seed 003. Seed 003's ZeRO-2 (4a + 12a/n) keeps
    parameters replicated; FSDP2's keeps them sharded and gathers every block from its forward to its
    backward, so at the peak it holds 4a/n more."""
    assert sum(_states({"shard_optimizer_state": True}, n).values()) == pytest.approx(4 * A + 4 * A + 8 * A / n)
    assert _at_peak({"zero_stage": 2, "sharded_data_parallel_degree": n}, n) == pytest.approx(4 * A + 16 * A / n)
    assert sum(_states({"sharded_data_parallel_degree": n}, n).values()) == pytest.approx(16 * A / n)


def test_mics_shards_over_the_partition_group_only():
    # 32 ranks in groups of 4 (seed 000): each rank holds 1/4 of the model states, not 1/32.
    assert sum(_states({"sharded_data_parallel_degree": 4}, 32).values()) == pytest.approx(16 * A / 4)


def test_zero1_busiest_rank_holds_its_largest_tensors():
    """ZeRO-1 deals whole tensors, largest first, to the least-loaded rank (parallel/zero1/optimizer_state.py)."""
    spec = resolve_model("gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=256,n_positions=64")
    config = parse_config({"shard_optimizer_state": True})
    share = optimizer_share(spec, config, layout_for(config, Cluster(1, 4)))
    # Largest first: 16,640 (c_fc) twice, 16,448 twice, then the 16,384 embedding ... (see the spec).
    assert share * spec.parameters == 32_768 and share > 1 / 4
    assert optimizer_share(resolve_model("gpt2-10b"), config, layout_for(config, Cluster(1, 4))) == pytest.approx(
        1 / 4, rel=0.01)


def _zero1_half(spec, tp: int, nodes: int, pp: int = 1, microbatches: int = 1, local: bool = False):
    config = parse_config({"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "microbatches": microbatches,
                           "shard_optimizer_state": True, "bf16": True, "accumulate_gradients_locally": local})
    layout = layout_for(config, Cluster(nodes, 8))
    return predict_memory(spec, config, layout, 1, 512), layout


def test_zero1_half_precision_gradients_go_with_their_buckets():
    """ZeRO-1 in bf16 sends each bucket's gradients to its owner as soon as they are complete and frees them:
    for gpt2-10b under SMP's layout (tp 4 × 32 replicas) only the gradients waiting for their bucket are alive,
    a few hundredths of the 2a a replica would keep; beside the owner's fp32 master gradients at most two
    buckets are in flight. A pipeline accumulates its microbatches in the gradients first: 2a."""
    spec = resolve_model("gpt2-10b")
    memory, layout = _zero1_half(spec, tp=4, nodes=16)
    a = spec.parameters / 4
    buckets = reduce_buckets(spec, layout)
    assert memory.gradients == 2 * buckets.waiting and memory.gradients < 0.05 * 2 * a
    assert buckets.count > layout.dp and 25 * 2 ** 20 <= 4 * buckets.largest == 4 * spec.vocab * spec.hidden / 4
    share = optimizer_share(spec, parse_config({"shard_optimizer_state": True, "bf16": True}), layout)
    assert memory.comm_buffers == pytest.approx(4 * a * share + 2 * 4 * buckets.largest)
    piped, layout = _zero1_half(spec, tp=4, nodes=16, pp=2, microbatches=4)
    assert piped.gradients == 2 * spec.stage_parameters(2) / 4


def test_zero1_gradients_accumulated_locally_hold_fp32_sums_of_the_whole_stage():
    """With accumulate_gradients_locally each rank keeps fp32 sums of its whole stage (4a, the owner's master
    gradients and the buckets in flight among them: the runtime's sums hold exactly a elements and a flag a tensor,
    tests/test_zero1_precision.py); its bf16 gradients are freed as they are added, as when they travel, so only
    those waiting for their bucket are alive, under a pipeline too (which otherwise accumulates them: 2a). With one
    microbatch nothing accumulates and it is the default layout."""
    spec = resolve_model("gpt2-10b")
    reduced, _ = _zero1_half(spec, tp=4, nodes=16, microbatches=4)
    local, layout = _zero1_half(spec, tp=4, nodes=16, microbatches=4, local=True)
    a = spec.parameters / 4
    assert local.comm_buffers == pytest.approx(4 * a) and local.comm_buffers > reduced.comm_buffers
    assert local.gradients == reduced.gradients == 2 * reduce_buckets(spec, layout).waiting
    piped, layout = _zero1_half(spec, tp=4, nodes=16, pp=2, microbatches=4, local=True)
    assert piped.gradients < 0.05 * 2 * spec.stage_parameters(2) / 4
    assert _zero1_half(spec, tp=4, nodes=16, local=True)[0] == _zero1_half(spec, tp=4, nodes=16)[0]


def test_zero1_of_one_replica_saves_nothing():
    """Why the search tries ZeRO-1 only with several replicas: one replica in bf16 keeps fp32 masters and master
    gradients of the whole model beside its bf16 parameters (18a with Adam's moments), more than DDP's fp32
    parameters and gradients (16a) with autocast's weight copies."""
    spec, config, one = resolve_model("gpt2"), {"bf16": True}, Cluster(1, 1)
    ddp, zero1 = (predict_memory(spec, parse_config(c), layout_for(parse_config(c), one), 1, 512)
                  for c in (config, {**config, "shard_optimizer_state": True}))
    assert zero1.model_states + zero1.comm_buffers > ddp.model_states + ddp.comm_buffers and zero1.total > ddp.total
    spec, cluster = resolve_model("gpt2:n_layer=4,n_embd=256,n_head=4"), cluster_preset("local", devices_per_node=2)
    considered = plan(spec, cluster, global_batch=2, precision="bf16").considered
    assert {e.zero_stage for e in considered if e.layout.dp == 1 and e.memory} == {0}
    assert {e.zero_stage for e in considered if e.layout.dp == 2} == {0, 1, 2, 3}


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
    per_token = block_activations(spec, s, Numerics(2), GPU_MATH_ATTENTION).per_rank(tp)
    assert per_token == pytest.approx(10 * h + 24 * h / tp + 5 * a * s / tp + 16)


def test_flash_attention_keeps_no_probabilities():
    spec = resolve_model("gpt2:activation_function=gelu")
    h, a = spec.hidden, spec.heads
    assert block_activations(spec, 1024, Numerics(2), Kernels()).per_rank(1) == 34 * h + 4 * a + 16


def test_a_fused_rmsnorm_keeps_no_normalised_product():
    """torchtitan's fused_rmsnorm keeps each norm's input (in bf16) and rstd; Hugging Face's eager RMSNorm keeps its
    input upcast to fp32 and its normalised product (test_planner_kept_bytes.py measures it)."""
    spec = resolve_model("llama:hidden_size=512,intermediate_size=1376,num_attention_heads=8")
    hf = block_activations(spec, 1024, Numerics(2), Kernels()).per_rank(1)
    fused = block_activations(spec, 1024, Numerics(2), Kernels(fused_rmsnorm=True)).per_rank(1)
    assert hf - fused == 2 * spec.hidden * (2 + 4 - 2)    # two norms a block: bf16 products, fp32 inputs
    layernorm = resolve_model("gpt2")
    assert block_activations(layernorm, 1024, Numerics(2), Kernels(fused_rmsnorm=True)).per_rank(1) == \
        block_activations(layernorm, 1024, Numerics(2), Kernels()).per_rank(1)


def test_a_fused_cross_entropy_keeps_the_heads_logits_and_a_log_sum_exp():
    """flash-attn's cross-entropy (llm-foundry's default loss) keeps the bf16 logits and one fp32 log-sum-exp per
    token, where an unfused loss reads the logits in fp32 and keeps an fp32 log-softmax."""
    spec = resolve_model("gpt2")
    fsdp_bf16 = Numerics(2, logits=4)
    assert logits_bytes(spec, fsdp_bf16) == spec.head_outputs * (4 + 4)
    assert logits_bytes(spec, fsdp_bf16, Kernels(fused_cross_entropy=True)) == spec.head_outputs * 2 + 4


def test_cpu_math_attention_keeps_fp32_and_autocast_keeps_an_fp32_residual():
    spec = resolve_model("gpt2:activation_function=gelu")
    h, a, s = spec.hidden, spec.heads, 1024
    cpu = Kernels(dropout_mask_bytes=None, flash_attention_dropout=False, math_attention_bytes=4)
    bf16 = block_activations(spec, s, Numerics(2), cpu).per_rank(1)
    # Q, K, V and the three s × s tensors (probabilities, dropout mask, dropped) stay fp32 in bf16.
    assert bf16 - block_activations(spec, s, Numerics(2), replace(cpu, math_attention_bytes=0)).per_rank(1) == (
        2 * (3 * h + 3 * a * s))
    autocast = block_activations(spec, s, Numerics(2, residual=4), cpu).per_rank(1)
    assert autocast - bf16 == 2 * 2 * h                   # each norm's input in fp32


def _acts(spec, **kw):
    base = dict(seq=512, micro_batch=2, numerics=Numerics(2), tp=1, pp=1, in_flight=1, checkpointing="none")
    return rank_activations(spec, **{**base, **kw})


@pytest.mark.parametrize("strategy, blocks", [("each", 1), ("group_2", 2), ("group_4", 4), ("contiguous", None)])
def test_checkpointing_keeps_region_inputs_and_recomputes_one_region_after_the_head(strategy, blocks):
    """SMP's strategies: L/k kept inputs, and k blocks recomputed once backward has freed the logits."""
    spec = resolve_model("gpt2-10b")
    tokens, h, layers = 2 * 512, spec.hidden, spec.layers
    blocks = blocks or layers
    block = block_activations(spec, 512, Numerics(2)).per_rank(1) * tokens
    first, last = edge_activations(spec, Numerics(2))
    first, last = first * tokens, (last + logits_bytes(spec, Numerics(2))) * tokens
    assert _acts(spec).device == pytest.approx(layers * block + first + last)
    kept = math.ceil(layers / blocks) * h * 2 * tokens
    assert _acts(spec, checkpointing=strategy).device == pytest.approx(kept + first + max(last, blocks * block))


def test_strategies_are_smps_names():
    with pytest.raises(PlanError, match=r"activation checkpointing 'per_layer': use 'none' or one of SMP's"):
        _acts(resolve_model("gpt2-10b"), checkpointing="per_layer")
    assert distinct_strategies(24) == ["none", "each", "each:matmul", "contiguous", "group_2", "group_4"]
    assert distinct_strategies(2) == ["none", "each", "each:matmul", "contiguous"]  # groups of 2, 4: the whole run
    assert distinct_strategies(24, groups=False) == ["none", "each", "each:matmul"]  # a ModuleList's blocks
    assert distinct_strategies(24, groups=False, policies=False) == ["none", "each"]  # a module-graph cut's stages
    with pytest.raises(PlanError, match=r"activation checkpointing 'each:all': .* optionally with an op-selective"):
        _acts(resolve_model("gpt2-10b"), checkpointing="each:all")


@pytest.mark.parametrize("settings, in_flight", [
    ({"microbatches": 8}, 4),                                   # 1F1B: pp in flight
    ({"microbatches": 8, "active_microbatches": 8}, 4),         # a round of all of them: still pp
    ({"microbatches": 8, "active_microbatches": 2}, 2),         # rounds below pp run as GPipe
    ({"microbatches": 2}, 2),                                   # fewer microbatches than stages
    ({"microbatches": 8, "pipeline_schedule": "gpipe"}, 4),     # GPipe: a round of SMP's default pp + 2 = 6,
                                                                # as the largest divisor of 8 within it
    ({"microbatches": 8, "active_microbatches": 8, "pipeline_schedule": "gpipe"}, 8),  # the whole batch
    ({"microbatches": 8, "active_microbatches": 4, "pipeline_schedule": "gpipe"}, 4),
])
def test_in_flight_microbatches_follow_the_runtimes_rounds(settings, in_flight):
    """As parallel/pipeline/schedule.py runs rounds of `pipeline_round`."""
    config = parse_config({"pipeline_parallel_degree": 4, **settings})
    assert in_flight_microbatches(config, Layout(pp=4, tp=1)) == in_flight


def test_a_middle_stage_the_cut_fills_holds_its_blocks_in_flight():
    """GPT-2 small on 4 stages: its embedding and tied head leave the end stages one block each and the middle
    ones five (the runtime's cut). Under 1F1B rank 1 holds 3 microbatches of 5 blocks, more than rank 0's 4 of
    1 with the embedding: the peak is rank 1's, as the cut and schedule leave it."""
    spec = resolve_model("gpt2")
    config = parse_config({"pipeline_parallel_degree": 4, "microbatches": 8})
    stages = pipeline_stages(spec, config, Layout(pp=4))
    assert stages == ((1, 4, True, False), (5, 3, False, False), (5, 2, False, False), (1, 1, False, True))
    block = block_activations(spec, 512, Numerics(2)).per_rank(1) * 2 * 512
    assert _acts(spec, pp=4, in_flight=4, stages=stages).device == pytest.approx(15 * block)
    gpipe = parse_config({"pipeline_parallel_degree": 4, "microbatches": 8, "pipeline_schedule": "gpipe"})
    assert [s[:2] for s in pipeline_stages(spec, gpipe, Layout(pp=4))] == [(1, 4), (5, 4), (5, 4), (1, 4)]
    zbv = parse_config({"pipeline_parallel_degree": 4, "microbatches": 8, "pipeline_schedule": "zbv_zero_bubble"})
    assert [s[2:] for s in pipeline_stages(spec, zbv, Layout(pp=4))][0] == (True, True)   # V-shaped: both ends


def test_each_pipeline_ranks_states_are_its_own_stages():
    """Balanced by compute (embedding lookups free), GPT-2 small's 12 blocks are cut 9 and 3 on 2 stages: the first
    rank holds the embedding and 9 blocks, more parameters than an even cut's 6 would give it; balanced by
    parameters, 6 and 6."""
    spec = resolve_model("gpt2")
    for balance, blocks in [("parameters", 6), ("compute", 9)]:
        config = parse_config({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline_balance": balance})
        memory = predict_memory(spec, config, Layout(pp=2), 2, 512)
        assert memory.parameters == 4 * (spec.embedding_parameters + blocks * spec.layer_parameters)


def test_pipeline_stage_zero_holds_the_in_flight_microbatches():
    spec = resolve_model("gpt2-10b")
    two, three, four = (_acts(spec, pp=4, in_flight=k).device for k in (2, 3, 4))
    tokens = 2 * 512
    one_microbatch = (spec.stage_layers(4) * block_activations(spec, 512, Numerics(2)).per_rank(1)
                      + edge_activations(spec, Numerics(2))[0]) * tokens
    assert four - three == pytest.approx(one_microbatch) and three - two == pytest.approx(one_microbatch)


def test_offload_moves_kept_inputs_to_the_host():
    spec = resolve_model("gpt2-10b")
    kept = _acts(spec, pp=2, in_flight=2, checkpointing="each")
    offloaded = _acts(spec, pp=2, in_flight=2, checkpointing="each", offload=True, loading_horizon=4)
    stage_inputs = spec.stage_layers(2) * spec.hidden * 2 * 2 * 512
    assert offloaded.host == 2 * stage_inputs
    assert offloaded.device < kept.device


def test_other_is_buffers_runtime_and_fragmentation():
    spec = resolve_model("gpt2-10b")
    config = parse_config({"tensor_parallel_degree": 4, "shard_optimizer_state": True, "bf16": True})
    device = cluster_preset("p4d.24xlarge").device
    memory = predict_memory(spec, config, layout_for(config, Cluster(16, 8)), 40, 512, "each", device)
    summary = memory.summary()
    assert summary["other"] == pytest.approx(memory.comm_buffers + device.runtime_reserve_bytes + memory.fragmentation
                                             + memory.overlap)
    accounted = memory.model_states + memory.gathered_params + memory.activations + memory.comm_buffers + memory.overlap
    assert memory.fragmentation == pytest.approx(0.10 * accounted)
    assert summary["total"] == pytest.approx(sum(v for k, v in summary.items() if k != "total"))


def _gpt2(layers: int, width: int):
    return resolve_model(f"gpt2:n_layer={layers},n_embd={width},n_head={width // 64},vocab_size=50257,n_positions=64")


def test_the_root_unit_keeps_a_tied_embedding_and_its_gradient_through_backward():
    """GPT-2's embedding is tied to its head, so it stays in FSDP2's root unit, whose gradients are reduced only when
    backward ends; Llama's untied embedding and head are units of their own, leaving the root its final norm."""
    gpt2, llama = _gpt2(6, 512), resolve_model("llama")
    assert root_unit_parameters(gpt2, Layout(dp_shard=4)) == 50257 * 512 + 64 * 512 + 2 * 512
    assert root_unit_parameters(llama, Layout(dp_shard=4)) == llama.hidden
    zero3 = parse_config({"sharded_data_parallel_degree": 4})
    buffers = comm_buffer_bytes(gpt2, zero3, Layout(dp_shard=4), 2, 64)
    root, block = root_unit_parameters(gpt2, Layout(dp_shard=4)), gpt2.layer_parameters
    assert buffers == 4 * root + max(8 * block, 4 * root)   # fp32: root gradient, beside a block's or its own input


def test_the_optimizer_steps_temporaries_count_where_they_outlast_the_activations():
    """torch's Adam on a CPU, or with `foreach: false`, steps tensor by tensor (two fp32 copies of the largest: the
    embedding), its foreach path on an accelerator holds a copy of every tensor at once; FSDP2 steps shards; an
    offloaded optimizer steps in host memory."""
    spec = _gpt2(6, 1536)
    cpu, gpu = cluster_preset("local", devices_per_node=4).device, cluster_preset("p4d.24xlarge").device

    def memory(config: dict, device, checkpointing="each"):
        parsed = parse_config(config)
        return predict_memory(spec, parsed, layout_for(parsed, Cluster(1, 4)), 2, 64, checkpointing, device)

    embedding = 50257 * 1536 * 4
    ddp = memory({}, cpu)
    assert ddp.step_temporaries == pytest.approx(2 * embedding - ddp.activations)
    zero3 = memory({"sharded_data_parallel_degree": 4}, cpu)
    assert zero3.step_temporaries == max(0.0, 2 * embedding / 4 - zero3.activations - zero3.comm_buffers) == 0
    on_gpu = memory({}, gpu)
    assert on_gpu.step_temporaries == pytest.approx(4 * spec.parameters - on_gpu.activations)
    offloaded = memory({"sharded_data_parallel_degree": 4, "offload_optimizer_state": True}, gpu)
    assert offloaded.step_temporaries == 0 and memory({}, cpu, "none").step_temporaries < ddp.step_temporaries
    one_by_one = memory({"optimizer": {"type": "AdamW", "params": {"foreach": False}}}, gpu)  # torch's for-loop
    assert one_by_one.step_temporaries == pytest.approx(max(0.0, 2 * embedding - one_by_one.activations))
    assert one_by_one.step_temporaries < on_gpu.step_temporaries


def test_regather_keeps_the_norms_outputs_as_sequence_shards_in_blocks_run_without_checkpointing():
    """sequence_parallel_regather: a block run whole keeps each column-parallel input as 1/tp of the sequence
    (test_planner_kept_bytes.py measures it); a checkpointed region keeps its input, and recomputes as before."""
    spec = resolve_model("gpt2-10b")
    tokens, layers = 2 * 512, spec.layers
    per_token = block_activations(spec, 512, Numerics(2))
    sp = dict(tp=8, sequence_parallel=True)
    saved = (per_token.per_rank(8, True) - per_token.per_rank(8, True, True)) * tokens * layers
    assert saved == pytest.approx(per_token.replicated * 7 / 8 * tokens * layers) and saved > 0
    assert _acts(spec, **sp).device - _acts(spec, **sp, regather=True).device == pytest.approx(saved)
    for strategy in ("each", "each:matmul"):
        assert _acts(spec, **sp, regather=True, checkpointing=strategy).device == pytest.approx(
            _acts(spec, **sp, checkpointing=strategy).device)


def test_regathered_inputs_count_twice_whole_in_a_blocks_backward_beyond_the_room_the_head_leaves(monkeypatch):
    """sequence_parallel_regather gathers a block's inputs again in backward, the one in use beside the next
    arriving: two whole inputs, none where every block is checkpointed. Without a pipeline the head's freed tensors
    leave room for them; a pipeline stage's microbatches overlap, so there they add in full."""
    spec = resolve_model("gpt2-10b")
    sp = {"tensor_parallel_degree": 8, "sequence_parallel": True, "bf16": True}
    regather = parse_config({**sp, "sequence_parallel_regather": True})
    layout = Layout(tp=8)
    two_inputs = 2 * (2 * 512) * spec.hidden * 2
    assert regathered_bytes(spec, regather, layout, 2, 512, "none") == two_inputs
    assert regathered_bytes(spec, regather, layout, 2, 512, "each") == 0
    assert regathered_bytes(spec, parse_config(sp), layout, 2, 512, "none") == 0

    def activations(layout: Layout) -> float:
        return predict_memory(spec, regather, layout, 2, 512, "none").activations

    whole, staged = activations(layout), activations(Layout(tp=8, pp=2))
    monkeypatch.setattr(memory, "regathered_bytes", lambda *args: 0.0)
    assert 0 <= whole - activations(layout) <= two_inputs
    assert staged - activations(Layout(tp=8, pp=2)) == pytest.approx(two_inputs)
