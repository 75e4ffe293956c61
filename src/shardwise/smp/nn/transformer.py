"""SMP's transformer blocks: `DistributedTransformerOutputLayer` (the MLP), `DistributedTransformerLayer`
(attention, optional cross attention, MLP) and `DistributedTransformer` (a stack of layers).

Math as SMP's reference implementation, with its library's residuals (added in
every case, see attention.py). Layer norms: post-layer-norm blocks (BERT) normalise
each sub-block's output; pre-layer-norm blocks (GPT-2) its input; with both, each
sub-block's input is normalised and, in a `DistributedTransformer`, the last layer's
output too (GPT-2's final norm), as SMP does. Split over the `tp` axis, the MLP's
`dense1` is column-parallel and `dense2` row-parallel: one all-reduce each way.

GPT-J's layer (`parallel_attn_output`, an option SMP took without documenting it)
runs attention and MLP side by side on one layer-normed input and adds one residual:
`x + attention(norm(x)) + mlp(norm(x))`; the layer holds that norm (`pre_layernorm`)
and the one after (`layernorm`, in a stack GPT-J's final norm), its sub-blocks none.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.tensor.styles import StyleSpec
from .attention import DistributedAttentionLayer
from .module import DistributedModule, ignore_unknown, note_ineffective

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
               # Hugging Face's names of the tanh approximation GPT-2 uses
               "gelu_new": functools.partial(F.gelu, approximate="tanh"),
               "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def check_layernorms(owner: str, pre_layernorm: bool, post_layernorm: bool) -> None:
    if not (pre_layernorm or post_layernorm):
        raise ValueError(f"{owner}: at least one of pre_layernorm and post_layernorm must be True; fix: set "
                         "post_layernorm=True (BERT-style) or pre_layernorm=True (GPT-2-style)")


class DistributedTransformerOutputLayer(DistributedModule):
    """`forward(inp)`: `inp + dropout(dense2(activation(dense1(norm?(inp)))))`, layer-normed after with
    `post_layernorm`; `add_residual=False` leaves out `inp +` (a parallel layer adds it). `fp32_residual_addition`
    and `fused_bias_gelu` ask for SMP kernels; named once, no effect."""

    def __init__(self, hidden_size: int = 1024, intermediate_size: int = 4096, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, pre_layernorm: bool = False, post_layernorm: bool = True,
                 fp32_residual_addition: bool = False, fused_bias_gelu: bool = False, add_residual: bool = True,
                 **unused: Any):
        super().__init__()
        ignore_unknown(type(self).__name__, unused)
        if activation not in ACTIVATIONS:
            raise ValueError(f"{type(self).__name__}: activation={activation!r} is not supported; "
                             f"fix: use one of {', '.join(map(repr, ACTIVATIONS))}")
        note_ineffective(type(self).__name__, {
            key: why for key, value, why in (
                ("fp32_residual_addition", fp32_residual_addition, "residuals are added in the activations' dtype; "
                 "bf16 does not overflow"),
                ("fused_bias_gelu", fused_bias_gelu, "torch's linear and gelu run; torch.compile fuses them"))
            if value})
        self.intermediate_size, self.activation, self.add_residual = intermediate_size, activation, add_residual
        self.initializer_range, self.use_normal_initialization = initializer_range, use_normal_initialization
        self.dense1 = nn.Linear(hidden_size, intermediate_size)
        self.dense2 = nn.Linear(intermediate_size, hidden_size)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None
        self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if post_layernorm else None
        self._init_own_layers()

    def _styles(self) -> dict[str, StyleSpec]:
        return {"dense1": "colwise", "dense2": "rowwise"}

    def _dims(self) -> dict[str, int]:
        return {"intermediate_size": self.intermediate_size}

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = inp if self.pre_layernorm is None else self.pre_layernorm(inp)
        output = self.dropout(self.dense2(ACTIVATIONS[self.activation](self.dense1(x))))
        if self.add_residual:
            output = inp + output
        return output if self.layernorm is None else self.layernorm(output)


class DistributedTransformerLayer(DistributedModule):
    """`forward((hidden_states, attention_mask))` → `(output, attention_mask)`; with `add_cross_attention`,
    `forward((hidden_states, cross_states, attention_mask, cross_mask))` → the same tuple with the output
    first. Masks are additive, [N, 1, 1, S]. With `rotary_dim`, `(hidden_states, attention_mask, position_ids)`
    passes the positions on to the next layer too. `rotary_dim`, `use_qkv_bias` and `use_attn_dense_bias` are
    the attention's (attention.py); `parallel_attn_output` gives GPT-J's layer (module docstring).
    `fused_softmax` (SMP's kernel switch) is taken: torch's softmax runs."""

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, causal_mask_size: Optional[int] = None,
                 add_cross_attention: bool = False, pre_layernorm: bool = False, post_layernorm: bool = True,
                 use_alibi: bool = False, alibi_bias_max: int = 8, fused_softmax: bool = True,
                 fused_bias_gelu: bool = False, fp32_residual_addition: bool = False, rotary_dim: int = 0,
                 use_qkv_bias: bool = True, use_attn_dense_bias: bool = True, parallel_attn_output: bool = False,
                 **unused: Any):
        super().__init__()
        ignore_unknown(type(self).__name__, unused)
        check_layernorms(type(self).__name__, pre_layernorm, post_layernorm)
        if add_cross_attention and (parallel_attn_output or rotary_dim):
            raise ValueError(f"{type(self).__name__}: GPT-J's parallel_attn_output and rotary_dim take no cross "
                             "attention; fix: drop add_cross_attention, or those two")
        self.add_cross_attention, self.parallel_attn_output = add_cross_attention, parallel_attn_output
        sub_block = not parallel_attn_output  # whether attention and MLP hold their own norms and residuals
        self.pre_layernorm = (nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
                              if pre_layernorm and parallel_attn_output else None)
        self.shared_input = nn.Identity() if parallel_attn_output else None  # attention's and MLP's one input
        attention = dict(num_attention_heads=num_attention_heads, attention_head_size=attention_head_size,
                         hidden_size=hidden_size, attention_dropout_prob=attention_dropout_prob,
                         hidden_dropout_prob=hidden_dropout_prob, layernorm_epsilon=layernorm_epsilon,
                         initializer_range=initializer_range, use_normal_initialization=use_normal_initialization,
                         causal_mask_size=causal_mask_size, pre_layernorm=pre_layernorm and sub_block,
                         post_layernorm=post_layernorm and not pre_layernorm and sub_block, use_alibi=use_alibi,
                         alibi_bias_max=alibi_bias_max, use_qkv_bias=use_qkv_bias,
                         use_attn_dense_bias=use_attn_dense_bias, add_residual=sub_block)
        self.attention = DistributedAttentionLayer(rotary_dim=rotary_dim, **attention)
        self.cross_attention = (DistributedAttentionLayer(cross_attention=True, **attention)
                                if add_cross_attention else None)
        self.output = DistributedTransformerOutputLayer(
            hidden_size=hidden_size, intermediate_size=intermediate_size, hidden_dropout_prob=hidden_dropout_prob,
            activation=activation, layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization, pre_layernorm=pre_layernorm and sub_block,
            post_layernorm=post_layernorm and sub_block, fp32_residual_addition=fp32_residual_addition,
            fused_bias_gelu=fused_bias_gelu, add_residual=sub_block)
        self.layernorm = (nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
                          if post_layernorm and parallel_attn_output else None)

    def _styles(self) -> dict[str, StyleSpec]:
        # Side by side, attention and MLP add their input gradients before one all-reduce.
        return {"shared_input": "fan_out"} if self.parallel_attn_output else {}

    def forward(self, inputs: tuple) -> tuple:
        if self.add_cross_attention:
            hidden_states, cross_states, attention_mask, cross_mask = inputs
            attended = self.attention((hidden_states, attention_mask))
            output = self.output(self.cross_attention((attended, cross_states, cross_mask)))
            return output, cross_states, attention_mask, cross_mask
        hidden_states, attention_mask, *positions = inputs
        if not self.parallel_attn_output:
            return self.output(self.attention((hidden_states, attention_mask, *positions))), attention_mask, *positions
        x = self.shared_input(hidden_states if self.pre_layernorm is None else self.pre_layernorm(hidden_states))
        output = self.attention((x, attention_mask, *positions)) + self.output(x) + hidden_states  # GPT-J's order
        output = output if self.layernorm is None else self.layernorm(output)
        return output, attention_mask, *positions


class DistributedTransformer(DistributedModule):
    """`num_layers` `DistributedTransformerLayer`s in `seq_layers`, run one after another; takes and returns
    the layers' tuples. With both `pre_layernorm` and `post_layernorm`, only the last layer's output is
    layer-normed after (see the module docstring)."""

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: Optional[int] = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, **layer_options: Any):
        super().__init__()
        check_layernorms(type(self).__name__, pre_layernorm, post_layernorm)
        shared = dict(num_attention_heads=num_attention_heads, attention_head_size=attention_head_size,
                      hidden_size=hidden_size, intermediate_size=intermediate_size,
                      attention_dropout_prob=attention_dropout_prob, hidden_dropout_prob=hidden_dropout_prob,
                      activation=activation, layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
                      use_normal_initialization=use_normal_initialization, causal_mask_size=causal_mask_size,
                      add_cross_attention=add_cross_attention, pre_layernorm=pre_layernorm, **layer_options)
        self.seq_layers = nn.Sequential(*(
            DistributedTransformerLayer(post_layernorm=post_layernorm and (not pre_layernorm or i == num_layers - 1),
                                        **shared)
            for i in range(num_layers)))

    def forward(self, inputs: tuple) -> tuple:
        return self.seq_layers(inputs)
