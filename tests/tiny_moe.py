"""Tiny Hugging Face mixture-of-experts models (no downloads) and their training loss.

Four experts, two per token, two layers of hidden 16: small enough for 4 gloo ranks on
2 cores, large enough that every EP degree up to 4 sends tokens both ways. The router
outputs its logits so the causal-LM loss includes the load-balancing loss, weighted
0.1 (the models default to 0.001 or 0.01, too little for a test to notice it).
`plain_moe` is a model of plain modules whose experts class is registered with
`sw.register_experts`, as a user's would be. Qwen2-MoE's
attention key biases are frozen, for the reason tiny_models.py gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
EXPERTS, TOP_K, HIDDEN = 4, 2, 16
AUX_WEIGHT = 0.1


def tiny_moe(family: str, layers: int = 2, seed: int = 1234) -> nn.Module:
    """The same weights on every process for the same seed; dropout-free, as all four families are."""
    from transformers import (MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
    from tiny_models import SEQ, VOCAB

    common = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, max_position_embeddings=SEQ, num_experts_per_tok=TOP_K,
                  output_router_logits=True, router_aux_loss_coef=AUX_WEIGHT, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0)
    if family == "mixtral":
        config, cls = MixtralConfig(intermediate_size=2 * HIDDEN, num_local_experts=EXPERTS, **common), \
            MixtralForCausalLM
    elif family == "olmoe":
        config, cls = OlmoeConfig(intermediate_size=2 * HIDDEN, num_experts=EXPERTS, **common), OlmoeForCausalLM
    elif family == "qwen2_moe":
        config, cls = Qwen2MoeConfig(moe_intermediate_size=2 * HIDDEN, shared_expert_intermediate_size=2 * HIDDEN,
                                     intermediate_size=2 * HIDDEN, num_experts=EXPERTS, norm_topk_prob=False,
                                     **common), Qwen2MoeForCausalLM
    elif family == "qwen3_moe":
        config, cls = Qwen3MoeConfig(moe_intermediate_size=2 * HIDDEN, intermediate_size=2 * HIDDEN, head_dim=4,
                                     num_experts=EXPERTS, norm_topk_prob=True, **common), Qwen3MoeForCausalLM
    else:
        raise ValueError(f"unknown MoE family {family!r}; one of {FAMILIES}")
    torch.manual_seed(seed)
    model = cls(config)
    for name, parameter in model.named_parameters():
        if name.endswith("k_proj.bias"):
            parameter.requires_grad_(False)
    return model


def moe_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal-LM loss as the model computes it from labels (next-token cross-entropy plus the weighted
    load-balancing loss, which the model returns whenever it outputs router logits), and the load-balancing
    loss alone. The cross-entropy is taken from the logits, as the combination matrix does, so that it is one
    expression under tensor parallelism too."""
    out = model(input_ids=inputs)
    logits = out.logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets[:, 1:].flatten())
    return loss + AUX_WEIGHT * out.aux_loss, out.aux_loss


@sw.register_experts(num_experts="count")
class PlainExperts(nn.Module):
    """A user's own experts module: `count` GELU MLPs with their weights stacked along dim 0."""

    def __init__(self, count: int, hidden: int, inner: int):
        super().__init__()
        self.count = count
        self.up = nn.Parameter(torch.randn(count, inner, hidden) / hidden ** 0.5)
        self.down = nn.Parameter(torch.randn(count, hidden, inner) / inner ** 0.5)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(self.count):
            token, slot = torch.where(index == expert)
            rows = F.linear(F.gelu(F.linear(hidden[token], self.up[expert])), self.down[expert])
            out = out.index_add(0, token, rows * weights[token, slot].unsqueeze(-1))
        return out


class PlainMoE(nn.Module):
    """A residual mixture-of-experts block: a linear router picking TOP_K of EXPERTS, then the experts."""

    def __init__(self, hidden: int):
        super().__init__()
        self.router = nn.Linear(hidden, EXPERTS, bias=False)
        self.experts = PlainExperts(EXPERTS, hidden, 2 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, index = torch.topk(torch.softmax(self.router(flat), dim=-1), TOP_K, dim=-1)
        return x + self.experts(flat, index, weights).view_as(x)


class PlainMoEModel(nn.Module):
    """Not a Hugging Face model: embedding, two PlainMoE blocks, a head; `loss` is next-token cross-entropy."""

    def __init__(self, vocab: int, hidden: int = HIDDEN):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.Sequential(PlainMoE(hidden), PlainMoE(hidden))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def plain_moe(seed: int = 1234) -> PlainMoEModel:
    from tiny_models import VOCAB

    torch.manual_seed(seed)
    return PlainMoEModel(VOCAB)


def plain_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())
