"""Where the pipeline cuts a model: its sequence of repeated blocks and a balanced split of it.

A model is cut along its one list of repeated blocks: the `ModuleList` of the
blocks a Hugging Face model names in `_no_split_modules`, else the largest list
of same-type modules (an `nn.ModuleList`, or an `nn.Sequential` the forward calls). Modules with parameters registered before that list
(embeddings) belong to the first stage, those registered after it (final norm,
head) to the last; modules without parameters (rotary tables, dropout) run on
every stage. Blocks placed by hand (placement.py) stay where they were placed.
Pure: works on a model built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import nn

from ...errors import ConfigError, Problem
from ..stage_split import min_max_split
from .blocks import Blocks
from .placement import block_placements

PP_KEY = "pipeline_parallel_degree"
SPLIT_KEY = "pipeline_split_points"


@dataclass(frozen=True)
class Partition:
    """Blocks [start, stop) of every stage, in stage order."""

    blocks: Blocks
    bounds: tuple[tuple[int, int], ...]
    costs: tuple[int, ...]
    how: str  # what chose the cuts, e.g. "balanced by parameters", "at the configured split points", "placed by hand"
    unit: str  # of `costs`

    @property
    def stages(self) -> int:
        return len(self.bounds)

    def describe(self, stage_ranks: Sequence[int]) -> str:
        """One line per stage, e.g. 'stage 0 (pp rank 0): transformer.wte, transformer.h.0-1 — 1.2M params'."""
        lines = [f"pipeline partition of {self.blocks.path} ({self.blocks.count} blocks) into {self.stages} stages, "
                 f"{self.how}:"]
        for stage, ((start, stop), cost) in enumerate(zip(self.bounds, self.costs)):
            parts = list(self.blocks.before) if stage == 0 else []
            parts.append(f"{self.blocks.path}.{start}" + (f"-{stop - 1}" if stop - start > 1 else ""))
            parts += list(self.blocks.after) if stage == self.stages - 1 else []
            lines.append(f"  stage {stage} (pp rank {stage_ranks[stage]}): {', '.join(parts)} — "
                         f"{cost / 1e6:.3g}M {self.unit}")
        return "\n".join(lines)


def _block_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Lists of same-type blocks: an `nn.ModuleList` the forward walks, or an `nn.Sequential` of two or more
    that it calls (which runs its blocks in turn, passing one value)."""
    lists = [(name, m) for name, m in model.named_modules()
             if (isinstance(m, nn.ModuleList) and len(m) or isinstance(m, nn.Sequential) and len(m) > 1)
             and len({type(c) for c in m}) == 1]
    hf_names = set(getattr(model, "_no_split_modules", None) or [])
    preferred = [(name, m) for name, m in lists if type(m[0]).__name__ in hf_names]
    return preferred or lists


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def has_block_list(model: nn.Module) -> bool:
    """The model has a list of repeated blocks to cut along (else its module graph is cut, graph.py)."""
    return bool(_block_lists(model))


def find_blocks(model: nn.Module) -> Blocks:
    """The block list to cut along, and which stage holds every other module with parameters."""
    lists = _block_lists(model)
    if not lists:
        raise ValueError(f"pipeline parallelism needs a sequence of repeated blocks (an nn.ModuleList of same-type "
                         f"modules, or an nn.Sequential of two or more), and {type(model).__name__} has none")
    path, blocks = max(lists, key=lambda item: _count(item[1]))
    before: list[list[str]] = []  # per depth, outermost first
    after: list[list[str]] = []
    parts = path.split(".")
    for depth in range(len(parts)):
        prefix = ".".join(parts[:depth])
        owner = model.get_submodule(prefix)
        if any(True for _ in owner.parameters(recurse=False)):
            raise ValueError(f"pipeline parallelism cannot place the parameters that sit directly on "
                             f"{prefix or 'the model root'} ({type(owner).__name__}), which encloses the blocks "
                             f"{path}; move them into a submodule")
        names = [name for name, _ in owner.named_children()]
        cut = names.index(parts[depth])
        held = [f"{prefix}.{name}" if prefix else name for name in names if _count(getattr(owner, name))]
        before.append([p for p in held if names.index(p.rpartition(".")[2]) < cut])
        after.append([p for p in held if names.index(p.rpartition(".")[2]) > cut])
    # The forward runs inner modules after the blocks before outer ones (a final norm, then the head).
    return Blocks(path, len(blocks), tuple(p for level in before for p in level),
                  tuple(p for level in reversed(after) for p in level))


def module_cost(module: nn.Module, balance: str) -> int:
    """Parameters, or for "compute" the parameters used in matmuls (embedding lookups cost ~nothing)."""
    if balance == "parameters":
        return _count(module)
    return sum(p.numel() for m in module.modules() if not isinstance(m, nn.Embedding)
               for p in m.parameters(recurse=False))


def partition(model: nn.Module, stages: int, balance: str = "parameters",
              split_points: Optional[Sequence[int]] = None, virtual_stages: int = 1, auto_partition: bool = True,
              default_partition: int = 0) -> Partition:
    """Cut `model` into `stages` contiguous runs of blocks: where blocks are placed by hand (SMP's
    `auto_partition`, `default_partition`), else at `split_points`, else balanced by `balance`."""
    blocks = find_blocks(model)
    n = blocks.count
    if stages > n:
        pp = stages // virtual_stages
        if virtual_stages == 1:
            raise ConfigError([Problem(PP_KEY, pp, f"cuts {blocks.path} into {stages} stages of at least one block "
                                       f"each, but it has {n} blocks", f"use a {PP_KEY} of at most {n}")])
        raise ConfigError([Problem(PP_KEY, pp, f"× virtual_stages {virtual_stages} cuts {blocks.path} into {stages} "
                                   f"stages of at least one block each, but it has {n} blocks",
                                   f"make {PP_KEY} × virtual_stages at most {n}")])
    block_list = model.get_submodule(blocks.path)
    costs = [module_cost(b, balance) for b in block_list]
    first = sum(module_cost(model.get_submodule(p), balance) for p in blocks.before)
    last = sum(module_cost(model.get_submodule(p), balance) for p in blocks.after)
    fixed = block_placements(model, blocks, stages, virtual_stages, auto_partition, default_partition)
    if fixed is not None and split_points is not None:
        by_hand = f"blocks of {blocks.path} placed by hand" if auto_partition else "auto_partition false"
        raise ValueError(f"pipeline placement: {SPLIT_KEY} {list(split_points)} and {by_hand} both fix the cut; "
                         f"fix: drop {SPLIT_KEY}, or " + ("the placements" if auto_partition else "auto_partition"))
    if split_points is not None:
        points = list(split_points)
        if points != sorted(set(points)) or not all(0 < p < n for p in points) or len(points) != stages - 1:
            raise ConfigError([Problem(SPLIT_KEY, points,
                                       f"must be {stages - 1} increasing block indices between 1 and {n - 1} "
                                       f"({blocks.path} has {n} blocks, cut into {stages} stages)",
                                       "give the index of the first block of every stage but the first")])
        edges = [0, *points, n]
    else:
        edges = [0]
        for size in min_max_split(costs, stages, first, last, fixed or [None] * n):
            edges.append(edges[-1] + size)
    bounds = tuple(zip(edges[:-1], edges[1:]))
    stage_costs = tuple(sum(costs[a:b]) + (first if s == 0 else 0) + (last if s == stages - 1 else 0)
                        for s, (a, b) in enumerate(bounds))
    unit = "matmul params" if balance == "compute" else "params"
    return Partition(blocks, bounds, stage_costs, _how(balance, split_points, fixed), unit)


def _how(balance: str, split_points: Optional[Sequence[int]], fixed: Optional[Sequence[Optional[int]]]) -> str:
    if split_points is not None:
        return "at the configured split points"
    if fixed is None:
        return f"balanced by {balance}"
    return "placed by hand" if None not in fixed else f"placed by hand, the rest balanced by {balance}"
