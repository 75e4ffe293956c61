"""SMP's placement_strategy: the order in which global ranks walk data, pipeline and tensor parallelism.

The numbering is checked against the tables of SMP v1's documentation ("Ranking
Basics" and "Placement Strategy with Tensor Parallelism" in the SageMaker Python
SDK's smd_model_parallel_general.rst), against the rule that page states for any
order (the right-most letter changes fastest), and in a real 4-rank world, where
the rank helpers and the mesh's process groups must follow the same order.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch.distributed as dist

import shardwise as sw
from shardwise.config import ConfigError, parse_config
from shardwise.testing import run_distributed
from shardwise.config.layout import layout_for
from shardwise.topology import Cluster, Layout

TWO_NODES = Cluster(nodes=2, devices_per_node=4)
ORDERS = ["DPT", "DTP", "PDT", "PTD", "TPD", "TDP"]


def numbering(placement: str, tp: int = 2, pp: int = 2, cluster: Cluster = TWO_NODES) -> list[tuple[int, int, int]]:
    """(rdp_rank, pp_rank, tp_rank) of every global rank, as `layout_for` places them on `cluster`."""
    config = parse_config({"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp,
                           "placement_strategy": placement})
    layout = layout_for(config, cluster)
    coords = [layout.coords(rank) for rank in range(layout.world_size)]
    return [(c["dp_replicate"] * layout.dp_shard + c["dp_shard"], c["pp"], c["tp"]) for c in coords]


# SMP's two tables for 8 devices with tp_size() == pp_size() == rdp_size() == 2: rank -> (rdp, pp, tp).
DOCUMENTED = {
    "DPT": [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)],
    "PTD": [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1)],
}


@pytest.mark.parametrize("placement", DOCUMENTED)
def test_smps_tables_with_tensor_parallelism(placement):
    assert numbering(placement) == DOCUMENTED[placement]


def test_cluster_is_dpt_and_the_default():
    assert numbering("cluster") == numbering("DPT") == DOCUMENTED["DPT"]
    assert layout_for(parse_config({"tensor_parallel_degree": 2, "partitions": 2}), TWO_NODES).placement == "DPT"


@pytest.mark.parametrize("placement, mp_groups, dp_groups", [
    ("spread", [[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("cluster", [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
])
def test_smps_ranking_basics_without_tensor_parallelism(placement, mp_groups, dp_groups):
    """8 processes on one node, partitions=2: SMP's mp_groups and dp_groups; under spread, process 6 has dp_rank 2."""
    layout = layout_for(parse_config({"partitions": 2, "placement_strategy": placement}), Cluster(1, 8))
    assert layout.groups("pp") == mp_groups
    assert layout.groups("dp_replicate") == dp_groups
    if placement == "spread":
        assert layout.coords(6)["dp_replicate"] == 2


@pytest.mark.parametrize("placement", ORDERS)
def test_the_right_most_letter_changes_fastest(placement):
    """SMP's rule for any order: ranks count through the letters' indices as digits, the left-most the slowest."""
    sizes = {"D": 2, "P": 2, "T": 2}
    counted = [dict(zip(placement, digits)) for digits in product(*(range(sizes[letter]) for letter in placement))]
    expected = [(d["D"], d["P"], d["T"]) for d in counted]
    assert numbering(placement, cluster=Cluster(1, 8)) == expected


@pytest.mark.parametrize("placement", ORDERS)
def test_the_data_parallel_letter_holds_replicas_then_partition_groups(placement):
    """D spans ZeRO partition groups (inner) inside replicas (outer); the mesh's nested ranks agree with coords."""
    layout = Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2, placement=placement)
    strides = layout.strides()
    assert strides["dp_replicate"] == 2 * strides["dp_shard"]
    mesh = layout.mesh_ranks()
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert layout.rank_of(c) == rank
        assert mesh[c["pp"]][c["dp_replicate"]][c["dp_shard"]][c["cp"]][c["tp"]] == rank


@pytest.mark.parametrize("placement, allowed", [
    ("cluster", True), ("DPT", True), ("PDT", True), ("DTP", True), ("PTD", True),  # TP groups stay in a node
    ("spread", False), ("TPD", False), ("TDP", False),  # T outermost: tp rank 1 is 4 ranks away, on node 1
])
def test_tensor_parallel_groups_stay_inside_a_node(placement, allowed):
    config = parse_config({"tensor_parallel_degree": 2, "partitions": 2, "placement_strategy": placement})
    if allowed:
        assert not layout_for(config, TWO_NODES).crosses_nodes(TWO_NODES, "tp")
        return
    with pytest.raises(ConfigError) as info:
        layout_for(config, TWO_NODES)
    assert str(info.value) == (
        f"invalid shardwise config: placement_strategy='{placement}': puts tensor-parallel group [0, 4] on "
        "different nodes of 4 devices, and TP stays inside a node; fix: use a placement with T last, such as "
        "'cluster' (DPT)")


def test_spread_without_tensor_parallelism_spans_nodes_freely():
    layout = layout_for(parse_config({"partitions": 2, "placement_strategy": "spread"}), TWO_NODES)
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def rank_numbers(config: dict) -> dict:
    """SMP's rank numbers on this rank and the ranks of each process group of the mesh."""
    sw.init(config)
    groups = {name: dist.get_process_group_ranks(getattr(sw, f"get_{name}_process_group")())
              for name in ("tp", "pp", "rdp")}
    return {"tp": sw.tp_rank(), "pp": sw.pp_rank(), "rdp": sw.rdp_rank(), "groups": groups}


SPREAD = {  # 4 ranks on one node under spread (TPD): rank = (tp_rank · pp + pp_rank) · rdp + rdp_rank
    "tp2-pp2": {"tensor_parallel_degree": 2, "partitions": 2},
    "tp2-rdp2": {"tensor_parallel_degree": 2},
    "pp2-rdp2": {"partitions": 2, "microbatches": 2},
}


@pytest.mark.parametrize("name", SPREAD)
def test_a_real_world_numbers_ranks_as_spread_places_them(name):
    config = {**SPREAD[name], "placement_strategy": "spread"}
    tp, pp = config.get("tensor_parallel_degree", 1), config.get("partitions", 1)
    rdp = 4 // (tp * pp)
    place = {(t * pp + p) * rdp + d: (t, p, d) for t in range(tp) for p in range(pp) for d in range(rdp)}
    for rank, got in enumerate(run_distributed(rank_numbers, 4, config, nproc_per_node=4, timeout=300)):
        t, p, d = place[rank]
        assert (got["tp"], got["pp"], got["rdp"]) == (t, p, d), rank
        assert got["groups"] == {
            "tp": sorted(r for r, (_, p2, d2) in place.items() if (p2, d2) == (p, d)),
            "pp": sorted(r for r, (t2, _, d2) in place.items() if (t2, d2) == (t, d)),
            "rdp": sorted(r for r, (t2, p2, _) in place.items() if (t2, p2) == (t, p)),
        }, rank
