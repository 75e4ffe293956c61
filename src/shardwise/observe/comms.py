"""The collectives of a recorded step, seen through torch's dispatcher, and the time the host sat idle waiting.

`CollectiveWatch` is a `TorchDispatchMode`: every c10d op (what `torch.distributed`'s calls, DDP's reducer and
FSDP2 dispatch) and every functional collective passes through it, with its process group, so nothing in
torch.distributed is patched. A collective's time runs from its issue to the completion of its `Work`'s future
(polled at each op where gloo gives none), or for a functional collective to the `wait_tensor` that waits for it.
Bytes and bus bandwidth follow NCCL-tests: the size of an all-gather is its output, of a reduce-scatter its
input, of the rest their buffer; bus bandwidth is the algorithmic one times 2(n-1)/n for an all-reduce,
(n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for the rest.

The same mode sees every other op the host dispatches, so a gap between two ops while a collective is in
flight is time the host waited for it: exposed communication (`exposed_intervals`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..torch_internals import (TorchDispatchMode, all_gather_base_op, functional_collective_ops,
                               reduce_scatter_base_op, tree_leaves)

# op name (c10d's or the functional one's) -> (collective, index of the argument whose bytes count)
_COLLECTIVES = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0), "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    all_gather_base_op.__name__: ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0), "allgather_coalesced_": ("all_gather", 0),
    reduce_scatter_base_op.__name__: ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0), "reduce_": ("reduce", 0),
    "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 0),
    "gather_": ("gather", 0), "scatter_": ("scatter", 1), "send": ("send", 0), "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0), "barrier": ("barrier", None),
}
# Functional all-gathers return their output: its bytes are the input's times the group size.
_FUNCTIONAL_GATHERS = {"all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather"}


def bus_factor(collective: str, ranks: int) -> float:
    """NCCL-tests' bus-bandwidth factor for `collective` over `ranks` ranks."""
    if ranks <= 1:
        return 1.0
    if collective == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (ranks - 1) / ranks
    return 1.0


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _unboxed(arg: Any, kind: Any) -> Any:
    """`arg` as a `kind` (ProcessGroup, Work) if it is a TorchScript object of that class, else None."""
    if not isinstance(arg, torch.ScriptObject):
        return None
    try:
        return kind.unbox(arg)
    except RuntimeError:  # another class
        return None


def _group_of(args: tuple, kwargs: Mapping, groups: Mapping[str, tuple[str, int]]) -> tuple[str, int]:
    """The label and size of the process group a collective runs on: c10d ops take the group, functional
    collectives its name."""
    for arg in (*args, *kwargs.values()):
        group = _unboxed(arg, dist.ProcessGroup)
        if group is not None:
            return groups.get(group.group_name, (f"ranks {dist.get_process_group_ranks(group)}",
                                                 dist.get_world_size(group)))
        if isinstance(arg, str) and arg in groups:
            return groups[arg]
    return "unknown", 1


@dataclass
class Collective:
    """One collective: what, on which group, how many bytes, when issued and (once known) completed."""

    name: str
    group: str
    ranks: int
    nbytes: int
    issued: float
    done: Optional[float] = None


class CollectiveWatch(TorchDispatchMode):
    """Records collectives with the label and size `groups` gives their process group's name (`mesh_groups`),
    and, with `track_idle`,
    the host's gaps between ops while some collective was in flight."""

    def __init__(self, groups: Mapping[str, tuple[str, int]], track_idle: bool = False):
        super().__init__()
        self.groups = groups
        self.track_idle = track_idle
        self.collectives: list[Collective] = []
        self.idle_gaps: list[tuple[float, float]] = []
        self._in_flight: list[Collective] = []  # not known to be complete when last looked at
        self._last_op_end: Optional[float] = None
        self._polled: list[tuple[Collective, Any]] = []  # collectives whose Work has no future, and that Work
        self._awaited: dict[int, Collective] = {}  # functional collectives by the id of their result

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        start = time.perf_counter()
        if self._polled:
            self._poll(start)
        if self.track_idle:
            self._note_gap(start)
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", functional_collective_ops.name):
            self._record(func.overloadpacket.__name__, args, kwargs, out, start)
        if self.track_idle:
            self._last_op_end = time.perf_counter()
        return out

    def _note_gap(self, now: float) -> None:
        """Keep the gap since the last op if a collective issued before it had not completed when it began."""
        last = self._last_op_end
        if last is None:
            return
        self._in_flight = [c for c in self._in_flight if c.done is None or c.done > last]
        if self._in_flight:
            self.idle_gaps.append((last, now))

    def _record(self, opname: str, args: tuple, kwargs: Mapping, out: Any, issued: float) -> None:
        if opname == "wait_tensor":  # a functional collective's result is ready: it has completed
            waited = self._awaited.pop(id(args[0]), None)
            if waited is not None:
                waited.done = time.perf_counter()
            return
        if opname not in _FUNCTIONAL_GATHERS and opname not in _COLLECTIVES:
            return
        label, size = _group_of(args, kwargs, self.groups)
        if opname in _FUNCTIONAL_GATHERS:
            collective = Collective(_FUNCTIONAL_GATHERS[opname], label, size, _nbytes(args[0]) * size, issued)
        else:
            name, index = _COLLECTIVES[opname]
            collective = Collective(name, label, size, 0 if index is None else _nbytes(args[index]), issued)
        self.collectives.append(collective)
        if self.track_idle:
            self._in_flight.append(collective)
        work = _unboxed(out[-1] if isinstance(out, tuple) else out, dist.Work)
        if work is None:  # a functional collective returns its result, which `wait_tensor` waits for
            for tensor in tree_leaves(out):
                self._awaited[id(tensor)] = collective
            return
        try:
            # Runs on the backend's thread when the collective completes.
            work.get_future().then(lambda _: setattr(collective, "done", time.perf_counter()))
        except RuntimeError:  # some of gloo's works have no future: polled at every op instead
            self._polled.append((collective, work))

    def _poll(self, now: float) -> None:
        for collective, work in self._polled:
            if work.is_completed():
                collective.done = now
        self._polled = [(c, work) for c, work in self._polled if c.done is None]

    def close(self) -> None:
        """The gap from the last op to now counts too (a step may end waiting)."""
        now = time.perf_counter()
        if self._polled:
            self._poll(now)
        if self.track_idle:
            self._note_gap(now)
            self._last_op_end = None

    def exposed_intervals(self, now: float) -> list[tuple[float, float]]:
        """Where the host's idle gaps overlap collectives in flight (collectives not yet complete: until `now`)."""
        flights = merged([(c.issued, c.done if c.done is not None else now) for c in self.collectives])
        return [(max(a, b), min(c, d)) for a, c in self.idle_gaps for b, d in flights if max(a, b) < min(c, d)]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `intervals` as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def summary(collectives: list[Collective], now: float) -> list[dict[str, Any]]:
    """Per (collective, group): count, bytes, time, algorithmic and bus bandwidth (GB/s; null without time)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for c in collectives:
        row = rows.setdefault((c.name, c.group), {"collective": c.name, "group": c.group, "count": 0, "bytes": 0,
                                                  "time_s": 0.0, "_factor": bus_factor(c.name, c.ranks)})
        row["count"] += 1
        row["bytes"] += c.nbytes
        row["time_s"] += (c.done if c.done is not None else now) - c.issued
    for row in rows.values():
        factor = row.pop("_factor")
        algbw = row["bytes"] / row["time_s"] / 1e9 if row["time_s"] > 0 else None
        row["algbw_gbps"] = algbw
        row["busbw_gbps"] = None if algbw is None else algbw * factor
    return list(rows.values())


def mesh_groups(mesh: Any) -> dict[str, tuple[str, int]]:
    """Process-group name -> (the mesh axis it serves, its ranks). Where axes share one group (a one-node
    DDP's replicas are the whole dp axis) the first of tp, pp, dp, rdp, shard, replicate names it; the
    world group is `world` otherwise. ZeRO++ hpZ's secondary group is `hpz`."""
    groups = {dist.group.WORLD.group_name: ("world", dist.get_world_size())}
    if getattr(mesh, "secondary", 0):
        groups[mesh["hpz"].get_group("hpz").group_name] = ("hpz", mesh.secondary)
    for label, axis in reversed((("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("rdp", "rdp"), ("shard", "dp_shard"),
                                 ("replicate", "dp_replicate"))):
        group = mesh[axis].get_group()
        if dist.get_world_size(group) > 1:
            groups[group.group_name] = (label, dist.get_world_size(group))
    return groups
