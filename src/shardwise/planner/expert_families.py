"""Hugging Face mixture-of-experts configs → `ModelSpec` (pure, as families.py reads the dense ones).

Mixtral: Llama's attention, norms, embedding and untied head; each block's MLP is a router
(experts × hidden) and `num_local_experts` SwiGLU experts of `intermediate_size`, `num_experts_per_tok`
of them per token. The spec counts every expert in the parameters (what memory holds) and sets `ffn` to
the width a token passes through, top-k × intermediate_size (what its activations and FLOPs scale with).
"""

from __future__ import annotations

from typing import Any, Mapping

from .experts import expert_shape
from .spec import ModelSpec

MIXTRAL_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": None, "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 32768,
    "hidden_act": "silu", "num_local_experts": 8, "num_experts_per_tok": 2, "attention_dropout": 0.0,
    "tie_word_embeddings": False}


def mixtral_spec(c: Mapping[str, Any], name: str) -> ModelSpec:
    h, layers, heads, vocab = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["vocab_size"]
    kv = c["num_key_value_heads"] or heads
    d = c["head_dim"] or h // heads
    f, experts, top_k = c["intermediate_size"], c["num_local_experts"], c["num_experts_per_tok"]
    attention = (heads * d * h, 2 * kv * d * h, heads * d * h)
    shape = expert_shape(experts, top_k, layers, h, f)
    layer = (h,) + attention + (h, experts * h) + experts * shape.expert_tensors
    tied = bool(c["tie_word_embeddings"])
    head = (h,) + (() if tied else (vocab * h,))
    return ModelSpec(name=name, family="mixtral", hidden=h, layers=layers, heads=heads, kv_heads=kv,
                     ffn=top_k * f, vocab=vocab, seq_len=c["max_position_embeddings"], activation=c["hidden_act"],
                     gated_mlp=True, norm="rmsnorm", attention_dropout=c["attention_dropout"], hidden_dropout=0.0,
                     parameters=vocab * h + layers * sum(layer) + sum(head), layer_tensors=layer,
                     embedding_tensors=(vocab * h,), head_tensors=head, tied_head=tied, head_outputs=vocab,
                     head_saved_elements=3 * h, experts=shape)
