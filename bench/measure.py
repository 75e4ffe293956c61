"""How every configuration is measured on a rank: step times, peak memory by category, collectives.

The same three probes run on every configuration, so the numbers compare:
barrier-aligned wall-clock per step, torch's MemTracker peak snapshot (bytes
per category) over one step, and a dispatch mode that counts the c10d
collectives of one step with the bytes of each full (unsharded) buffer.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from shardwise.torch_internals import TorchDispatchMode

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


def step_times(step: Callable[[], None], steps: int) -> list[float]:
    """Seconds per step, each ending when every rank is done with it."""
    times = []
    dist.barrier()
    for _ in range(steps):
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def peak_memory(step: Callable[[], None], *tracked) -> dict[str, int]:
    """Bytes per MemTracker category at the peak of one step (`tracked`: the model and optimizer)."""
    tracker = MemTracker()
    tracker.track_external(*tracked)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    return {getattr(k, "name", k): v for k, v in snapshot.items() if v}


def _readable(op: str) -> str:
    """`_allgather_base_.default` → `all-gather`."""
    name = op.split(".")[0].strip("_").removesuffix("_base")
    return name.replace("allreduce", "all-reduce").replace("allgather", "all-gather").replace("_", "-")


def _is_process_group(value) -> bool:
    """c10d ops receive their group boxed as a TorchScript object."""
    return isinstance(value, torch.ScriptObject) and value._type().name() == "ProcessGroup"


def group_size(group: dist.ProcessGroup) -> str:
    return str(group.size())


def group_ranks(group: dist.ProcessGroup) -> str:
    """`0,2`: the global ranks of the group, in its own rank order."""
    return ",".join(map(str, dist.get_process_group_ranks(group)))


class _Collectives(TorchDispatchMode):
    """Calls and bytes per (collective, group as `describe` names it: its size by default); bytes of the
    largest tensor argument, i.e. the full buffer (an all-gather's output, a reduce-scatter's input)."""

    def __init__(self, describe: Callable[[dist.ProcessGroup], str] = group_size):
        super().__init__()
        self.describe = describe
        self.counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor turn the op into local ops (and collectives), then see those
        if func.namespace in _COLLECTIVE_NAMESPACES and not func.__name__.startswith("wait"):
            leaves = pytree.tree_leaves((args, kwargs))
            nbytes = max((t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)), default=0)
            groups = [self.describe(dist.ProcessGroup.unbox(leaf)) for leaf in leaves if _is_process_group(leaf)]
            entry = self.counts[f"{_readable(func.__name__)}/{groups[0] if groups else '?'}"]
            entry[0] += 1
            entry[1] += nbytes
        return func(*args, **(kwargs or {}))


def collectives(step: Callable[[], None],
                describe: Callable[[dist.ProcessGroup], str] = group_size) -> dict[str, list[int]]:
    """{"all-reduce/4": [calls, bytes], ...} for one step (`describe=group_ranks`: "all-reduce/0,2")."""
    counter = _Collectives(describe)
    with counter:
        step()
    return dict(counter.counts)


def measure_all(factories: dict[str, Callable], model: str, batch_size: int, steps: int,
                rounds: int = 1) -> dict[str, dict]:
    """On every rank, `rounds` times: build each configuration in turn (`factory(model, batch_size)` →
    Setup), run one step (lazy initialisation, optimizer states), measure the peak memory of the
    second (DDP allocates its rebuilt gradient buckets there, so they are seen) and the collectives
    of the third (every round, keeping the first round's), then time `steps` more. Rounds spread each
    configuration's steps over the run, so load from other processes on the machine does not fall on one
    configuration only."""
    results: dict[str, dict] = {name: {"times": []} for name in factories}
    for _ in range(rounds):
        for name, factory in factories.items():
            setup = factory(model, batch_size)
            try:
                setup.step()
                results[name].setdefault("memory", peak_memory(setup.step, *setup.tracked))
                results[name].setdefault("collectives", collectives(setup.step))
                results[name]["times"] += step_times(setup.step, steps)
            finally:
                setup.close()
    return results
