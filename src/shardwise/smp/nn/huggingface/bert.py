"""BERT: SMP's `DistributedTransformer` stood in for `BertEncoder` (`encoder.layer.*` ↔ `encoder.seq_layers.*`)."""

from __future__ import annotations

import re
from typing import Any, Optional

from .layout import StateDict, identity, renamed

# (SMP's DistributedTransformerLayer part, Hugging Face's BertLayer part), per layer
ENCODER_PARTS = [
    ("attention.query.", "attention.self.query."), ("attention.key.", "attention.self.key."),
    ("attention.value.", "attention.self.value."), ("attention.dense.", "attention.output.dense."),
    ("attention.layernorm.", "attention.output.LayerNorm."), ("output.dense1.", "intermediate.dense."),
    ("output.dense2.", "output.dense."), ("output.layernorm.", "output.LayerNorm."),
]
ENCODER_RULES = [(rf"encoder\.seq_layers\.(\d+)\.{re.escape(smp)}", rf"encoder.layer.\1.{hf}")
                 for smp, hf in ENCODER_PARTS]


def translate_state_dict_to_hf_bert(state_dict: StateDict, max_seq_len: Optional[int] = None) -> dict[str, Any]:
    """Keys under a `DistributedTransformer` encoder renamed to `BertEncoder`'s; Hugging Face keys as they are.
    `max_seq_len` is taken for SMP's signature; BERT's state dict has nothing it sizes."""
    return renamed(state_dict, ENCODER_RULES)


def translate_hf_state_dict_to_smdistributed_bert(state_dict: StateDict) -> dict[str, Any]:
    """The identity: a `DistributedModel` of a Hugging Face BERT keeps its names (see package docstring)."""
    return identity(state_dict)
