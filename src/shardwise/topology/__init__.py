"""Cluster shape and the named layout of ranks on it (pure Python)."""

from .cluster import Cluster
from .layout import AXES, Layout, layout_for

__all__ = ["AXES", "Cluster", "Layout", "layout_for"]
