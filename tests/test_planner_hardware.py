"""Cluster specs: preset names, node counts, overrides, custom clusters, default precision."""

import pytest

from shardwise.planner import PlanError, assumptions, cluster_preset, custom_cluster
from shardwise.planner.collectives import GroupShape, collective_time
from shardwise.planner.hardware import GiB


@pytest.mark.parametrize("text,nodes,devices,device", [
    ("16xp4d.24xlarge", 16, 8, "A100-SXM4-40GB"),
    ("ml.p4de.24xlarge", 1, 8, "A100-SXM4-80GB"),
    ("2 x p5.48xlarge", 2, 8, "H100-SXM5-80GB"),
    ("8×g4dn.12xlarge", 8, 4, "T4-16GB"),
    ("dgx-h100", 1, 8, "H100-SXM5-80GB"),
])
def test_presets_parse(text, nodes, devices, device):
    cluster = cluster_preset(text)
    assert (cluster.nodes, cluster.devices_per_node, cluster.device.name) == (nodes, devices, device)


def test_overrides_replace_preset_values():
    cluster = cluster_preset("4xp4d.24xlarge", nodes=2, device_memory_bytes=30 * GiB, peak_flops=100e12,
                             inter_node_bandwidth=None)
    assert cluster.world_size == 16 and cluster.device.memory_bytes == 30 * GiB
    assert set(cluster.device.peak_flops.values()) == {100e12}
    assert cluster.inter_node_bandwidth == cluster_preset("p4d.24xlarge").inter_node_bandwidth
    assert cluster_preset("local", devices_per_node=3).world_size == 3


def test_default_precision_is_the_devices_fastest():
    assert [cluster_preset(p).default_precision() for p in ("p4d.24xlarge", "g4dn.12xlarge", "local")] == \
        ["bf16", "fp16", "fp32"]


def test_custom_cluster():
    cluster = custom_cluster(nodes=2, devices_per_node=4, device_memory_bytes=24 * GiB, peak_flops=100e12,
                             intra_node_bandwidth=50e9, inter_node_bandwidth=25e9)
    assert cluster.world_size == 8 and cluster.topology.devices_per_node == 4


def test_link_efficiency_is_the_clusters_and_scales_what_bytes_cost():
    assert cluster_preset("p4d.24xlarge").link_efficiency == assumptions.LINK_EFFICIENCY
    assert cluster_preset("local").link_efficiency == assumptions.TCP_LINK_EFFICIENCY
    nccl, half = cluster_preset("2xp4d.24xlarge"), cluster_preset("2xp4d.24xlarge", link_efficiency=0.4)
    shape = GroupShape(size=16, per_node=8, nodes=2)
    full, slow = (collective_time("all_reduce", 2 ** 30, shape, c) for c in (nccl, half))
    assert slow.inter > 1.9 * full.inter and slow.intra > 1.9 * full.intra     # latency aside, twice the time


@pytest.mark.parametrize("text,message", [
    ("16xp4d.24xlarg", r"unknown cluster preset 'p4d.24xlarg' \(did you mean 'p4d.24xlarge'\?\); write"),
    ("0xp4d.24xlarge", r"the node count must be 1 or more"),
    ("16 nodes of p4d", r"unknown cluster preset '16 nodes of p4d'"),
])
def test_bad_cluster_names(text, message):
    with pytest.raises(PlanError, match=message):
        cluster_preset(text)
