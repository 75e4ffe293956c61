"""Delayed initialisation: a model built on the meta device gets storage only for this rank's stages.

Values come from the model's own initialiser — a Hugging Face model's
`_init_weights` (which also recomputes buffers such as rotary tables), else each
module's `reset_parameters()` — run with a seed per module name. The values
therefore depend on the module, not on which rank builds it: data-parallel
replicas agree without a broadcast, and every pipeline degree builds the same
model (as a single process would with `materialize` on the whole model).
"""

from __future__ import annotations

import zlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Children before parents, as `nn.Module.apply` (and so Hugging Face's init) visits them."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _initialiser(owners: list[nn.Module], module: nn.Module) -> Optional[Callable[[], None]]:
    for owner in reversed(owners):  # the nearest enclosing Hugging Face model
        init = getattr(owner, "_init_weights", None)
        if init is not None:
            return lambda: init(module)
    reset = getattr(module, "reset_parameters", None)
    return reset if callable(reset) else None


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".") if name else []
    return [root.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device, seed: int) -> None:
    """Give every meta parameter and buffer of `module` storage on `device` and initialise it."""
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for key, t in table.items():
                if t is not None and t.is_meta:
                    if id(t) not in made:
                        empty = torch.empty_like(t, device=device)
                        made[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                    table[key] = made[id(t)]
    fresh = {id(t) for t in made.values()}
    done: set[int] = set()
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        for name, sub in _post_order(module):
            if not any(id(t) in fresh for t in list(sub.parameters()) + list(sub.buffers())):
                continue  # real values the user gave: keep them
            own = [id(t) for t in list(sub._parameters.values()) + list(sub._buffers.values())
                   if t is not None and id(t) in fresh]
            if own and all(i in done for i in own):
                continue  # a tied weight its first module already initialised
            init = _initialiser(_ancestors(module, name), sub)
            if init is None:
                continue
            torch.manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
            init()
            done.update(own)
