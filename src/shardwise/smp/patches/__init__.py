"""SMP's `smp.patches`: activation checkpointing calls (`patches.checkpoint`)."""

from . import checkpoint

__all__ = ["checkpoint"]
