"""`Blocks`: where a model's block list is, what pipeline stages are cut along (partition.py) and what a user's
placements are checked against (placement.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Blocks:
    """The model's block list (`path`, e.g. 'transformer.h') and the modules around it."""

    path: str
    count: int
    before: tuple[str, ...]  # paths of modules with parameters the first stage holds
    after: tuple[str, ...]  # ... the last stage holds
