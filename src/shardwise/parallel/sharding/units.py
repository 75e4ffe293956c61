"""Which submodules become their own sharding unit.

Transformer blocks are the natural unit: big enough to amortise a collective,
small enough that one unsharded block fits. Hugging Face models name their
blocks in `_no_split_modules`; other models fall back to the repeated entries
of their largest `ModuleList`, then to a size threshold. Around known blocks, a
module holding at least half a block's parameters (an untied embedding, an output
head) is a unit too: the root's parameters are reduced only when backward ends,
so a large head left there reduces its gradients last instead of first, and it
would stay gathered from forward to backward. FSDP2 manages a parameter
in one group only, so a unit sharing a weight with a module outside it (BERT's
embeddings, whose word embeddings the masked-LM head reuses) is no unit: the
shared weight stays with the root.
"""

from __future__ import annotations

from collections import defaultdict

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


def _by_size(model: nn.Module, min_params: int, chosen: tuple[nn.Module, ...] = ()) -> list[nn.Module]:
    """Post-order: a module is a unit when what it holds outside already-chosen units (`chosen` and those found
    here) reaches min_params."""
    units: list[nn.Module] = []
    skip = {id(module) for module in chosen}

    def visit(module: nn.Module) -> int:
        if id(module) in skip:
            return 0
        remaining = sum(visit(child) for child in module.children())
        remaining += sum(p.numel() for p in module.parameters(recurse=False))
        if remaining >= min_params and module is not model:
            units.append(module)
            return 0
        return remaining

    visit(model)
    return units


def _self_contained(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The units whose parameters no module outside them uses too."""
    users: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        users[id(param)].append(name)
    path = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    return [unit for unit in units
            if all(name.startswith(f"{path[id(unit)]}.") for p in unit.parameters() for name in users[id(p)])]


def known_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's own blocks (Hugging Face's `_no_split_modules`, else a repeated ModuleList), or none."""
    for finder in (_hf_blocks, _repeated_blocks):
        blocks = finder(model)
        if blocks:
            return blocks
    return []


def sharding_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Submodules to shard individually, innermost first (in registration order otherwise, which backward
    reverses); the root is always a unit too."""
    blocks = known_blocks(model)
    if not blocks:
        return _self_contained(model, _by_size(model, min_params))
    beside = _by_size(model, min(min_params, min(map(_param_count, blocks)) // 2), tuple(blocks))
    return _self_contained(model, _in_registration_order(model, [*blocks, *beside]))


def _in_registration_order(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """`units` in post-order of the module tree: a unit after the units inside it (FSDP2 shards inner units
    first), siblings in the order the model registered them (an embedding before the blocks, a head after:
    usually the forward's order)."""
    position: dict[int, int] = {}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        position.setdefault(id(module), len(position))

    visit(model)
    return sorted(units, key=lambda unit: position[id(unit)])
