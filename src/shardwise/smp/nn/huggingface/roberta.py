"""RoBERTa: the same encoder layout as BERT's (`RobertaEncoder` ↔ `DistributedTransformer`)."""

from __future__ import annotations

from typing import Any, Optional

from .bert import ENCODER_RULES
from .layout import StateDict, identity, renamed


def translate_state_dict_to_hf_roberta(state_dict: StateDict, max_seq_len: Optional[int] = None) -> dict[str, Any]:
    """Keys under a `DistributedTransformer` encoder renamed to `RobertaEncoder`'s; Hugging Face keys as they
    are. `max_seq_len` is taken for SMP's signature; RoBERTa's state dict has nothing it sizes."""
    return renamed(state_dict, ENCODER_RULES)


def translate_hf_state_dict_to_smdistributed_roberta(state_dict: StateDict) -> dict[str, Any]:
    """The identity: a `DistributedModel` of a Hugging Face RoBERTa keeps its names (see package docstring)."""
    return identity(state_dict)
