"""Activation recompute: checkpointed regions (apply.py), which ops a region keeps (selective.py) and where its kept
inputs wait for backward (offload.py). Saving training state to disk is `shardwise.checkpoint`, not this."""

from .apply import apply_activation_checkpointing, checkpoint_in_groups, checkpointed, group_size

__all__ = ["apply_activation_checkpointing", "checkpoint_in_groups", "checkpointed", "group_size"]
