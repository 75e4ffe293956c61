"""Cluster shape and the named layout of ranks on it (pure Python)."""

from .cluster import Cluster
from .layout import AXES, Layout

__all__ = ["AXES", "Cluster", "Layout"]
