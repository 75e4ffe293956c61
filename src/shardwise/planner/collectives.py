"""Time of one collective on the links it crosses, as NCCL runs it.

Costs are per rank, in the alpha-beta model: each of a ring's steps pays the link
latency, and each byte pays the link's bandwidth times the cluster's `link_efficiency`.
Inside a node every collective is a ring. Across nodes:
- an all-gather or reduce-scatter (and the broadcasts and reduces that move what they
  would) is one flat ring through every rank of the group, its edges on NVLink inside a
  node and on the network between nodes (NCCL's rings are flat and span both, NVIDIA/nccl#530;
  its tree is for all-reduce only, #1473): each edge carries (n - 1)/n of the buffer, the
  edges leaving a node share its NICs, and a call pays a step's latency per rank of the
  ring, the network's at the node crossings (NCCL's own ring model, src/graph/tuning.cc);
- an all-reduce runs hierarchically, as NCCL's tree reduces inside a node, all-reduces
  between nodes and broadcasts back: the intra-node part moves the whole buffer over the
  node's links, the inter-node part 1/r of it per rank, all ranks of a node sharing its
  NICs, paying the latency of a ring or of the tree between nodes, whichever is less.
On a cluster of `flat_rings` (gloo) every collective is one ring over the group's
ranks, node by node, paced by its edge between nodes, which carries 1/n of the
buffer per step and shares the node's link with the other groups' edges; gloo
reduce-scatters by all-reducing the whole buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import product

from ..topology import Layout
from .hardware import ClusterSpec

# Steps (and volume multiples) of a ring: all-reduce = reduce-scatter + all-gather. Broadcasts of
# every rank's own tensors move, per rank, what an all-gather of them would; reduces to every rank
# of its own share, what a reduce-scatter would.
_PASSES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1, "reduce": 1}
_GLOO_PASSES = {**_PASSES, "reduce_scatter": 2}

@dataclass(frozen=True)
class GroupShape:
    size: int
    per_node: int   # ranks of one group on one node
    nodes: int      # nodes one group spans

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


@lru_cache(maxsize=4096)
def group_shape(layout: Layout, devices_per_node: int, axes: tuple[str, ...], within: int = 0) -> GroupShape:
    """Shape of the groups along `axes` (all groups of a layout have the same shape), ranks placed as the
    layout's placement order places them; with `within`, of the groups of that many neighbours in the group the
    axes make together, the last fastest (ZeRO++ hpZ's secondary groups inside a sharding group, its cp ranks
    included under context parallelism)."""
    strides = layout.strides()
    ranks = [sum(i * strides[a] for a, i in zip(axes, idx))
             for idx in product(*(range(getattr(layout, a)) for a in axes))]
    if within:
        ranks = ranks[:within]
    nodes = len({r // devices_per_node for r in ranks})
    return GroupShape(len(ranks), len(ranks) // nodes, nodes)


@dataclass(frozen=True)
class LinkTime:
    """Seconds a transfer occupies the intra-node and the inter-node links."""

    intra: float = 0.0
    inter: float = 0.0

    def __add__(self, other: "LinkTime") -> "LinkTime":
        return LinkTime(self.intra + other.intra, self.inter + other.inter)

    def __sub__(self, other: "LinkTime") -> "LinkTime":
        return LinkTime(self.intra - other.intra, self.inter - other.inter)

    @property
    def busiest(self) -> float:
        """Duration when many such transfers stream back to back: the two link levels work in parallel."""
        return max(self.intra, self.inter)

    @property
    def serial(self) -> float:
        """Duration of one transfer alone: its intra- and inter-node phases run one after the other."""
        return self.intra + self.inter

    @property
    def link(self) -> str:
        return "+".join(name for name, t in (("intra", self.intra), ("inter", self.inter)) if t) or "-"


def collective_time(kind: str, nbytes: float, shape: GroupShape, cluster: ClusterSpec, calls: int = 1) -> LinkTime:
    """Per-rank time to all-reduce / all-gather / reduce-scatter / broadcast `nbytes` (the full, unsharded
    buffer) in `calls` collectives of equal size: bandwidth is paid once, latency per call."""
    if shape.size == 1 or nbytes == 0:
        return LinkTime()
    if cluster.flat_rings:
        return _flat_ring_time(kind, nbytes, shape, cluster, calls)
    passes = _PASSES[kind]
    r, k = shape.per_node, shape.nodes
    intra_bw = cluster.intra_node_bandwidth * cluster.link_efficiency
    intra = passes * ((r - 1) / r * nbytes / intra_bw + calls * (r - 1) * cluster.intra_node_latency) if r > 1 else 0.0
    if k == 1:
        return LinkTime(intra=intra)
    per_rank_bw = cluster.inter_node_bandwidth * cluster.link_efficiency / cluster.devices_per_node
    if kind != "all_reduce":
        return _spanning_ring_time(passes, nbytes, shape, cluster, calls, intra_bw, per_rank_bw)
    latency = calls * _inter_node_steps(kind, k) * cluster.inter_node_latency
    inter = passes * (k - 1) / k * nbytes / r / per_rank_bw + latency
    return LinkTime(intra=intra, inter=inter)


def _spanning_ring_time(passes: int, nbytes: float, shape: GroupShape, cluster: ClusterSpec, calls: int,
                        intra_bw: float, per_rank_bw: float) -> LinkTime:
    """NCCL's flat ring over a group spanning nodes: every edge carries (n - 1)/n of the buffer per pass, the
    r edges leaving a node on its NICs; the first chunk crosses the ring's n - k edges inside nodes and k - 1
    between them (the ring's latency as NCCL's tuning.cc counts it), paid on the network side."""
    n, r, k = shape.size, shape.per_node, shape.nodes
    moved = passes * (n - 1) / n * nbytes
    latency = calls * passes * ((n - k) * cluster.intra_node_latency + (k - 1) * cluster.inter_node_latency)
    return LinkTime(intra=moved / intra_bw if r > 1 else 0.0, inter=moved / r / per_rank_bw + latency)


def _inter_node_steps(kind: str, nodes: int) -> float:
    """Latencies an all-reduce pays between `nodes` nodes: a ring's 2 × (nodes - 1) steps, or NCCL's double
    binary tree, up and down its depth (2 log2 nodes), whichever is fewer: NCCL picks the tree where its latency
    wins, at many nodes and small buffers; it moves the bytes at the same rate."""
    return min(_PASSES[kind] * (nodes - 1), 2 * math.log2(nodes))


def _flat_ring_time(kind: str, nbytes: float, shape: GroupShape, cluster: ClusterSpec, calls: int) -> LinkTime:
    """gloo's ring over the group's n ranks: passes × (n - 1) steps of 1/n of the buffer, at the pace of the
    slowest edge, which between nodes shares the node's link with the edges of the node's other groups."""
    steps, n = _GLOO_PASSES[kind] * (shape.size - 1), shape.size
    if not shape.crosses_nodes:
        bandwidth = cluster.intra_node_bandwidth * cluster.link_efficiency
        return LinkTime(intra=steps * (nbytes / n / bandwidth + calls * cluster.intra_node_latency))
    sharing = cluster.devices_per_node / shape.per_node
    bandwidth = cluster.inter_node_bandwidth * cluster.link_efficiency / sharing
    return LinkTime(inter=steps * (nbytes / n / bandwidth + calls * cluster.inter_node_latency))


def p2p_time(nbytes: float, crosses_nodes: bool, cluster: ClusterSpec) -> LinkTime:
    """One pipeline send between neighbouring stages."""
    if crosses_nodes:
        bw = cluster.inter_node_bandwidth * cluster.link_efficiency / cluster.devices_per_node
        return LinkTime(inter=nbytes / bw + cluster.inter_node_latency)
    bandwidth = cluster.intra_node_bandwidth * cluster.link_efficiency
    return LinkTime(intra=nbytes / bandwidth + cluster.intra_node_latency)
