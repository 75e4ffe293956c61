"""The topology-aware layout: degrees from config + cluster, ranks placed innermost-first, and the
runtime's rank helpers and process groups agreeing with the pure layout."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise as sw
from shardwise.config import ConfigError, parse_config
from shardwise.testing import run_distributed
from shardwise.config.layout import layout_for
from shardwise.topology import AXES, Cluster, Layout


@pytest.mark.parametrize("config, cluster, degrees", [
    ({}, (1, 4), (1, 4, 1, 1)),  # DDP: every rank a replica
    ({"shard_optimizer_state": True}, (1, 4), (1, 4, 1, 1)),  # ZeRO-1 shards states, not the mesh
    ({"sharded_data_parallel_degree": 8}, (2, 4), (1, 1, 8, 1)),  # ZeRO-3 over all data-parallel ranks
    ({"zero_stage": 2, "sharded_data_parallel_degree": 8}, (2, 4), (1, 1, 8, 1)),  # ZeRO-2
    ({"zero_stage": 3}, (2, 4), (1, 1, 8, 1)),  # stage without a degree: shard over all of dp
    ({"sharded_data_parallel_degree": 4}, (2, 4), (1, 2, 4, 1)),  # MiCS: one partition group per node
    ({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2}, (2, 4), (1, 2, 2, 2)),
    ({"tensor_parallel_degree": 4, "pipeline_parallel_degree": 2}, (2, 4), (2, 1, 1, 4)),
])
def test_degrees_from_config_and_cluster(config, cluster, degrees):
    assert layout_for(parse_config(config), Cluster(*cluster)).shape == degrees


def test_traffic_heavy_groups_stay_inside_a_node():
    """Two nodes of 4 with TP 2 and partition groups of 2: TP and ZeRO groups are node-local; only the
    replicas (gradient all-reduce) span nodes."""
    cluster = Cluster(nodes=2, devices_per_node=4)
    layout = layout_for(parse_config({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2}), cluster)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert not layout.crosses_nodes(cluster, "tp")
    assert not layout.crosses_nodes(cluster, "dp_shard")
    assert layout.crosses_nodes(cluster, "dp_replicate")


def test_flat_zero3_across_nodes_is_reported_as_crossing():
    cluster = Cluster(nodes=2, devices_per_node=2)
    layout = layout_for(parse_config({"sharded_data_parallel_degree": 4}), cluster)
    assert layout.groups("dp_shard") == [[0, 1, 2, 3]]
    assert layout.crosses_nodes(cluster, "dp_shard")


@pytest.mark.parametrize("env, shape", [
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, (2, 4)),  # torchrun
    ({"WORLD_SIZE": "4"}, (1, 4)),
    ({"SLURM_NTASKS": "16", "SLURM_NNODES": "2"}, (2, 8)),
    ({}, (1, 1)),  # no launcher
])
def test_cluster_shape_from_the_environment(env, shape):
    cluster = Cluster.from_env(env)
    assert (cluster.nodes, cluster.devices_per_node) == shape


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "3"},
     "invalid shardwise config: LOCAL_WORLD_SIZE=3: must divide WORLD_SIZE=8 (shardwise needs the same number of "
     "processes on every node); fix: start the same number of processes on every node, so that LOCAL_WORLD_SIZE "
     "is one of 1, 2, 4, 8"),
    ({"SLURM_NTASKS": "10", "SLURM_NNODES": "4"},
     "invalid shardwise config: SLURM_NNODES=4: must divide SLURM_NTASKS=10 (shardwise needs the same number of "
     "processes on every node); fix: start the same number of processes on every node, so that SLURM_NNODES "
     "is one of 1, 2, 5, 10"),
    ({"WORLD_SIZE": "four", "LOCAL_WORLD_SIZE": "0"},
     "invalid shardwise config:\n"
     "  WORLD_SIZE='four': must be a positive integer; fix: set WORLD_SIZE to 1 or more, or unset it\n"
     "  LOCAL_WORLD_SIZE='0': must be a positive integer; fix: set LOCAL_WORLD_SIZE to 1 or more, or unset it"),
])
def test_a_cluster_shape_the_environment_cannot_give_is_named(env, message):
    """No guessed shape (one node, or one process per node): the variables, their values and the fix."""
    with pytest.raises(ConfigError) as err:
        Cluster.from_env(env)
    assert str(err.value) == message


def test_unknown_axis_is_named():
    with pytest.raises(ValueError, match="unknown axis 'dp'; axes are pp, dp_replicate, dp_shard, cp, tp"):
        Layout(dp_shard=2).groups("dp")


degrees = st.tuples(*[st.sampled_from([1, 2, 3, 4])] * 4).map(lambda shape: Layout(*shape))


@settings(deadline=None)  # a loaded CI machine must not turn slowness into failures
@given(degrees)
def test_every_axis_partitions_the_ranks_and_tp_is_innermost(layout):
    world = range(layout.world_size)
    assert [layout.rank_of(layout.coords(r)) for r in world] == list(world)
    for axis in AXES:
        groups = layout.groups(axis)
        assert sorted(r for g in groups for r in g) == list(world)
        assert all(len(g) == getattr(layout, axis) for g in groups)
    assert all(g == list(range(g[0], g[0] + layout.tp)) for g in layout.groups("tp"))


def rank_helpers(config: dict) -> dict:
    """What the rank helpers and process groups say on this rank."""
    sw.init(config)
    groups = {name: dist.get_process_group_ranks(getattr(sw, f"get_{name}_process_group")())
              for name in ("world", "dp", "rdp", "tp", "pp")}
    helpers = {name: getattr(sw, name)() for name in (
        "rank", "local_rank", "size", "local_size", "dp_rank", "dp_size", "rdp_rank", "rdp_size",
        "tp_rank", "tp_size", "pp_rank", "pp_size")}
    return {"helpers": helpers, "groups": groups}


@pytest.mark.parametrize("config, expected", [
    # TP 2 inside each node of 2, ZeRO-3 over the 2 nodes: rdp pairs rank i of each node.
    ({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},
     lambda r: {"dp_rank": r, "dp_size": 4, "rdp_rank": r // 2, "rdp_size": 2, "tp_rank": r % 2, "tp_size": 2,
                "groups": {"dp": [0, 1, 2, 3], "rdp": [r % 2, r % 2 + 2], "tp": [r - r % 2, r - r % 2 + 1]}}),
    # MiCS: 2 partition groups of 2; every rank is its own data-parallel replica slice.
    ({"sharded_data_parallel_degree": 2},
     lambda r: {"dp_rank": r, "dp_size": 4, "rdp_rank": r, "rdp_size": 4, "tp_rank": 0, "tp_size": 1,
                "groups": {"dp": [0, 1, 2, 3], "rdp": [0, 1, 2, 3], "tp": [r]}}),
], ids=["tp2-zero3", "mics"])
def test_rank_helpers_and_groups_on_two_nodes_of_two(config, expected):
    results = run_distributed(rank_helpers, 4, config, nproc_per_node=2, timeout=120)
    for rank, result in enumerate(results):
        want = expected(rank)
        groups = want.pop("groups") | {"world": [0, 1, 2, 3], "pp": [rank]}
        base = {"rank": rank, "local_rank": rank % 2, "size": 4, "local_size": 2, "pp_rank": 0, "pp_size": 1}
        assert result["helpers"] == base | want
        assert result["groups"] == groups
