"""`DistributedTransformerLMHead`: embeddings, a `DistributedTransformer` and a language-model head."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.tensor.styles import StyleSpec
from .module import DistributedModule
from .transformer import DistributedTransformer, check_layernorms

MASKED = -10000.0  # SMP's additive value for masked keys
IGNORE_INDEX = -100


def additive_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A 0-1 [N, S] mask, 1 where a token takes part (Hugging Face's and SMP's code's convention), as the
    layers' additive [N, 1, 1, S] one."""
    return None if mask is None else (1.0 - mask.to(dtype))[:, None, None, :] * MASKED


class DistributedTransformerLMHead(DistributedModule):
    """Word + position (+ token type) embeddings → dropout → `DistributedTransformer` → a bias-free head tied
    to the word embeddings (`add_lm_head`).

    `forward((input_ids, attention_mask, token_type_ids, position_ids, labels))`, with
    `add_cross_attention` `forward((input_ids, attention_mask, token_type_ids, position_ids, cross_states,
    cross_mask, labels))` (SMP's documentation lists `cross_states` twice; that 8-tuple is taken too).
    Any of them but `input_ids` may be None. `attention_mask` and `cross_mask` are 0-1 [N, S] with 1 where
    a token takes part — what SMP's code reads, and Hugging Face tokenizers give (SMP's page says the
    opposite). Returns the logits, or `(loss, logits)` with `labels`: mean cross-entropy of each next token.

    `distribute_embedding=True` (SMP's `tensor_parallelism`/`model_creation` option) splits the word
    embedding and the head over the vocabulary; by default only the transformer is split.

    Options SMP took for GPT-J without documenting them: `use_positional_embedding=False` leaves out the
    position embedding (with `rotary_dim` the layers turn queries and keys by position instead, and the
    positions go to them), `tie_input_output_embedding=False` gives the head its own weight,
    `use_lm_head_bias` a bias (untied only), `embedding_dropout_prob` the embeddings' dropout (default
    `hidden_dropout_prob`). The layers take the rest (transformer.py).
    """

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096, vocab_size: int = 30522,
                 num_positions: int = 1024, attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5, num_token_types: int = 0,
                 causal_mask_size: Optional[int] = None, add_cross_attention: bool = False, add_lm_head: bool = True,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, distribute_embedding: bool = False,
                 use_positional_embedding: bool = True, rotary_dim: int = 0, tie_input_output_embedding: bool = True,
                 use_lm_head_bias: bool = False, embedding_dropout_prob: Optional[float] = None,
                 **layer_options: Any):
        super().__init__()
        check_layernorms(type(self).__name__, pre_layernorm, post_layernorm)
        if use_lm_head_bias and tie_input_output_embedding:
            raise ValueError(f"{type(self).__name__}: use_lm_head_bias=True needs an untied head; fix: set "
                             "tie_input_output_embedding=False, or use_lm_head_bias=False")
        self.add_cross_attention, self.distribute_embedding = add_cross_attention, distribute_embedding
        self.rotary_dim = rotary_dim
        self.initializer_range, self.use_normal_initialization = initializer_range, use_normal_initialization
        self.word_embedding = nn.Embedding(vocab_size, hidden_size)
        self.position_embedding = nn.Embedding(num_positions, hidden_size) if use_positional_embedding else None
        self.token_type_embedding = nn.Embedding(num_token_types, hidden_size) if num_token_types > 0 else None
        self.dropout = nn.Dropout(hidden_dropout_prob if embedding_dropout_prob is None else embedding_dropout_prob)
        self.transformer = DistributedTransformer(
            num_layers, num_attention_heads, attention_head_size, hidden_size, intermediate_size,
            attention_dropout_prob, hidden_dropout_prob, activation, layernorm_epsilon, initializer_range,
            use_normal_initialization, causal_mask_size, add_cross_attention, pre_layernorm, post_layernorm,
            rotary_dim=rotary_dim, **layer_options)
        self._init_own_layers()
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=use_lm_head_bias) if add_lm_head else None
        if self.lm_head is not None and tie_input_output_embedding:
            self.lm_head.weight = self.word_embedding.weight
        elif self.lm_head is not None and use_normal_initialization:
            self._init_weights(self.lm_head)

    def _styles(self) -> dict[str, StyleSpec]:
        if not self.distribute_embedding:
            return {}
        return {"word_embedding": "vocab", **({"lm_head": "vocab_head"} if self.lm_head is not None else {})}

    def forward(self, inputs: tuple) -> Any:
        if not self.add_cross_attention:
            input_ids, attention_mask, token_type_ids, position_ids, labels = inputs
        elif len(inputs) == 8:
            input_ids, attention_mask, token_type_ids, position_ids, cross_states, _, cross_mask, labels = inputs
        else:
            input_ids, attention_mask, token_type_ids, position_ids, cross_states, cross_mask, labels = inputs
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = self.word_embedding(input_ids)
        if self.position_embedding is not None:
            hidden = hidden + self.position_embedding(position_ids)
        if token_type_ids is not None:
            if self.token_type_embedding is None:
                raise ValueError(f"{type(self).__name__}: token_type_ids given but num_token_types=0; "
                                 "fix: build it with num_token_types > 0, or pass token_type_ids=None")
            hidden = hidden + self.token_type_embedding(token_type_ids)
        hidden = self.dropout(hidden)
        mask = additive_mask(attention_mask, hidden.dtype)
        if self.add_cross_attention:
            hidden = self.transformer((hidden, cross_states, mask, additive_mask(cross_mask, hidden.dtype)))[0]
        else:
            positions = (position_ids,) if self.rotary_dim else ()
            hidden = self.transformer((hidden, mask, *positions))[0]
        if self.lm_head is None:
            return hidden
        logits = self.lm_head(hidden)
        if labels is None:
            return logits
        # The label of each position is the next token; the last position has none.
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        # In fp32, as Hugging Face's models compute it: half-precision logits lose the loss's small differences.
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX), logits
