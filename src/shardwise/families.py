"""The Hugging Face model families shardwise knows, one registry for every part that asks (pure).

The tensor-parallel plans (parallel/tensor/registry.py) and the planner's model
specs (planner/families.py) are keyed by family; a `config.model_type` is read
as a family here, so an alias added once reaches both.
"""

from __future__ import annotations

from typing import Optional

FAMILIES = ("gpt2", "llama", "bert", "vit", "mixtral")
ALIASES = {"mistral": "llama"}  # model types with a family's module layout
MODEL_TYPES = tuple(t for f in FAMILIES for t in (f, *(a for a, family in ALIASES.items() if family == f)))


def family_of(model_type: Optional[str]) -> Optional[str]:
    """The family of a `config.model_type`, or None when shardwise has none for it."""
    return model_type if model_type in FAMILIES else ALIASES.get(model_type or "")
