"""GPT-Neo: kept a Hugging Face model under shardwise, so both translations are the identity.

SMP stood its `DistributedTransformerLMHead` in for GPT-Neo with options SMP did not
document (rotary or local attention, bias-free projections), which `shardwise.nn`'s
modules therefore do not take: there is no shardwise layout to translate from.
"""

from __future__ import annotations

from typing import Any, Optional

from .layout import StateDict, identity


def translate_state_dict_to_hf_gptneo(state_dict: StateDict, max_seq_len: Optional[int] = None) -> dict[str, Any]:
    """The identity (see module docstring); `max_seq_len` is taken for SMP's signature."""
    return identity(state_dict)


def translate_hf_state_dict_to_smdistributed_gptneo(state_dict: StateDict) -> dict[str, Any]:
    """The identity: a `DistributedModel` of a Hugging Face GPT-Neo keeps its names."""
    return identity(state_dict)
