"""Renaming state-dict keys from SMP's distributed-module layout to a Hugging Face model's."""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

StateDict = Mapping[str, Any]


def renamed(state_dict: StateDict, rules: list[tuple[str, str]]) -> dict[str, Any]:
    """Each key with its first matching (regex, replacement) rule applied anywhere in it; other keys as they are."""
    result = {}
    for key, value in state_dict.items():
        for pattern, replacement in rules:
            new, count = re.subn(pattern, replacement, key, count=1)
            if count:
                key = new
                break
        result[key] = value
    return result


def transposed(value: torch.Tensor) -> torch.Tensor:
    """A linear weight between nn.Linear's (out × in) and HF Conv1D's (in × out) storage."""
    return value.t().contiguous()


def identity(state_dict: StateDict) -> dict[str, Any]:
    """The state dict as it is, in a new dict: its keys are the Hugging Face model's own."""
    return dict(state_dict)
