"""Which submodules become their own sharding unit.

Transformer blocks are the natural unit: big enough to amortise a collective,
small enough that one unsharded block fits. Hugging Face models name their
blocks in `_no_split_modules`; other models fall back to the repeated entries
of their largest `ModuleList`, then to a size threshold.
"""

from __future__ import annotations

from torch import nn


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _hf_blocks(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1
             and len({type(child) for child in m}) == 1]
    if not lists:
        return []
    return list(max(lists, key=_param_count))


def _by_size(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Post-order: a module is a unit when what it holds outside already-chosen units reaches min_params."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        remaining = sum(visit(child) for child in module.children())
        remaining += sum(p.numel() for p in module.parameters(recurse=False))
        if remaining >= min_params and module is not model:
            units.append(module)
            return 0
        return remaining

    visit(model)
    return units


def sharding_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Submodules to shard individually, innermost first; the root is always a unit too."""
    for finder in (_hf_blocks, _repeated_blocks):
        blocks = finder(model)
        if blocks:
            return blocks
    return _by_size(model, min_params)
