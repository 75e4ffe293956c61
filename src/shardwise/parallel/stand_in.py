"""`Elsewhere`: what a pipeline stage holds in place of a module another stage holds.

Its own module, because both the pipeline (pipeline/stage.py builds stages with
it) and activation recompute (which skips stand-ins: they hold nothing to
recompute) need it, and neither should import the other.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..torch_internals import tree_flatten, tree_map


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` on the meta device, made without copying any tensor data."""
    memo: dict[int, Any] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


class Elsewhere(nn.Module):
    """Stands in for a module another stage holds: no parameters; returns zeros shaped like its output.

    Stand-ins for the embeddings let the model's forward run up to the first
    block (which then gets the received hidden states). Stand-ins for what comes
    after the blocks (`free`) return a zero expanded to the output's shape, which
    takes no memory however large the output (a vocabulary's logits).
    """

    def __init__(self, module: nn.Module, free: bool = False):
        super().__init__()
        self._shape_of = (meta_copy(module),)  # in a tuple, so not registered: its parameters are not ours
        self.holds = type(module).__name__
        self.free = free

    def compute_in(self, dtype: torch.dtype) -> None:
        """Shape outputs as the held module computes when its stage stores or casts parameters in `dtype`
        (FSDP2's policy, ZeRO-1's replicas): rotary tables and masks follow the embeddings' dtype."""
        self._shape_of = (self._shape_of[0].to(dtype),)

    def _zeros(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if self.free:
            return torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else torch.get_default_device()
        meta_args, meta_kwargs = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
        shaped = self._shape_of[0](*meta_args, **meta_kwargs)
        return tree_map(lambda t: self._zeros(t, device) if isinstance(t, torch.Tensor) else t, shaped)

    def extra_repr(self) -> str:
        return f"{self.holds} held by another pipeline stage"
