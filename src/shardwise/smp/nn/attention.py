"""`DistributedAttentionLayer`: SMP's attention block — attention, projection, dropout, residual, layer norm.

The math is that of SMP's reference implementation, with its library's residual:
the block adds its input back in every case (pre- or post-layer-norm), so a
pre-layer-norm stack (GPT-2) is `x + attention(norm(x))` and a post-layer-norm one
(BERT) `norm(x + attention(x))`. Split over the `tp` axis, each rank computes its
`num_attention_heads / tp` heads: query, key and value are column-parallel, fed one
shared input (`shared_input`, the plan's `fan_out`: one all-reduce backward), and
`dense` is row-parallel (one all-reduce forward).

Options SMP took for GPT-J without documenting them: `rotary_dim` turns the first
`rotary_dim` dims of each head's query and key by GPT-J's rotary embedding (per
head, so a rank holding whole heads applies it alone), `use_qkv_bias` and
`use_attn_dense_bias` drop the projections' biases, and `add_residual=False`
leaves the residual to a parallel layer that adds one for attention and MLP together.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...parallel.tensor.state import TP_AXIS
from ...parallel.tensor.styles import StyleSpec
from .functional import attention, rotary_embedding
from .module import DistributedModule, ignore_unknown

class DistributedAttentionLayer(DistributedModule):
    """See the module docstring and SMP's documentation for the arguments.

    `forward((hidden_states, attention_mask))`, or `forward((hidden_states,
    cross_states, attention_mask))` with `cross_attention`: `attention_mask` is
    additive, [N, 1, 1, S] (of the keys: S_2 with cross attention). Returns one tensor.
    `use_alibi` adds ALiBi biases (slopes 2^(-alibi_bias_max·h/heads)) to the scores.
    With `rotary_dim`, `forward((hidden_states, attention_mask, position_ids))` takes the tokens' positions,
    [N or 1, S] (default 0 … S − 1).
    """

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32, hidden_size: int = 1024,
                 attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, cross_attention: bool = False,
                 causal_mask_size: Optional[int] = None, pre_layernorm: bool = False, post_layernorm: bool = True,
                 use_alibi: bool = False, alibi_bias_max: int = 8, rotary_dim: int = 0, use_qkv_bias: bool = True,
                 use_attn_dense_bias: bool = True, add_residual: bool = True, **unused: Any):
        super().__init__()
        ignore_unknown(type(self).__name__, unused)
        if rotary_dim and (cross_attention or rotary_dim % 2 or rotary_dim > attention_head_size):
            raise ValueError(f"{type(self).__name__}: rotary_dim={rotary_dim} does not fit; fix: give self-attention "
                             f"an even rotary_dim of at most attention_head_size={attention_head_size}, or 0")
        self.rotary_dim, self.add_residual = rotary_dim, add_residual
        self.num_attention_heads, self.attention_head_size = num_attention_heads, attention_head_size
        self.cross_attention, self.causal_mask_size = cross_attention, causal_mask_size
        self.use_alibi, self.alibi_bias_max = use_alibi, alibi_bias_max
        self.initializer_range, self.use_normal_initialization = initializer_range, use_normal_initialization
        width = num_attention_heads * attention_head_size
        self.query, self.key, self.value = (nn.Linear(hidden_size, width, bias=use_qkv_bias) for _ in range(3))
        self.shared_input = nn.Identity()  # where query/key/value (key/value across) read one input
        self.dense = nn.Linear(width, hidden_size, bias=use_attn_dense_bias)
        self.dropout1, self.dropout2 = nn.Dropout(attention_dropout_prob), nn.Dropout(hidden_dropout_prob)
        self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if post_layernorm else None
        self._init_own_layers()

    def _styles(self) -> dict[str, StyleSpec]:
        return {"shared_input": "fan_out", "query": "colwise", "key": "colwise", "value": "colwise",
                "dense": "rowwise"}

    def _dims(self) -> dict[str, int]:
        return {"num_attention_heads": self.num_attention_heads}

    def forward(self, inputs: tuple) -> torch.Tensor:
        if self.cross_attention:
            hidden_states, cross_states, attention_mask = inputs
        else:
            hidden_states, attention_mask, *positions = inputs
        x = hidden_states if self.pre_layernorm is None else self.pre_layernorm(hidden_states)
        if self.cross_attention:
            query, source = self.query(x), self.shared_input(cross_states)
        else:
            source = self.shared_input(x)
            query = self.query(source)
        key, value = self.key(source), self.value(source)
        query, key, value = (self._heads(t) for t in (query, key, value))
        if self.rotary_dim:
            position_ids = positions[0] if positions else torch.arange(query.shape[-2], device=query.device)[None]
            query, key = (rotary_embedding(t, position_ids, self.rotary_dim) for t in (query, key))
        causal = self.causal_mask_size is not None and not self.cross_attention
        if causal and query.shape[-2] > self.causal_mask_size:
            raise ValueError(f"{type(self).__name__}: sequence length {query.shape[-2]} exceeds causal_mask_size "
                             f"{self.causal_mask_size}; fix: raise causal_mask_size to the longest sequence")
        mask = attention_mask
        if self.use_alibi:
            alibi = self._alibi(query.shape[1], key.shape[-2], query)
            mask = alibi if mask is None else mask + alibi
        dropout = self.dropout1.p if self.training else 0.0
        context = attention(query, key, value, mask, causal, self.attention_head_size ** -0.5, dropout)
        output = self.dropout2(self.dense(context.transpose(1, 2).flatten(2)))
        if self.add_residual:
            output = output + hidden_states
        return output if self.layernorm is None else self.layernorm(output)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """[N, S, local heads × head size] → [N, local heads, S, head size] (a rank holds its heads' columns)."""
        return t.unflatten(-1, (-1, self.attention_head_size)).transpose(1, 2)

    def _alibi(self, local_heads: int, key_len: int, like: torch.Tensor) -> torch.Tensor:
        """ALiBi biases of this rank's heads, [local heads, 1, key_len]; a shift per query row (it leaves the
        softmax alone) makes them SMP's `slope · (j − (S − 1))`."""
        first = self._first_head(local_heads)
        heads = torch.arange(first + 1, first + local_heads + 1, device=like.device, dtype=torch.float32)
        slopes = torch.pow(2.0, -heads * (self.alibi_bias_max / self.num_attention_heads))
        distance = torch.arange(1 - key_len, 1, device=like.device, dtype=torch.float32)
        return (slopes[:, None, None] * distance).to(like.dtype)

    def _first_head(self, local_heads: int) -> int:
        # Split over the `tp` axis, rank r holds heads [r·local, (r+1)·local): the column split of `query`.
        weight = self.query.weight
        if not isinstance(weight, DTensor) or TP_AXIS not in (weight.device_mesh.mesh_dim_names or ()):
            return 0
        return weight.device_mesh.get_local_rank(TP_AXIS) * local_heads
