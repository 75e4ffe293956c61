"""The time model: collective costs per link, overlap, pipeline bubble, recompute, MFU."""

from dataclasses import replace

import pytest

from shardwise.config import parse_config
from shardwise.planner import cluster_preset, predict_step_time, resolve_model
from shardwise.planner import assumptions as A
from shardwise.planner.collectives import LinkTime, collective_time, group_shape
from shardwise.planner.timing import _gradient_copy_seconds
from shardwise.planner.wrapping import first_broadcast_bucket, reduce_buckets
from shardwise.config.layout import layout_for
from shardwise.topology import Layout

P4D = cluster_preset("4xp4d.24xlarge")


def test_group_shapes_follow_the_innermost_first_placement():
    layout = Layout(pp=1, dp_replicate=4, dp_shard=8, tp=1)
    shard = group_shape(layout, 8, ("dp_shard",))
    assert (shard.size, shard.per_node, shard.nodes) == (8, 8, 1)
    replicas = group_shape(layout, 8, ("dp_replicate",))
    assert (replicas.size, replicas.per_node, replicas.nodes) == (4, 1, 4)
    flat = group_shape(layout, 8, ("dp_replicate", "dp_shard"))
    assert (flat.size, flat.per_node, flat.nodes) == (32, 8, 4)


def test_ring_all_reduce_inside_a_node():
    shape = group_shape(Layout(dp_shard=8), 8, ("dp_shard",))
    nbytes = 1e9
    expected = 2 * 7 / 8 * nbytes / (P4D.intra_node_bandwidth * A.LINK_EFFICIENCY) + 2 * 7 * P4D.intra_node_latency
    assert collective_time("all_reduce", nbytes, shape, P4D).intra == pytest.approx(expected)
    assert collective_time("all_reduce", nbytes, shape, P4D).inter == 0


def test_an_all_gather_across_nodes_is_one_flat_ring_through_every_rank():
    """NCCL's rings span NVLink and the network (NVIDIA/nccl#530; no tree for all-gathers, #1473): every edge
    carries 31/32 of the buffer, the 8 edges leaving a node share its NICs, and a call pays 28 steps inside
    nodes and 3 between them (NCCL's tuning.cc)."""
    shape = group_shape(Layout(dp_shard=32), 8, ("dp_shard",))   # 4 nodes × 8 ranks
    nbytes = 8e9
    t = collective_time("all_gather", nbytes, shape, P4D, calls=10)
    per_rank_bw = P4D.inter_node_bandwidth * A.LINK_EFFICIENCY / 8
    latency = 10 * (28 * P4D.intra_node_latency + 3 * P4D.inter_node_latency)
    assert t.inter == pytest.approx(31 / 32 * nbytes / 8 / per_rank_bw + latency)
    assert t.intra == pytest.approx(31 / 32 * nbytes / (P4D.intra_node_bandwidth * A.LINK_EFFICIENCY))
    hierarchical = 3 / 4 * nbytes / 8 / per_rank_bw
    assert t.inter > 1.29 * hierarchical     # what a node's NICs carry: 31/32 of the buffer, not 3/4


def test_an_all_reduce_across_nodes_runs_hierarchically():
    """Reduce inside each node, all-reduce 1/8 per rank between nodes (NCCL's tree), broadcast back."""
    shape = group_shape(Layout(dp_shard=32), 8, ("dp_shard",))
    nbytes = 8e9
    t = collective_time("all_reduce", nbytes, shape, P4D, calls=10)
    per_rank_bw = P4D.inter_node_bandwidth * A.LINK_EFFICIENCY / 8
    assert t.inter == pytest.approx(2 * 3 / 4 * nbytes / 8 / per_rank_bw + 10 * 4 * P4D.inter_node_latency)
    assert t.intra == pytest.approx(2 * (7 / 8 * nbytes / (P4D.intra_node_bandwidth * A.LINK_EFFICIENCY)
                                         + 10 * 7 * P4D.intra_node_latency))


def _time(config: dict, cluster=P4D, model="gpt2-10b", micro_batch=2, seq=512, checkpointing="none"):
    parsed = parse_config(config)
    layout = layout_for(parsed, cluster.topology)
    return predict_step_time(resolve_model(model), parsed, layout, cluster, micro_batch, seq, checkpointing)


def _without_kernel_table(cluster):
    """The cluster with its device modelled by one achievable share of peak (a device without a kernel table)."""
    return replace(cluster, device=replace(cluster.device, rates=None))


def test_one_device_is_compute_plus_update_and_mfu_follows():
    one = _without_kernel_table(cluster_preset("p4d.24xlarge", devices_per_node=1))
    t = _time({"bf16": True}, cluster=one)
    spec = resolve_model("gpt2-10b")
    flops = 2 * 512 * (spec.flops_per_token(512))
    assert t.compute == pytest.approx(flops / (312e12 * A.ACHIEVABLE_FLOPS_FRACTION))
    assert t.total == pytest.approx(t.compute + t.optimizer)
    assert t.mfu == pytest.approx(A.ACHIEVABLE_FLOPS_FRACTION * t.compute / t.total)


def test_recompute_repeats_the_forward_of_the_blocks():
    flat = _without_kernel_table(P4D)
    none, each = (_time({"bf16": True}, cluster=flat, checkpointing=c) for c in ("none", "each"))
    spec = resolve_model("gpt2-10b")
    block_share = spec.forward_flops_per_token(512, spec.layers) / (spec.forward_flops_per_token(512, spec.layers)
                                                                    + spec.edge_flops_per_token())
    assert each.recompute == pytest.approx(none.compute / 3 * block_share)


def test_pipeline_bubble_is_pp_minus_one_microbatch_slots_per_round():
    """One round of all 16 microbatches fills and drains the 8 stages once; rounds of 2 (active_microbatches
    below pp, run as GPipe by the runtime) do it 8 times, each with its exposed sends."""
    node = cluster_preset("p4d.24xlarge")
    t = _time({"bf16": True, "pipeline_parallel_degree": 8, "microbatches": 16}, cluster=node)
    per_microbatch = (t.compute + t.recompute + t.tensor_parallel) / 16
    assert t.pipeline_bubble == pytest.approx(7 * per_microbatch)
    starved = _time({"bf16": True, "pipeline_parallel_degree": 8, "microbatches": 16, "active_microbatches": 2},
                    cluster=node)
    assert starved.pipeline_bubble == pytest.approx(8 * 7 * per_microbatch)
    assert starved.pipeline_p2p == pytest.approx(8 * t.pipeline_p2p)


def test_overlap_hides_most_zero3_traffic():
    t = _time({"bf16": True, "sharded_data_parallel_degree": 32})
    serial = sum(c.seconds for c in t.collectives)
    assert 0 < t.data_parallel < serial
    names = {c.name.split(" (")[0] for c in t.collectives}
    assert names == {"parameter all-gather", "gradient reduce-scatter"}


def test_tensor_parallel_all_reduces_are_on_the_critical_path():
    t = _time({"bf16": True, "tensor_parallel_degree": 8})
    tp = next(c for c in t.collectives if c.axis == "tp")
    assert t.tensor_parallel == pytest.approx(tp.seconds) and tp.link == "intra"
    assert tp.bytes_per_step == pytest.approx(4 * 48 * 2 * 512 * 4096 * 2)   # 4 all-reduces per block


_BLOCK_NORMS = resolve_model("gpt2-10b").block_norm_tensors


def test_regathered_inputs_overlap_backward_but_the_first():
    """sequence_parallel_regather's all-gathers in backward start before backward needs them
    (parallel/tensor/regather.py): beyond what the blocks' backward hides, only the overlap's cost
    (1 − OVERLAP_EFFICIENCY of them) and the first, which nothing hides, add to the step; charged exposed they
    would cost all of their time."""
    sp = {"bf16": True, "tensor_parallel_degree": 8, "sequence_parallel": True}
    plain, again = _time(sp), _time({**sp, "sequence_parallel_regather": True})
    gathers = next(c for c in again.collectives if c.name.startswith("activation gathered again"))
    assert gathers.name.endswith("(overlaps backward's compute)") and gathers.axis == "tp"
    assert gathers.bytes_per_step == pytest.approx(2 * 48 * 2 * 512 * 4096 * 2)   # two inputs a block, bf16
    added = again.tensor_parallel - plain.tensor_parallel
    blocks = 2 * 48
    hidden = (1 - A.OVERLAP_EFFICIENCY) * gathers.seconds + gathers.seconds / blocks
    assert added == pytest.approx(hidden) and added < gathers.seconds / 2


@pytest.mark.parametrize("config, ops", [
    ({"tensor_parallel_degree": 8}, 4 * 48),            # per block 2 all-reduces forward, 2 backward
    ({"tensor_parallel_degree": 8, "sequence_parallel": True}, 2 * 4 * 48 + 2 + 48 * _BLOCK_NORMS),
    # each block's two column-parallel inputs gathered again in backward (test_sequence_parallel.py counts them)
    ({"tensor_parallel_degree": 8, "sequence_parallel": True, "sequence_parallel_regather": True},
     2 * 4 * 48 + 2 + 48 * _BLOCK_NORMS + 2 * 48),
    ({"pipeline_parallel_degree": 4, "microbatches": 8}, 8 * 4),   # a middle stage: F and B received and sent
    ({"pipeline_parallel_degree": 2, "microbatches": 8}, 8 * 2),   # each stage is an end
    ({"pipeline_parallel_degree": 4, "microbatches": 8, "pipeline_schedule": "interleaved_1f1b"}, 8 * 8),
    ({"pipeline_parallel_degree": 4, "microbatches": 8, "pipeline_schedule": "zbv_zero_bubble"}, 8 * 8),
    ({"context_parallel_degree": 2}, (3 * 2 - 2) * 48),  # the ring's hops, per block
    ({"context_parallel_degree": 2, "context_parallel_mode": "all_to_all"}, 8 * 48),  # q, k, v, out each way
    ({"sharded_data_parallel_degree": 32}, 0),          # FSDP's collectives overlap compute
])
def test_each_op_on_the_critical_path_costs_its_host_time(config, ops):
    """ClusterSpec.critical_op_seconds charges each collective or send a rank waits on, once per op; zero-bubble's
    V shape keeps the middle stages' hop on one rank (no send)."""
    config = {"bf16": True, **config}
    charged = _time(config, cluster=replace(P4D, critical_op_seconds=1e-3))
    assert charged.total - _time(config).total == pytest.approx(ops * 1e-3)


def test_data_parallel_collectives_are_the_runtimes():
    """As bench/sharding.py counts them: DDP all-reduces fp32 gradients, ZeRO-1 then broadcasts every
    tensor from its owner during the next forward, ZeRO-2 gathers in forward only and ZeRO-3 in backward
    too; in bf16 the gathers move bf16 and the gradients fp32, and ZeRO-1 reduces fp32 gradients to their
    owners in buckets during every backward and broadcasts bf16 parameters."""
    a = resolve_model("gpt2-10b").parameters

    def collectives(config: dict) -> list[tuple[str, float]]:
        return sorted((c.name, c.bytes_per_step) for c in _time({"bf16": True, **config}).collectives)

    assert collectives({}) == [("gradient all-reduce (overlaps last backward)", 4 * a)]
    assert collectives({"shard_optimizer_state": True, "bf16": False}) == [
        ("gradient all-reduce (overlaps last backward)", 4 * a),
        ("parameter broadcast (overlaps next forward)", 4 * a)]
    assert collectives({"shard_optimizer_state": True}) == [
        ("gradient reduce (overlaps backward)", 4 * a),
        ("parameter broadcast (overlaps next forward)", 2 * a)]
    zero2 = [("gradient reduce-scatter (overlaps backward)", 4 * a), ("parameter all-gather (overlaps forward)", 2 * a)]
    assert collectives({"zero_stage": 2, "sharded_data_parallel_degree": 32}) == zero2
    assert collectives({"sharded_data_parallel_degree": 32}) == sorted(
        zero2 + [("parameter all-gather (overlaps backward)", 2 * a)])


def test_zero1_half_precision_reduce_overlaps_backward():
    """ZeRO-1 in bf16 sends its fp32 gradient reduces in buckets during every microbatch's backward (the last
    one's under a pipeline): they hide behind it like ZeRO-2's reduce-scatters, one latency per bucket."""
    spec = resolve_model("gpt2-10b")
    config = {"bf16": True, "tensor_parallel_degree": 4, "shard_optimizer_state": True}
    zero1 = _time(config)
    reduce, broadcast = sorted(zero1.collectives, key=lambda c: c.name)[1:]
    assert reduce.name == "gradient reduce (overlaps backward)"
    assert zero1.data_parallel < reduce.seconds + broadcast.seconds
    layout = layout_for(parse_config(config), P4D.topology)
    assert reduce_buckets(spec, layout).count > layout.dp   # each owner's share travels in several buckets
    piped = _time({**config, "pipeline_parallel_degree": 2, "microbatches": 4})
    assert "gradient reduce (overlaps last backward)" in {c.name for c in piped.collectives}


def _stretched(window: float, comm: LinkTime, head: float, beside: LinkTime = LinkTime()) -> float:
    """docs/planner.md's overlap: how much longer a phase of `window` seconds lasts with `comm` overlapping it,
    while critical-path collectives of `beside` link time hold one link level and `comm` streams on the other."""
    reach = max(window, comm.intra - beside.inter, comm.inter - beside.intra)
    return reach + (1 - A.OVERLAP_EFFICIENCY) * min(window, comm.busiest) + head - window


def test_zero1_broadcasts_overlap_the_next_forward_but_its_first_bucket():
    """ZeRO-1's broadcasts after the step run during the next step's first forward, each module waiting for
    its bucket: beyond the overlap's cost, the first bucket (the token embedding, alone in it) is exposed, as
    ZeRO-2's first gather is. The blocks' tensor-parallel all-reduces hold NVLink, not the network, so the
    replicas' traffic between nodes goes on during them. Under FSDP2's `replicate` (fp32 with tensor
    parallelism), which copies the parameters before forward, the step waits for them: exposed in full."""
    spec = resolve_model("gpt2-10b")
    config = {"bf16": True, "tensor_parallel_degree": 4, "shard_optimizer_state": True}
    t = _time(config)
    parsed = parse_config(config)
    layout = layout_for(parsed, P4D.topology)
    first_bytes, first_tensors = first_broadcast_bucket(spec, parsed, layout)
    assert (first_bytes, first_tensors) == (2 * spec.vocab * spec.hidden / 4, 1)
    shape = group_shape(layout, 8, ("dp_replicate", "dp_shard"))
    a = spec.parameters / 4
    broadcast = collective_time("broadcast", 2 * a, shape, P4D, len(spec.stage_tensors(1)))
    reduce = collective_time("reduce", 4 * a, shape, P4D, reduce_buckets(spec, layout).count)
    first = collective_time("broadcast", first_bytes, shape, P4D).serial
    forward = t.compute / 3
    # two all-reduces of a block's activations forward, two backward
    all_reduces = collective_time("all_reduce", 2 * 48 * 2 * 512 * 4096 * 2, group_shape(layout, 8, ("tp",)), P4D,
                                  2 * 48)
    assert all_reduces.inter == 0
    copies = (2 + 4) * a / P4D.device.streaming_bandwidth  # each bf16 gradient copied into its fp32 bucket
    assert t.data_parallel == pytest.approx(
        _stretched(2 * forward, reduce, reduce.busiest / spec.layers, all_reduces)
        + _stretched(forward, broadcast, first, all_reduces) + copies)
    assert 0 < first < _stretched(forward, broadcast, first, all_reduces) < broadcast.busiest
    assert "parameter broadcast (overlaps next forward)" in {c.name for c in t.collectives}

    fsdp = _time({"tensor_parallel_degree": 4, "shard_optimizer_state": True})
    assert "parameter broadcast (after the optimizer step)" in {c.name for c in fsdp.collectives}


def test_network_traffic_goes_on_while_tensor_parallel_collectives_hold_nvlink():
    """With tensor parallelism inside nodes and one replica per node, ZeRO-1's reduces and broadcasts cross only
    the network: the blocks' all-reduces, which the step waits on anyway, hide them as compute does. A slower
    NVLink lengthens those all-reduces and leaves less of the replicas' traffic exposed; the same traffic inside
    a node (two nodes' worth of replicas on one) shares NVLink with them and gains nothing."""
    config = {"bf16": True, "tensor_parallel_degree": 8, "shard_optimizer_state": True}
    slow_nvlink = replace(P4D, intra_node_bandwidth=P4D.intra_node_bandwidth / 4)
    fast, slow = _time(config), _time(config, cluster=slow_nvlink)
    assert slow.tensor_parallel > fast.tensor_parallel
    assert {c.link for c in fast.collectives if c.axis != "tp"} == {"inter"}
    assert slow.data_parallel < fast.data_parallel
    one_node = cluster_preset("p4d.24xlarge")
    inside = {"bf16": True, "tensor_parallel_degree": 4, "shard_optimizer_state": True}
    assert {c.link for c in _time(inside, cluster=one_node).collectives} == {"intra"}
    slower = replace(one_node, intra_node_bandwidth=one_node.intra_node_bandwidth / 4)
    assert _time(inside, cluster=slower).data_parallel > _time(inside, cluster=one_node).data_parallel


@pytest.mark.parametrize("config, per_parameter", [
    ({"bf16": True, "zero_stage": 3, "sharded_data_parallel_degree": 32, "microbatches": 2}, 2 * (2 * 2 * 2 + 2 + 4)),
    ({"bf16": True, "zero_stage": 2, "sharded_data_parallel_degree": 32, "microbatches": 2}, 2 * (2 * 2 + 2 + 4)),
    ({"zero_stage": 3, "sharded_data_parallel_degree": 32, "microbatches": 2}, 2 * (2 * 2 * 4 + 4 + 4)),
    ({"bf16": True, "zero_stage": 2, "sharded_data_parallel_degree": 16, "pipeline_parallel_degree": 2,
      "microbatches": 4}, 2 * 2 + 4 * (2 + 2 * 4) + 2 * 4),
    ({"bf16": True, "zero_stage": 1, "microbatches": 2}, 2 * (2 + 4)),
    ({"bf16": True, "zero_stage": 1, "microbatches": 2, "accumulate_gradients_locally": True}, 2 * (2 + 2 * 4)),
    ({"bf16": True, "zero_stage": 1, "pipeline_parallel_degree": 2, "microbatches": 4}, 2 + 4),
])
def test_gradient_copies_take_their_bytes_at_the_streaming_bandwidth(config, per_parameter):
    """torch's FSDP2 copies every all-gather's output into the parameters and every reduce-scatter's input out of the
    unsharded gradients (upcast to fp32), on the compute stream; a pipeline stage instead adds each microbatch into
    its fp32 accumulators and copies them in once. ZeRO-1's master weights copy each gradient into its fp32 bucket
    when it travels (every microbatch, a pipeline's last), or add every microbatch's into the fp32 sums when they
    accumulate locally. Those bytes at the streaming bandwidth are part of the data-parallel time; DDP makes no
    such copy here."""
    parsed = parse_config(config)
    layout = layout_for(parsed, P4D.topology)
    spec = resolve_model("gpt2-10b")
    copies = _gradient_copy_seconds(spec, parsed, layout, P4D)
    assert copies == pytest.approx(per_parameter * spec.stage_parameters(layout.pp) / P4D.device.streaming_bandwidth)
    assert predict_step_time(spec, parsed, layout, P4D, 2, 512).data_parallel > copies > 0
    ddp = parse_config({"bf16": True})
    assert _gradient_copy_seconds(spec, ddp, layout_for(ddp, P4D.topology), P4D) == 0
