"""Gradient hooks that do not keep their owner alive.

A parameter keeps its hooks in autograd's C++ metadata, which Python's garbage
collector cannot see through: a hook bound strongly to an object that holds the
parameter (a bucketed reducer, a cross-group reduction) makes a cycle no
collection breaks, so the object, every parameter and gradient it names and its
process group would outlive the model (and the group's threads keep running).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


def post_accumulate_grad_hook(param: torch.Tensor, method: Callable[[torch.Tensor], None]) -> None:
    """Call the bound `method` with `param` each time a gradient is accumulated into it, while `method`'s object
    lives; the hook holds that object weakly."""
    bound = weakref.WeakMethod(method)

    def hook(tensor: torch.Tensor) -> None:
        live = bound()
        if live is not None:
            live(tensor)

    param.register_post_accumulate_grad_hook(hook)
