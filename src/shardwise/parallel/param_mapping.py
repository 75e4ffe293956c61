"""Optimizers built before `DistributedModel`: their parameters swapped for the ones the model holds.

SMP scripts build the optimizer from the plain module and wrap it after the model:

    opt = torch.optim.AdamW(module.parameters(), lr=...)
    model = sw.DistributedModel(module)
    opt = sw.DistributedOptimizer(opt)

Tensor parallelism, sharding (FSDP2), delayed initialisation and tied-weight copies
replace Parameter objects, and the pipeline leaves other stages' parameters to other
ranks, so such an optimizer would step tensors the model no longer uses.
`DistributedModel` records the names every parameter had in the user's module before
parallelizing; `DistributedOptimizer` then puts in each param group, in place, the
parameters the model now holds under those names (none for another stage's),
keeping every group and its options (an LR scheduler built on the optimizer still works).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass(frozen=True)
class _Original:
    names: tuple[str, ...]
    shape: torch.Size
    dtype: torch.dtype


class OriginalNames:
    """The names each parameter of the user's module had before parallelizing (a tied weight has several).

    Keyed by id without any reference to the parameter, not even a weak one: replaced full tensors must be
    freed, and `torch.utils.swap_tensors` (ZeRO-1's in-place cast to bf16/fp16) refuses a tensor that has
    weak references. Shape and dtype tell an original from a later tensor that reuses a freed one's id.
    """

    def __init__(self, module: nn.Module):
        self._originals: dict[int, _Original] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            known = self._originals.get(id(param))
            names = known.names if known is not None else ()
            self._originals[id(param)] = _Original(names + (name,), param.shape, param.dtype)

    def names_of(self, param: torch.Tensor) -> Optional[tuple[str, ...]]:
        """`param`'s names in the user's module, or None if it was not one of its parameters."""
        original = self._originals.get(id(param))
        if original is None or (original.shape, original.dtype) != (param.shape, param.dtype):
            return None
        return original.names


def adopt_model_parameters(optimizer: torch.optim.Optimizer, originals: OriginalNames,
                           held: dict[str, nn.Parameter]) -> None:
    """Put in `optimizer`'s param groups the parameters `held` (this rank's, by name) in place of the
    user's originals they replaced; each held parameter once (tied weights), none for an original this rank
    does not hold. A group left empty stays, with its options: torch's optimizers step over it."""
    held_ids = {id(p) for p in held.values()}
    seen: set[int] = set()
    groups, replaced = [], []
    for g, group in enumerate(optimizer.param_groups):
        params = []
        for i, param in enumerate(group["params"]):
            if id(param) in held_ids:
                candidates = [param]
            else:
                candidates = _counterparts(param, originals, held, f"param_groups[{g}]['params'][{i}]")
                replaced.append(param)
            params += _first_seen(candidates, seen)
        groups.append(params)
    if not replaced:
        return
    if any(param in optimizer.state for param in replaced):
        raise RuntimeError("DistributedOptimizer: the optimizer has already taken steps on parameters that "
                           "DistributedModel replaced; build or wrap it before training")
    for group, params in zip(optimizer.param_groups, groups):
        group["params"] = params


def _counterparts(param: torch.Tensor, originals: OriginalNames, held: dict[str, nn.Parameter],
                  where: str) -> list[nn.Parameter]:
    """The parameters this rank holds under the names `param` had: one, or two copies of a weight tied
    across pipeline stages that share this rank, or none when another stage holds it."""
    names = originals.names_of(param)
    if names is None:
        raise ValueError(f"DistributedOptimizer: the optimizer's {where} (shape {tuple(param.shape)}) is not a "
                         "parameter of the DistributedModel; build the optimizer from that model's parameters")
    return [held[name] for name in names if name in held]


def _first_seen(params: list[nn.Parameter], seen: set[int]) -> list[nn.Parameter]:
    """`params` not in `seen`, which then holds them."""
    fresh = []
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            fresh.append(param)
    return fresh
