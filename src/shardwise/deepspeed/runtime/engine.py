"""`deepspeed.runtime.engine`: where scripts import the engine class from (type checks, subclassing)."""

from ..engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
