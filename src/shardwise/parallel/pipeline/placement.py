"""SMP v1's manual pipeline placement: `partition(i)` and `set_partition(module, i)`, and what the cutter makes of them.

    with partition(1):                     # modules built inside go to partition (pipeline stage) 1
        self.head = nn.Linear(...)
    set_partition(model.transformer.h[3], 1)   # after building, before DistributedModel

Both only record the wanted partition on the module (so they work before
`init`); the cut at `DistributedModel` reads them. A module takes its own
placement, else that of its nearest placed enclosing module. The cutter keeps
one list of blocks in contiguous runs, so placements must keep it so: blocks on
non-decreasing partitions, each block whole on one, what comes before the
blocks on the first partition and what comes after them on the last.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from torch import nn

from .blocks import Blocks

_PLACED = "_shardwise_partition"  # the attribute a placement is recorded in
_open: list[int] = []  # indices of the `partition` contexts open now, innermost last
NOT_CONTIGUOUS = "non-contiguous placement is not supported by the block-list cutter"


def _checked(index: object, caller: str) -> int:
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"{caller}: the partition index must be an int (a pipeline stage from 0), got {index!r}")
    if index < 0:
        raise ValueError(f"{caller}: the partition index must be 0 or more (a pipeline stage), got {index}")
    return index


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules built inside go to partition `index`; in nested contexts the innermost wins.

    While a context is open, `nn.Module.__init__` records the innermost index
    on every module it initialises (torch has no hook on module creation).
    """
    _open.append(_checked(index, "partition"))
    outermost = len(_open) == 1
    if outermost:
        module_init = nn.Module.__init__

        def init_placed(self: nn.Module, *args, **kwargs) -> None:
            module_init(self, *args, **kwargs)
            if _open:
                self.__dict__[_PLACED] = _open[-1]

        nn.Module.__init__ = init_placed
    try:
        yield
    finally:
        _open.pop()
        if outermost:
            nn.Module.__init__ = module_init


def set_partition(module: nn.Module, index: int) -> None:
    """Place `module` (and what it encloses, unless placed itself) on partition `index`; wins over `partition`."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_partition: expects a torch.nn.Module, got {type(module).__name__}")
    module.__dict__[_PLACED] = _checked(index, "set_partition")


def placed_on(module: nn.Module) -> Optional[int]:
    """The partition `module` itself was placed on, or None."""
    return module.__dict__.get(_PLACED)


class _Placements:
    """Every placement in a model by module path, and how a module inherits one."""

    def __init__(self, model: nn.Module):
        self.own = {path: placed_on(m) for path, m in model.named_modules() if placed_on(m) is not None}

    def of(self, path: str) -> Optional[tuple[str, int]]:
        """(the placed module, its partition): `path` itself or its nearest placed enclosing module."""
        parts = path.split(".") if path else []
        for depth in range(len(parts), -1, -1):
            prefix = ".".join(parts[:depth])
            if prefix in self.own:
                return prefix, self.own[prefix]
        return None

    def within(self, path: str) -> list[tuple[str, int]]:
        """Every placement that applies to a module of `path`'s subtree: its own or inherited, and its parts'."""
        inherited = self.of(path)
        inner = [(p, i) for p, i in self.own.items() if p.startswith(path + ".")]
        return ([inherited] if inherited else []) + inner


def _named(unit: str, where: str, index: int) -> str:
    """'lm_head (partition 0)', '… (partition 0, from transformer)', or a placed part of `unit`."""
    if where == unit or where.startswith(unit + "."):
        return f"{where} (partition {index})"
    return f"{unit} (partition {index}, from {where or 'the model root'})"


def _check_ends(found: _Placements, blocks: Blocks, last: int) -> None:
    """What runs before the blocks stays on the first partition, what runs after them on the last."""
    for paths, side, wanted in ((blocks.before, "before", 0), (blocks.after, "after", last)):
        for unit in paths:
            for where, index in found.within(unit):
                if index != wanted:
                    stage = "first" if wanted == 0 else "last"
                    raise ValueError(f"pipeline placement: {_named(unit, where, index)} runs {side} the blocks "
                                     f"{blocks.path}, so on the {stage} partition ({wanted}): {NOT_CONTIGUOUS}; "
                                     f"fix: place it on partition {wanted}, or leave it unplaced")


def _block_placement(found: _Placements, unit: str, default: Optional[int]) -> tuple[Optional[int], str]:
    """The one partition of block `unit` (None: unplaced, the automatic cut chooses) and its name in errors;
    `default` places it when nothing does (auto_partition false)."""
    inherited = found.of(unit)
    placements = [(_named(unit, where, index), index) for where, index in found.within(unit)]
    if default is not None and inherited is None:
        placements.insert(0, (f"{unit} (partition {default}, default_partition)", default))
    if len({index for _, index in placements}) > 1:
        raise ValueError(f"pipeline placement: block {unit} is split over {', '.join(n for n, _ in placements)}; "
                         "the block-list cutter keeps each block on one stage; fix: place whole blocks")
    if not placements:
        return None, unit
    name, index = placements[0]  # the block's own, inherited or default placement, else that of a part
    return index, name if inherited is not None or default is not None else f"{unit} (partition {index})"


def _check_runs(fixed: list[Optional[int]], labels: list[str], path: str, stages: int) -> None:
    """Placed blocks on non-decreasing partitions, with enough blocks between them for every partition."""
    placed = [(-1, -1, "")] + [(i, p, labels[i]) for i, p in enumerate(fixed) if p is not None]
    placed.append((len(fixed), stages, ""))
    for (i, p, low), (j, q, high) in zip(placed, placed[1:]):
        if q < p:
            raise ValueError(f"pipeline placement: {low} runs before {high}: {NOT_CONTIGUOUS} (a stage holds a "
                             f"contiguous run of {path}); fix: place the blocks on non-decreasing partitions")
        if q - p > j - i:
            gap = f"partition {p + 1}" if q - p == 2 else f"partitions {p + 1}-{q - 1}"
            where = (f"between {low} and {high}" if low and high else f"before {high}" if high else f"after {low}")
            between = j - i - 1
            unplaced = f"{between or 'no'} unplaced block" + (" lies" if between < 2 else "s lie")
            raise ValueError(f"pipeline placement: {gap} would get no block of {path}: {unplaced} "
                             f"{where}; fix: place at least one block on every partition 0 to {stages - 1}")


def block_placements(model: nn.Module, blocks: Blocks, stages: int, virtual_stages: int, auto_partition: bool,
                     default_partition: int) -> Optional[list[Optional[int]]]:
    """The partition every block must be on (None: for the automatic cut to choose), or None when nothing is
    placed by hand. Refuses, in one line, a placement the block-list cutter cannot honour."""
    found = _Placements(model)
    if not found.own and auto_partition:
        return None
    if virtual_stages > 1:
        what = "auto_partition false"
        if found.own:
            path, index = next(iter(found.own.items()))
            what = f"placing {path or 'the model root'} by hand on partition {index}"
        raise ValueError(f"pipeline placement: {what} needs one stage per rank, but this schedule runs "
                         f"{virtual_stages} (virtual_stages); fix: use pipeline_schedule gpipe or 1f1b, or leave "
                         f"the cut to the automatic partition")
    for path, index in found.own.items():
        if index >= stages:
            raise ValueError(f"pipeline placement: {path or 'the model root'} is on partition {index}, but "
                             f"pipeline_parallel_degree is {stages}; fix: use partitions 0 to {stages - 1}")
    _check_ends(found, blocks, stages - 1)
    default = None if auto_partition else default_partition
    fixed, labels = zip(*(_block_placement(found, f"{blocks.path}.{i}", default) for i in range(blocks.count)))
    if all(p is None for p in fixed):
        return None
    _check_runs(list(fixed), list(labels), blocks.path, stages)
    return list(fixed)
