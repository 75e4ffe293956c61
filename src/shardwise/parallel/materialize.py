"""Delayed initialisation: a model built on the meta device gets storage only where it runs.

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
import torch.distributed as dist
from torch import nn

from .mesh import ParallelMesh


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
def materialize(module: nn.Module, device: torch.device, seed: int, root: Optional[nn.Module] = None) -> None:
    """Give every meta parameter and buffer of `module` storage on `device` and initialise it.

    `root` is the model `module` is a part of (default: `module` itself); names,
    hence seeds, and initialisers are the whole model's, so materialising it part
    by part gives the same values as all at once.
    """
    root = module if root is None else root
    prefix = next(name for name, sub in root.named_modules(remove_duplicate=False) if sub is module)
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        own = [*sub.named_parameters(recurse=False, remove_duplicate=False),
               *sub.named_buffers(recurse=False, remove_duplicate=False)]
        for key, t in own:
            if t.is_meta:
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                setattr(sub, key, made[id(t)])  # a buffer stays persistent or not, as registered
    fresh = {id(t) for t in made.values()}
    done: set[int] = set()
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        for name, sub in _post_order(module, prefix):
            if not any(id(t) in fresh for t in list(sub.parameters()) + list(sub.buffers())):
                continue  # real values the user gave: keep them
            own = [id(t) for t in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)] if id(t) in fresh]
            if own and all(i in done for i in own):
                continue  # a tied weight its first module already initialised
            init = _initialiser(_ancestors(root, name), sub)
            if init is None and not own:
                continue  # a container (nn.Sequential): its children initialised their own tensors
            if init is None:  # its tensors would keep whatever memory torch.empty found
                raise ValueError(f"delayed parameter initialisation cannot initialise {name or 'the model'!r} "
                                 f"({type(sub).__name__}): it has no reset_parameters() and no Hugging Face model "
                                 "encloses it; fix: give it a reset_parameters() that sets its own tensors, or "
                                 "build the model outside sw.delay_param_initialization()")
            torch.manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
            init()
            done.update(own)


def _agreed_seed(device: torch.device) -> int:
    """Rank 0's seed (the one `torch.manual_seed` set), so that every rank initialises a module alike."""
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=device)
    dist.broadcast(seed, src=0)
    return int(seed.item())


@torch.no_grad()
def _broadcast_from_first(module: nn.Module, group: dist.ProcessGroup) -> None:
    if dist.get_world_size(group) > 1:
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, group=group, group_src=0)


def unit_materialiser(root: nn.Module, mesh: ParallelMesh) -> Callable[[nn.Module], None]:
    """For sharding a meta-built model: materialise each sharding unit (and last, the root's own tensors)
    right before FSDP2 shards it, so a rank never holds more than one whole unit besides its shards."""
    device = mesh_device(mesh)
    seed = _agreed_seed(device)
    return lambda unit: materialize(unit, device, seed, root=root)


def mesh_device(mesh: ParallelMesh) -> torch.device:
    kind = mesh.world.device_type
    return torch.device(kind) if kind == "cpu" else torch.device(kind, torch.accelerator.current_device_index())


def place(module: nn.Module, mesh: ParallelMesh) -> torch.device:
    """Put `module` on this rank's device, equal on every rank holding the same part; returns the device.

    Meta tensors are materialised there (equal everywhere by construction); a
    model built with real values takes those of the first rank of its `dp`
    group (every rank but other pipeline stages), whatever seed each rank used.
    Every rank must call it.
    """
    device = mesh_device(mesh)
    if has_meta(module):
        materialize(module, device, _agreed_seed(device))
    else:
        module.to(device)
        _broadcast_from_first(module, mesh["dp"].get_group())
    return device
