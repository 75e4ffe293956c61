"""Where to cut a model that has no list of repeated blocks: module boundaries balanced by compute and memory.

The model runs once on the meta device (no memory, no arithmetic) with the first
microbatch's inputs as fake tensors (which models treat as while torch traces them), which gives the order its modules are called in, each
module's FLOPs (torch's `FlopCounterMode`), its parameters, the bytes autograd saves
for its backward and the bytes it returns (what the planner charges a stage for). The cut is made at
"units": the root's called children, a unit split further into its own called
children while it costs more than a fraction of a stage. Each unit costs
`(1 - memory_weight) · its share of the FLOPs + memory_weight · its share of the
parameters` (SMP's `memory_weight`: 0 balances compute only, 1 memory only), and
the stages are the contiguous runs of units that minimise the costliest stage.
Units placed by hand (`partition`, `set_partition`) keep their partition, a pp
rank: each runs in the first stage on that rank from the previous placed unit's
on, so with several stages per rank a forward that comes back to a partition runs
there as a later (virtual) stage.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ...torch_internals import FakeTensorMode, storage_id, tree_flatten, tree_map, view_base
from ..stage_split import min_max_split
from .placement import placed_on
from ..stand_in import meta_copy

TENSOR = object()  # marks where a tensor goes back into the model's output structure
_FINER = 4  # a unit is split further while it costs more than 1 / (_FINER · stages) of the model


@dataclasses.dataclass
class Call:
    """A module the forward called: its path, first-call position, and with its children's: FLOPs, parameters
    (and their tensors' sizes), bytes autograd saves for backward; the bytes of the tensors its first call
    returns."""

    path: str
    order: int
    flops: int = 0
    params: int = 0
    tensors: tuple[int, ...] = ()
    saved_bytes: int = 0
    output_bytes: int = 0
    children: list["Call"] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class GraphCut:
    """The modules each stage after the first starts at, and what the model returns (for rebuilding it)."""

    split_points: tuple[str, ...]
    units: tuple[str, ...]
    stage_of_unit: tuple[int, ...]
    costs: tuple[float, ...]
    output_spec: Any
    output_leaves: tuple[Any, ...]  # TENSOR where a tensor goes, else the value itself

    def describe(self, stage_ranks: list[int]) -> str:
        lines = [f"pipeline partition of the module graph ({len(self.units)} units) into "
                 f"{max(self.stage_of_unit) + 1} stages, balanced by compute and memory:"]
        for stage in range(max(self.stage_of_unit) + 1):
            units = [u for u, s in zip(self.units, self.stage_of_unit) if s == stage]
            cost = sum(c for c, s in zip(self.costs, self.stage_of_unit) if s == stage)
            span = units[0] if len(units) == 1 else f"{units[0]} … {units[-1]} ({len(units)} units)"
            lines.append(f"  stage {stage} (pp rank {stage_ranks[stage]}): {span} — {cost:.1%} of the cost")
        return "\n".join(lines)


def captured(model: nn.Module, what: str, capture_it: Callable[[], Any]) -> Any:
    """`capture_it()`; a forward torch cannot capture (on fake tensors or by export) is one line naming why."""
    try:
        return capture_it()
    except Exception as error:  # torch's errors here are long; the first line names the operation
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise RuntimeError(f"pipeline parallelism could not {what} {type(model).__name__}'s forward "
                           f"({type(error).__name__}: {reason}); fix: make the forward capturable (no Python "
                           "control flow on tensor values, no .item()), or hold its layers in an nn.ModuleList and "
                           "set pipeline_cut: blocks") from None


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def trace_calls(model: nn.Module, inputs: dict[str, Any]) -> tuple[Call, Any]:
    """The call tree of one forward on the meta device (see module docstring), and the model's output."""
    meta = meta_copy(model)
    calls: dict[str, Call] = {}
    stack: list[Call] = []
    paths = {module: path for path, module in meta.named_modules()}
    own_saved: dict[str, int] = collections.Counter()  # bytes saved while the module itself, not a child, ran
    seen: set[int] = set()  # storages already counted: a tensor saved twice (or a view of one) is kept once

    def enter(module: nn.Module, args: Any) -> None:
        path = paths[module]
        if path not in calls:
            calls[path] = Call(path, len(calls))
            if stack:
                stack[-1].children.append(calls[path])
        stack.append(calls[path])

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        call = stack.pop()
        call.output_bytes = call.output_bytes or _tensor_bytes(output)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage, base = storage_id(tensor), view_base(tensor)
        weight = base.is_leaf and base.requires_grad  # a parameter (or a view of one): a state, not an activation
        if storage not in seen and stack and not weight:
            seen.add(storage)
            own_saved[stack[-1].path] += tensor.numel() * tensor.element_size()
        return tensor

    handles = [m.register_forward_pre_hook(enter) for m in paths] + [m.register_forward_hook(leave) for m in paths]
    try:
        # Fake tensors as well as meta ones: models skip data-dependent checks on them as while torch traces.
        with FakeTensorMode(allow_non_fake_inputs=True) as fake, FlopCounterMode(display=False) as counter, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = meta(**tree_map(lambda t: fake.from_tensor(t.to("meta")) if isinstance(t, torch.Tensor) else t,
                                     inputs))
    finally:
        for handle in handles:
            handle.remove()
    root_name = type(meta).__name__
    for path, call in calls.items():
        key = f"{root_name}.{path}" if path else root_name
        call.flops = sum(counter.get_flop_counts().get(key, {}).values())
        module = meta.get_submodule(path)
        call.tensors = tuple(p.numel() for p in module.parameters())
        call.params = sum(call.tensors)
    _add_children_saved(calls[""], own_saved)
    return calls[""], output


def _add_children_saved(call: Call, own_saved: dict[str, int]) -> int:
    call.saved_bytes = own_saved[call.path] + sum(_add_children_saved(child, own_saved) for child in call.children)
    return call.saved_bytes



def cut_units(root: Call, stages: int) -> list[Call]:
    """The root's called children, each split into its own while it costs too much to be placed whole."""
    total_flops, total_params = max(root.flops, 1), max(root.params, 1)
    units = list(root.children) or [root]
    while True:
        big = [u for u in units if u.children and max(u.flops / total_flops, u.params / total_params)
               > 1 / (_FINER * stages)]
        if not big:
            return sorted(units, key=lambda u: u.order)
        unit = big[0]
        at = units.index(unit)
        units[at:at + 1] = unit.children


def _placements(model: nn.Module, units: list[Call], auto_partition: bool,
                default_partition: int) -> Optional[list[Optional[int]]]:
    """Each unit's partition when any module is placed by hand (its own or its nearest placed ancestor's)."""
    found = []
    for unit in units:
        parts = unit.path.split(".")
        owners = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts), -1, -1)]
        found.append(next((placed_on(m) for m in owners if placed_on(m) is not None), None))
    if all(p is None for p in found) and auto_partition:
        return None
    return [p if p is not None else (None if auto_partition else default_partition) for p in found]


def cut_graph(model: nn.Module, inputs: dict[str, Any], stages: int, memory_weight: float,
              auto_partition: bool = True, default_partition: int = 0,
              stage_ranks: Optional[list[int]] = None) -> GraphCut:
    """Where to cut `model` into `stages` (see module docstring); `inputs` is one microbatch, by name;
    `stage_ranks`: the pp rank (partition) of each stage, by default stage s on rank s."""
    root, output = captured(model, "trace", lambda: trace_calls(model, inputs))
    units = cut_units(root, stages)
    if len(units) < stages:
        raise ValueError(f"pipeline parallelism cuts {type(model).__name__} at module boundaries, but its forward "
                         f"calls only {len(units)} modules that can start a stage, fewer than the {stages} stages; "
                         "use a smaller pipeline_parallel_degree (or fewer virtual_stages)")
    partitions = _placements(model, units, auto_partition, default_partition)
    fixed = None if partitions is None else _placed_stages(units, partitions, stage_ranks or list(range(stages)))
    costs, stage_of = split_units(units, stages, memory_weight, fixed)
    starts = [i for i in range(1, len(units)) if stage_of[i] != stage_of[i - 1]]
    leaves, spec = tree_flatten(output)
    return GraphCut(tuple(units[i].path for i in starts), tuple(u.path for u in units), tuple(stage_of),
                    tuple(costs), spec, tuple(TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves))


def split_units(units: list[Call], stages: int, memory_weight: float,
                fixed: Optional[list[Optional[int]]] = None) -> tuple[list[float], list[int]]:
    """Each unit's cost and stage: contiguous runs minimising the costliest stage, `fixed` units kept on theirs."""
    flops, params = max(sum(u.flops for u in units), 1), max(sum(u.params for u in units), 1)
    costs = [(1 - memory_weight) * u.flops / flops + memory_weight * u.params / params for u in units]
    sizes = min_max_split(costs, stages, 0, 0, fixed or [None] * len(units))
    return costs, [s for s, size in enumerate(sizes) for _ in range(size)]


def _placed_stages(units: list[Call], partitions: list[Optional[int]], ranks: list[int]) -> list[Optional[int]]:
    """Each placed unit's stage (None: unplaced): the first stage on its partition from the previous placed
    unit's stage on. Refuses, naming the modules, a placement no contiguous cut on `ranks` can honour."""
    pp, order = max(ranks) + 1, f"stages run on partitions {', '.join(map(str, ranks))} in turn"
    placed: list[tuple[int, int]] = []  # (unit index, stage)
    for index, (unit, p) in enumerate(zip(units, partitions)):
        if p is None:
            continue
        if p >= pp:
            raise ValueError(f"pipeline placement: {unit.path} is placed on partition {p}, but "
                             f"pipeline_parallel_degree is {pp}; fix: use partitions 0 to {pp - 1}")
        start = placed[-1][1] if placed else 0
        stage = next((s for s in range(start, len(ranks)) if ranks[s] == p), None)
        if stage is None:
            before = units[placed[-1][0]].path
            raise ValueError(f"pipeline placement: {unit.path} on partition {p} runs after {before} on partition "
                             f"{ranks[start]}, and no later stage runs on partition {p} (the module graph is cut "
                             f"into contiguous runs in execution order; {order}); fix: place modules on partitions "
                             "in that order as the forward calls them")
        placed.append((index, stage))
    bounds = [(-1, -1)] + placed + [(len(units), len(ranks))]
    for (i, s), (j, t) in zip(bounds, bounds[1:]):
        if t - s > j - i:  # the units between must give every stage between one unit at least
            where = " and ".join(f"{side} {units[k].path}" for side, k in (("after", i), ("before", j))
                                 if 0 <= k < len(units))
            raise ValueError(f"pipeline placement leaves stage {s + 1} (partition {ranks[s + 1]}) without a module "
                             f"({where}; {order}); fix: place at least one module on every stage's partition, in "
                             "that order")
    stage_of = dict(placed)
    return [stage_of.get(index) for index in range(len(units))]
