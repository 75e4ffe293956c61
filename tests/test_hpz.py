"""ZeRO++ hpZ (`zero_hpz_partition_size`): after forward, ZeRO-3 keeps parameters sharded over a
secondary group inside a node, and backward gathers them there.

Two simulated nodes of two ranks, ZeRO-3 over all four (`sharded_data_parallel_degree=4`) with
secondary groups of two: the nodes. Measured in bytes, per collective and process group, with
observe/comms.py's dispatch-mode recorder: forward's all-gathers span the sharding group, backward's
stay inside the secondary group and move the same bytes (the whole unit, in the compute dtype), as
the planner predicts; after forward each rank holds half of every parameter in the compute dtype.
Plain ZeRO-3 on the same world is the contrast. It trains as one process does (alone here, and in the
combination matrix's `zero3-hpz` layout); MiCS partition groups with secondary groups inside them
need eight ranks (run last). Every rule's error names the key, the rule and the fix.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
import torch
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.config import ConfigError, parse_config
from shardwise.planner import cluster_preset, predict_memory, predict_step_time, spec_from_hf
from shardwise.planner.wrapping import gathered_bytes
from shardwise.testing import run_distributed
from shardwise.config.layout import layout_for
from shardwise.topology import Cluster, Layout
from shardwise.config.decisions import Decisions
from shardwise.config.layout import validate
from tiny_models import SEQ, blocks, build, dataset, loss_fn, relative_error, train_reference, train_seed_loop

WORLD, PER_NODE, ROWS = 4, 2, 2
HPZ = {"sharded_data_parallel_degree": WORLD, "zero_hpz_partition_size": PER_NODE}
ZERO3 = {"sharded_data_parallel_degree": WORLD}
SHARD = "dp"  # the sharding group is every rank here, which observe/comms.py's mesh_groups labels dp


def problems(config: dict, cluster: Cluster) -> list[str]:
    try:
        validate(config, cluster)
    except ConfigError as err:
        return [str(p) for p in err.problems]
    return []


# --- the rules -------------------------------------------------------------------------------------------


def test_secondary_groups_of_the_sharding_group_are_decided_once_for_runtime_and_planner():
    config = parse_config(HPZ)
    layout = layout_for(config, Cluster(2, PER_NODE))
    assert Decisions(config, layout).secondary_partition == PER_NODE
    # off, or as large as the sharding group: plain ZeRO-3 re-sharding over the whole group
    assert Decisions(parse_config(ZERO3), layout).secondary_partition == 0
    whole = parse_config({**ZERO3, "zero_hpz_partition_size": WORLD})
    assert Decisions(whole, layout_for(whole, Cluster(1, WORLD))).secondary_partition == 0


def test_a_size_of_the_whole_sharding_group_or_more_is_plain_zero3_as_deepspeed_clamps_it():
    """A DeepSpeed config made for nodes of 8 runs on one node of 4, and in one process."""
    for cluster in (Cluster(1, 4), Cluster(1, 1)):
        assert problems({"zero_stage": 3, "zero_hpz_partition_size": 8}, cluster) == []
        config = parse_config({"zero_stage": 3, "zero_hpz_partition_size": 8})
        assert Decisions(config, layout_for(config, cluster)).secondary_partition == 0


def test_check_config_names_the_secondary_groups_and_where_they_lie():
    from shardwise.config.describe import describe_layout

    config = parse_config(HPZ)
    cluster = Cluster(2, PER_NODE)
    text = describe_layout(config, layout_for(config, cluster), cluster).splitlines()
    assert text[2].startswith("data parallel: ZeRO-3 with ZeRO++ hpZ (after forward, parameters stay sharded over 2 "
                              "ranks, where backward gathers them)")
    assert text[3:5] == ["dp_shard groups (ZeRO partition, crosses nodes): [0,1,2,3]",
                         "hpz groups (ZeRO++ hpZ secondary: backward's all-gathers, inside nodes): [0,1] [2,3]"]


def test_needs_zero3():
    found = problems({"zero_stage": 2, "sharded_data_parallel_degree": 4, "zero_hpz_partition_size": 2},
                     Cluster(1, 4))
    assert found == ["zero_hpz_partition_size=2: needs ZeRO-3, which shards parameters (this config runs "
                     "ZeRO-2): hpZ decides how far parameters are re-sharded after forward; fix: set zero_stage to "
                     "3 (with sharded_data_parallel_degree > 1, or alone for the whole data-parallel group), or set "
                     "zero_hpz_partition_size to 1"]
    assert "ZeRO-0" in problems({"zero_hpz_partition_size": 2}, Cluster(1, 4))[0]
    assert problems({"zero_stage": 3, "zero_hpz_partition_size": 2}, Cluster(1, 4)) == []


def test_refused_with_tensor_and_pipeline_parallelism():
    tp = problems({**HPZ, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2}, Cluster(2, 4))
    assert tp == ["zero_hpz_partition_size=2: cannot be used with tensor_parallel_degree > 1: FSDP2 cannot "
                  "re-shard tensor-parallel (DTensor) parameters to a secondary group (torch 2.13); fix: set "
                  "zero_hpz_partition_size to 1, or tensor_parallel_degree to 1"]
    pp = problems({**HPZ, "pipeline_parallel_degree": 2, "microbatches": 2}, Cluster(2, 4))
    assert pp == ["zero_hpz_partition_size=2: is not available with pipeline_parallel_degree > 1 yet; fix: set "
                  "zero_hpz_partition_size to 1, or pipeline_parallel_degree to 1"]


def test_must_divide_the_sharding_group():
    # 12 ranks, 6 per node, MiCS groups of 4: a secondary group of 3 would straddle two of them
    found = problems({"sharded_data_parallel_degree": 4, "zero_hpz_partition_size": 3}, Cluster(2, 6))
    assert found == ["zero_hpz_partition_size=3: must divide the sharding group's 4 ranks "
                     "(sharded_data_parallel_degree, or the whole data-parallel group without it): each secondary "
                     "group is part of one sharding group; fix: use a divisor of 4: 1, 2, 4"]


def test_must_stay_inside_a_node():
    found = problems({"sharded_data_parallel_degree": 8, "zero_hpz_partition_size": 4}, Cluster(4, 2))
    assert found == ["zero_hpz_partition_size=4: must divide the 2 ranks per node: backward's all-gathers run "
                     "inside a secondary group, which stays inside a node; fix: use a divisor of 2: 1, 2"]


def test_a_size_below_one_is_refused_by_type():
    assert problems({**HPZ, "zero_hpz_partition_size": 0}, Cluster(2, PER_NODE)) == [
        "zero_hpz_partition_size=0: input should be greater than or equal to 1; fix: use 1 or more"]


# --- the planner -----------------------------------------------------------------------------------------

GPT2_6 = {"model_type": "gpt2", "n_layer": 6, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64}


def test_planner_keeps_every_blocks_secondary_shard_at_the_peak():
    """When forward ends, with the root gathered for the loss, all six blocks keep 1/2 in the compute dtype."""
    spec = spec_from_hf(GPT2_6, "gpt2")
    layout = Layout(dp_shard=WORLD)
    for precision, low in (({}, 4), ({"bf16": True}, 2)):
        plain, hpz = parse_config({**ZERO3, **precision}), parse_config({**HPZ, **precision})
        extra = gathered_bytes(spec, hpz, layout) - gathered_bytes(spec, plain, layout)
        assert extra == pytest.approx(low * 6 * spec.layer_parameters / PER_NODE)
        cpu = cluster_preset("local").device
        assert (predict_memory(spec, hpz, layout, 2, 64, device=cpu).total
                > predict_memory(spec, plain, layout, 2, 64, device=cpu).total)


def test_planner_gathers_backward_inside_the_secondary_group_and_it_stays_in_the_node():
    """On 2 nodes × 8 GPUs with ZeRO-3 over all 16, backward's gather moves the same bytes inside the node, which
    shortens the step of a model large enough for bandwidth, not latency, to bound its collectives."""
    spec = spec_from_hf({**GPT2_6, "n_layer": 24, "n_embd": 2048, "n_head": 16}, "gpt2")
    cluster = cluster_preset("2xp4d.24xlarge")
    layout = Layout(dp_shard=16)
    plain = predict_step_time(spec, parse_config({"sharded_data_parallel_degree": 16}), layout, cluster, 1, 64)
    config = parse_config({"sharded_data_parallel_degree": 16, "zero_hpz_partition_size": 8})
    hpz = predict_step_time(spec, config, layout, cluster, 1, 64)
    gathers = {c.name: c for c in hpz.collectives if "all-gather" in c.name}
    forward, backward = gathers["parameter all-gather (overlaps forward)"], gathers[
        "parameter all-gather (overlaps backward)"]
    assert (forward.axis, backward.axis) == ("dp_shard", "hpz")
    assert forward.bytes_per_step == backward.bytes_per_step
    assert (forward.link, backward.link) == ("intra+inter", "intra")
    assert hpz.data_parallel < plain.data_parallel


def test_the_plan_proposes_hpz_where_zero3_spans_nodes_and_ranks_it_by_its_time():
    """On 4 nodes of 8 A100s, ZeRO-3 over all 32 ranks is also planned with hpZ over each node's 8: faster (only
    forward's gathers leave the node) and larger by the secondary shards; never with TP or PP, nor within a node."""
    from shardwise.planner import plan

    spec = spec_from_hf({**GPT2_6, "n_layer": 24, "n_embd": 2048, "n_head": 16}, "gpt2")
    result = plan(spec, cluster_preset("4xp4d.24xlarge"), global_batch=32, seq=512)
    zero3 = {e.config.get("zero_hpz_partition_size", 0): e for e in result.considered
             if e.layout == Layout(dp_shard=32) and e.zero_stage == 3 and e.checkpointing == "none"}
    assert set(zero3) == {0, 8}
    assert zero3[8].step_time < zero3[0].step_time
    extra = zero3[8].memory.gathered_params - zero3[0].memory.gathered_params
    assert extra == pytest.approx(2 * 24 * spec.layer_parameters / 8)  # bf16 halves of 24 blocks on 8 ranks
    assert all(e.layout.tp == e.layout.pp == 1 and e.layout.dp_shard > 8 and e.zero_stage == 3
               for e in result.considered if e.config.get("zero_hpz_partition_size"))


# --- the runtime: bytes per collective and group, memory after forward ------------------------------------


def record_step(config: dict) -> dict:
    """One training step of the tiny GPT-2; this rank's collectives by (phase, op, group label, group size):
    [calls, bytes]; and the parameters as forward leaves them (mesh shape, bytes held, dtype)."""
    from shardwise.observe.comms import CollectiveWatch, mesh_groups
    from shardwise.runtime.state import current

    sw.init(config)
    model = sw.DistributedModel(build("gpt2"))
    optimizer = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    seen: dict = {}

    @sw.step
    def train_step(model, inputs, targets):
        loss = loss_fn("gpt2", model, inputs, targets)
        held = [p for p in model.get_module().parameters() if isinstance(p, DTensor)]
        seen["meshes"] = sorted({tuple(p.device_mesh.mesh.shape) for p in held})
        seen["held_bytes"] = sum(p.to_local().numel() * p.to_local().element_size() for p in held)
        seen["dtypes"] = sorted({str(p.dtype) for p in held})
        seen["backward"] = time.perf_counter()
        model.backward(loss)
        return loss

    inputs, targets = dataset("gpt2", sw.dp_size() * ROWS)[sw.rank() * ROWS:(sw.rank() + 1) * ROWS]
    watch = CollectiveWatch(mesh_groups(current().mesh))
    optimizer.zero_grad()
    with watch:
        train_step(model, inputs, targets)
    optimizer.step()
    counts: dict = defaultdict(lambda: [0, 0])
    for c in watch.collectives:
        phase = "forward" if c.issued < seen["backward"] else "backward"
        counts[phase, c.name, c.group, c.ranks][0] += 1
        counts[phase, c.name, c.group, c.ranks][1] += c.nbytes
    del seen["backward"]
    return {"collectives": dict(counts), **seen}


def _gathers(rank: dict) -> dict:
    return {(phase, group, ranks): n for (phase, name, group, ranks), n in rank["collectives"].items()
            if name == "all_gather"}


def _model_bytes(low: int) -> int:
    return low * sum(p.numel() for p in build("gpt2").parameters())  # every dim divides by 4: no padding


@pytest.fixture(scope="module")
def measured() -> dict:
    configs = {"hpz": HPZ, "hpz-bf16": {**HPZ, "bf16": True}, "zero3": ZERO3}
    return {name: run_distributed(record_step, WORLD, config, nproc_per_node=PER_NODE, timeout=180)
            for name, config in configs.items()}


@pytest.mark.parametrize("name, low", [("hpz", 4), ("hpz-bf16", 2)])
def test_backward_gathers_inside_the_node_the_bytes_forward_gathered_over_all(measured, name, low):
    """Forward: one all-gather per unit over the 4-rank sharding group; backward: as many, over the 2-rank
    secondary group (the node), the same bytes, which are the model's parameters in the compute dtype."""
    units = 3  # GPT-2's two blocks and the root
    for rank in measured[name]:
        assert _gathers(rank) == {("forward", SHARD, WORLD): [units, _model_bytes(low)],
                                  ("backward", "hpz", PER_NODE): [units, _model_bytes(low)]}
        scatters = {k: v for k, v in rank["collectives"].items() if k[1] == "reduce_scatter"}
        assert scatters == {("backward", "reduce_scatter", SHARD, WORLD): [units, _model_bytes(4)]}


def test_forward_leaves_each_rank_half_of_every_parameter_in_the_compute_dtype(measured):
    for name, low, dtype in (("hpz", 4, "torch.float32"), ("hpz-bf16", 2, "torch.bfloat16")):
        for rank in measured[name]:
            assert rank["meshes"] == [(WORLD // PER_NODE, PER_NODE)]  # (other secondary groups, secondary group)
            assert rank["held_bytes"] == _model_bytes(low) // PER_NODE
            assert rank["dtypes"] == [dtype]


def test_plain_zero3_gathers_backward_over_the_whole_group_and_keeps_a_quarter(measured):
    for rank in measured["zero3"]:
        assert _gathers(rank) == {("forward", SHARD, WORLD): [3, _model_bytes(4)],
                                  ("backward", SHARD, WORLD): [3, _model_bytes(4)]}
        assert rank["meshes"] == [(WORLD,)] and rank["held_bytes"] == _model_bytes(4) // WORLD


def test_the_planner_predicts_the_measured_bytes(measured):
    """The planner's per-step bytes of each all-gather, on its group, are the bytes measured."""
    spec = spec_from_hf(build("gpt2").config.to_dict(), "gpt2")
    cluster = cluster_preset("local", nodes=2, devices_per_node=PER_NODE)
    for name, config in (("hpz", HPZ), ("hpz-bf16", {**HPZ, "bf16": True})):
        config = parse_config(config)
        layout = layout_for(config, Cluster(2, PER_NODE))
        predicted = {(c.name, c.axis): c.bytes_per_step for c in
                     predict_step_time(spec, config, layout, cluster, ROWS, SEQ).collectives if "all-gather" in c.name}
        gathers = _gathers(measured[name][0])
        assert predicted == {
            ("parameter all-gather (overlaps forward)", "dp_shard"): gathers["forward", SHARD, WORLD][1],
            ("parameter all-gather (overlaps backward)", "hpz"): gathers["backward", "hpz", PER_NODE][1]}


def evaluate_then_meshes(config: dict) -> list:
    """The meshes of the parameters after an evaluation step (no backward)."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2"))

    @sw.step
    def eval_step(model, inputs, targets):
        return loss_fn("gpt2", model, inputs, targets)

    with torch.no_grad():
        eval_step(model, *dataset("gpt2", ROWS)[:ROWS])
    return sorted({tuple(p.device_mesh.mesh.shape) for p in model.parameters()})


def test_an_evaluation_step_leaves_parameters_sharded_over_the_whole_group():
    """No backward follows: @step re-shards what forward left on the secondary groups, so that an optimizer step
    before the next forward is what that forward gathers."""
    assert run_distributed(evaluate_then_meshes, WORLD, HPZ, nproc_per_node=PER_NODE) == [[(WORLD,)]] * WORLD


# --- same math ---------------------------------------------------------------------------------------------


def train_hpz(config: dict, kind: str, steps: int, checkpointing: bool = False) -> dict:
    sw.init(config)
    model = sw.DistributedModel(build(kind, freeze_key_bias=True))
    if checkpointing:  # backward recomputes each block from the secondary shards forward left
        for block in blocks(model.get_module()):
            sw.set_activation_checkpointing(block)
    return train_seed_loop(model, kind, steps, ROWS)


@pytest.mark.parametrize("extra, checkpointing", [({}, False), ({"microbatches": 2}, True)],
                         ids=["one-microbatch", "microbatches-checkpointing"])
def test_trains_as_one_process(extra, checkpointing):
    """Four steps of SGD on GPT-2 match one plain process: losses and every parameter within 1e-5."""
    steps = 4
    ranks = run_distributed(train_hpz, WORLD, {**HPZ, **extra}, "gpt2", steps, checkpointing,
                            nproc_per_node=PER_NODE, timeout=300)
    want = train_reference("gpt2", "sgd", steps, ROWS * WORLD)
    torch.testing.assert_close(torch.tensor([r["losses"] for r in ranks]).mean(0), torch.tensor(want["losses"]),
                               rtol=1e-5, atol=0)
    assert max(relative_error(ranks[0]["state"][k], v) for k, v in want["state"].items()) <= 1e-5


# --- eight ranks, last: a world of eight stops the idle pools of four, so those run first and these two share ---


def test_with_mics_partition_groups_only_the_gradient_all_reduce_leaves_a_node():
    """Eight ranks on two nodes of four, MiCS partition groups of four (the nodes) cut into secondary groups of two:
    forward gathers inside the partition group, backward inside the secondary group, and only the gradient
    shards' all-reduce crosses to the other node's replica."""
    config = {"sharded_data_parallel_degree": 4, "zero_hpz_partition_size": 2}
    for rank in run_distributed(record_step, 8, config, nproc_per_node=4, timeout=300):
        assert _gathers(rank) == {("forward", "shard", 4): [3, _model_bytes(4)],
                                  ("backward", "hpz", 2): [3, _model_bytes(4)]}
        assert {(name, group) for _, name, group, _ in rank["collectives"]} == {
            ("all_gather", "shard"), ("all_gather", "hpz"), ("reduce_scatter", "shard"), ("all_reduce", "replicate")}
        assert rank["meshes"] == [(2, 2)] and rank["held_bytes"] == _model_bytes(4) // 2


def test_mics_partition_groups_with_secondary_groups_inside_train_as_one_process():
    """Eight ranks on two nodes of four: MiCS partition groups of four (the nodes), secondary groups of two
    inside each; ranks hold different partition groups, and every secondary group is made once for all."""
    steps = 3
    config = {"sharded_data_parallel_degree": 4, "zero_hpz_partition_size": 2, "microbatches": 2}
    ranks = run_distributed(train_hpz, 8, config, "gpt2", steps, nproc_per_node=4, timeout=600)
    want = train_reference("gpt2", "sgd", steps, ROWS * 8)
    torch.testing.assert_close(torch.tensor([r["losses"] for r in ranks]).mean(0), torch.tensor(want["losses"]),
                               rtol=1e-5, atol=0)
    assert max(relative_error(ranks[0]["state"][k], v) for k, v in want["state"].items()) <= 1e-5
