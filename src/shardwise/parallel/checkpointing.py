"""Activation checkpointing: keep a module's inputs, recompute its activations in backward.

Applied by replacing the module instance's `forward`, so it can be called after
the model is sharded: FSDP's hooks sit on `__call__`, outside the recomputed
region, and have unsharded the parameters again by the time backward recomputes.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

_MARK = "_shardwise_checkpointed"


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(module, _MARK, False)


def apply_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True) -> nn.Module:
    """Recompute `module`'s activations during backward instead of storing them. Idempotent."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_activation_checkpointing expects an nn.Module, got {type(module).__name__}; "
                        "pass a layer such as model.get_module().transformer.h[0]")
    if is_checkpointed(module):
        return module
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)

    module.forward = forward
    setattr(module, _MARK, True)
    return module
