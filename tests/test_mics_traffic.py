"""MiCS keeps ZeRO's traffic inside partition groups: only gradient all-reduces cross them.

Two simulated nodes of two ranks; with `sharded_data_parallel_degree=2` each
node is one partition group. Every collective issued during two training steps
(two microbatches each) is recorded with the ranks of its process group, by a
dispatch mode that sees the c10d ops FSDP2 calls (`CommDebugMode` counts ops
but not their groups). Flat ZeRO-3 over the same world is the contrast that
shows the recorder sees cross-node traffic when there is some.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from shardwise.torch_internals import TorchDispatchMode

import shardwise as sw
from shardwise.testing import run_distributed
from shardwise.config.layout import layout_for
from shardwise.topology import Cluster
from tiny_models import train_watched

WORLD, PER_NODE = 4, 2
STEPS, MICROBATCHES, ROWS = 2, 2, 2
NODES = [(0, 1), (2, 3)]


class CollectiveRecorder(TorchDispatchMode):
    """Counts c10d collectives by (op name, ranks of the process group they ran on)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[tuple[str, tuple[int, ...]]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            groups = [a for a in (*args, *(kwargs or {}).values())
                      if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())]
            ranks = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(groups[0]))) if groups else ()
            self.counts[func._opname.strip("_"), ranks] += 1
        return func(*args, **(kwargs or {}))


def record_training(config: dict) -> Counter:
    """Two steps of the seed's loop under `config`; this rank's collectives by (op, group ranks)."""
    recorder = CollectiveRecorder()
    train_watched("gpt2", {**config, "microbatches": MICROBATCHES}, STEPS, ROWS, lambda model: recorder)
    return recorder.counts


def _node_of(rank: int) -> tuple[int, ...]:
    return next(node for node in NODES if rank in node)


@pytest.fixture(scope="module")
def mics() -> list[Counter]:
    return run_distributed(record_training, WORLD, {"sharded_data_parallel_degree": PER_NODE},
                           nproc_per_node=PER_NODE, timeout=180)


def test_layout_puts_each_partition_group_on_one_node():
    """Partition groups (dp_shard) are the nodes; replicas (dp_replicate) pair rank i of each node."""
    config = sw.ShardwiseConfig(sharded_data_parallel_degree=PER_NODE)
    layout = layout_for(config, Cluster(nodes=2, devices_per_node=PER_NODE))
    assert layout.groups("dp_shard") == [list(node) for node in NODES]
    assert layout.groups("dp_replicate") == [[0, 2], [1, 3]]


def test_gathers_and_reduce_scatters_stay_inside_the_partition_group(mics):
    for rank, counts in enumerate(mics):
        by_op = {op for op, _ in counts}
        assert {"allgather_base", "reduce_scatter_base"} <= by_op, counts
        for (op, ranks), n in counts.items():
            if op != "allreduce":
                assert ranks == _node_of(rank), f"rank {rank}: {n}× {op} over ranks {ranks} leaves its group"


def test_only_gradient_all_reduces_cross_groups_once_per_step(mics):
    """Cross-group traffic is all-reduce over the replica pair, after the last microbatch only:
    one per sharding unit per step, while reduce-scatters run every microbatch."""
    for rank, counts in enumerate(mics):
        crossing = {(op, ranks): n for (op, ranks), n in counts.items() if set(ranks) - set(_node_of(rank))}
        replicas = (rank % PER_NODE, rank % PER_NODE + PER_NODE)
        assert crossing and set(crossing) == {("allreduce", replicas)}, crossing
        reduce_scatters = counts["reduce_scatter_base", _node_of(rank)]
        assert reduce_scatters == MICROBATCHES * crossing["allreduce", replicas]


def test_flat_zero3_on_the_same_world_gathers_across_nodes():
    """The contrast: partition group = whole world, so every gather spans both nodes."""
    ranks = run_distributed(record_training, WORLD, {"sharded_data_parallel_degree": WORLD},
                            nproc_per_node=PER_NODE, timeout=180)
    for counts in ranks:
        gathers = {group for op, group in counts if op == "allgather_base"}
        assert gathers == {tuple(range(WORLD))}
