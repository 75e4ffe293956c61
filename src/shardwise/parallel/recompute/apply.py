"""Activation checkpointing: keep a region's inputs, recompute its activations in backward.

`apply_activation_checkpointing` is SMP v1's `set_activation_checkpointing(module,
preserve_rng_state=True, pack_args_as_tuple=False, strategy="each")`, plus
`policy` (selective.py: None recomputes a region whole, "matmul"
keeps its matrix products and attention kernels' outputs and recomputes the rest):

- a module: its forward is one region;
- an `nn.Sequential` of layers: `strategy` says which consecutive layers form one
  region — "each" layer alone, "contiguous" (every run of layers this rank
  holds, SMP's "on the same partition": under a pipeline a layer another stage
  holds is a stand-in, which no region spans) or "group_<k>" (runs of k of them);
- an `nn.ModuleList` of blocks: each block alone ("each" only: its parent's
  forward calls the blocks one by one, so no single call spans a group).

Regions are `torch.utils.checkpoint.checkpoint` with `use_reentrant=False`,
which takes tuples and keyword arguments as they are: SMP's
`pack_args_as_tuple`, which its reentrant checkpoint needed for layers taking a
tuple, is accepted and changes nothing. A module is checkpointed by replacing
the instance's `forward`, so it works after the model is sharded: FSDP's hooks
sit on `__call__`, outside the recomputed region, and have unsharded the
parameters again by the time backward recomputes. A checkpointed module called
with a key/value cache while training runs without it, as Hugging Face's own
checkpointing does: its replay would write the cache again. With
`offload_activations` the inputs a region keeps go to host memory until backward
needs them (offload.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...config.recompute import checkpointing_group_size
from ..stand_in import Elsewhere
from .offload import OffloadSchedule, offloaded_region
from .selective import Policy, checked_policy, with_policy

# how: (layers per region, None for every run it holds; preserve_rng_state; policy; offload schedule)
_MARK = "_shardwise_checkpointed"
Marked = tuple[Optional[int], bool, Policy, Optional[OffloadSchedule]]


def is_checkpointed(module: nn.Module) -> bool:
    return hasattr(module, _MARK)


def lift_checkpointing(model: nn.Module) -> dict[str, Marked]:
    """Undo `set_activation_checkpointing` on every module of `model`, and say how each was checkpointed (path ->
    (layers per region, preserve_rng_state, policy, offload)): a capture of the model's forward sees its plain
    forward, and the regions are set again on the modules that replace these (`restore_checkpointing`)."""
    lifted = {}
    for path, module in model.named_modules():
        if is_checkpointed(module):
            lifted[path] = getattr(module, _MARK)
            del module.forward  # the class's forward again
            delattr(module, _MARK)
    return lifted


def restore_checkpointing(model: nn.Module, lifted: dict[str, Marked]) -> None:
    """Checkpoint again, in `model`, the modules `lift_checkpointing` took them from that it holds."""
    held = dict(model.named_modules())
    for path, (size, preserve_rng_state, policy, offload) in lifted.items():
        if path not in held:
            continue
        if size != 1:
            strategy = "contiguous" if size is None else f"group_{size}"
            raise ValueError(f"{path}: checkpointing groups of layers (strategy {strategy}) needs an nn.Sequential's "
                             "forward, which the module-graph pipeline cut replaces by a captured graph; fix: "
                             "set_activation_checkpointing(..., strategy='each')")
        _checkpoint_module(held[path], preserve_rng_state, policy, offload)


def apply_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True,
                                   pack_args_as_tuple: bool = False, strategy: str = "each",
                                   policy: Policy = None, offload: Optional[OffloadSchedule] = None) -> nn.Module:
    """Recompute `module`'s activations (or its layers', by `strategy`) during backward instead of storing
    them, except the outputs of the ops `policy` keeps; `preserve_rng_state` replays the random state, so
    dropout draws the same masks; `offload` stores the inputs each region keeps (offload_activations).
    Idempotent."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_activation_checkpointing expects an nn.Module, got {type(module).__name__}; "
                        "pass a layer such as model.get_module().transformer.h[0]")
    size = group_size(strategy)
    policy = checked_policy(policy)
    if isinstance(module, Elsewhere):  # under a pipeline, another stage holds it: nothing to recompute here
        return module
    if isinstance(module, nn.Sequential) and size != 1:
        _checkpoint_groups(module, size, preserve_rng_state, policy, offload)
    elif isinstance(module, (nn.Sequential, nn.ModuleList)):
        if size != 1:
            raise ValueError(f"strategy={strategy!r} needs an nn.Sequential, whose forward runs its layers in turn; "
                             "an nn.ModuleList's blocks are called one by one by its parent's forward, so no region "
                             "can span several; pass strategy='each', or hold the blocks in an nn.Sequential")
        for layer in module:
            _checkpoint_module(layer, preserve_rng_state, policy, offload)
    elif size != 1:
        raise ValueError(f"strategy={strategy!r} groups the layers of an nn.Sequential, and {type(module).__name__} "
                         "is not one; pass the nn.Sequential of layers, or strategy='each'")
    else:
        _checkpoint_module(module, preserve_rng_state, policy, offload)
    return module


def group_size(strategy: str) -> Optional[int]:
    """Layers per region for SMP's strategy name: 1 for "each", None (all) for "contiguous", k for "group_k"."""
    try:
        return checkpointing_group_size(strategy)
    except ValueError as error:
        raise ValueError(f"set_activation_checkpointing: {error}") from None


def checkpointed(fn: Callable[..., Any], /, *args: Any, preserve_rng_state: bool = True, policy: Policy = None,
                 offload: Optional[OffloadSchedule] = None, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` as one region: torch's non-reentrant checkpoint keeping what `policy` (checked) keeps,
    its kept inputs stored by `offload` (None: kept where they are)."""
    with offloaded_region(offload) as context_fn:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                          context_fn=with_policy(context_fn, policy), **kwargs)


def _checkpoint_module(module: nn.Module, preserve_rng_state: bool, policy: Policy,
                       offload: Optional[OffloadSchedule]) -> None:
    if is_checkpointed(module) or isinstance(module, Elsewhere):  # a stand-in holds nothing to recompute
        return
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if torch.is_grad_enabled():
            kwargs = _without_cache(kwargs)
        return checkpointed(original, *args, preserve_rng_state=preserve_rng_state, policy=policy, offload=offload,
                            **kwargs)

    module.forward = forward
    setattr(module, _MARK, (1, preserve_rng_state, policy, offload))


# A block's key/value cache, by the names Hugging Face layers take it.
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past", "cache")


def _without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A region recomputed in backward must not write a key/value cache again (the replay would append to it and
    attend over the keys twice): a training call runs without one, as Hugging Face's own gradient checkpointing
    runs its layers. Nothing in training reads the cache."""
    if not any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS) and not kwargs.get("use_cache"):
        return kwargs
    return {**kwargs, **{name: None for name in _CACHE_ARGUMENTS if name in kwargs},
            **({"use_cache": False} if "use_cache" in kwargs else {})}


def _checkpoint_groups(sequential: nn.Sequential, size: Optional[int], preserve_rng_state: bool,
                       policy: Policy, offload: Optional[OffloadSchedule]) -> None:
    """Run `sequential` as consecutive regions of `size` layers (each run this rank holds when None)."""
    if type(sequential).forward is not nn.Sequential.forward:
        raise ValueError(f"grouping layers replaces nn.Sequential's forward, which {type(sequential).__name__} "
                         "overrides; pass strategy='each'")

    def forward(input: Any) -> Any:  # the layers are read per call: ones appended later are grouped too
        return checkpoint_in_groups(list(sequential), input, size, preserve_rng_state, policy, offload)

    sequential.forward = forward
    setattr(sequential, _MARK, (size, preserve_rng_state, policy, offload))


def checkpoint_in_groups(layers: list[nn.Module], input: Any, size: Optional[int], preserve_rng_state: bool,
                         policy: Policy = None, offload: Optional[OffloadSchedule] = None) -> Any:
    """Run `layers` in turn on `input`, each group of `layer_groups` as one recomputed region."""
    for group in layer_groups(layers, size):
        if isinstance(group[0], Elsewhere):  # a stand-in: nothing this rank holds to recompute
            input = group[0](input)
        else:
            input = checkpointed(_run_in_turn, group, input, preserve_rng_state=preserve_rng_state, policy=policy,
                                 offload=offload)
    return input


def layer_groups(layers: list[nn.Module], size: Optional[int]) -> list[list[nn.Module]]:
    """`layers` cut into runs of `size` (None: as long as they go) that never span a pipeline stand-in; each
    stand-in is a group of its own."""
    groups: list[list[nn.Module]] = []
    for layer in layers:
        joins = (groups and not isinstance(layer, Elsewhere) and not isinstance(groups[-1][0], Elsewhere)
                 and (size is None or len(groups[-1]) < size))
        if joins:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return groups


def _run_in_turn(layers: list[nn.Module], input: Any) -> Any:
    for layer in layers:
        input = layer(input)
    return input
