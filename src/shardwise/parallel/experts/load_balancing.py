"""The router's load-balancing loss over the whole global batch, as one process computes it.

The Switch-Transformer loss of Mixtral, Qwen-MoE and OLMoE is E · Σ_e f_e · P_e, with
f_e the share of top-k picks that chose expert e and P_e its mean router probability,
both over every token of the batch. Each data-parallel rank sees only its own
tokens, and the product of per-rank means is not the mean of products, so the ranks'
losses would not add up to one process's. Here the counts, the probability sums and
the token count are summed over the data group before the product. The probability
sum's all-reduce sums gradients in backward too: each rank's loss holds the global
term, so its own tokens' share comes back once per rank, and data parallelism's mean
over the ranks leaves exactly one process's gradient.

Hugging Face models call a module-level `load_balancing_loss_func` from their own
modeling module; `use_global_load_balancing` has the model's forward call this one there.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ...torch_internals import all_reduce_sum

_FUNCTION = "load_balancing_loss_func"


class _SumOverGroup(torch.autograd.Function):
    """Sum over `group`; the backward sums the incoming gradients over `group` as well."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_reduce_sum(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_sum(grad.contiguous(), ctx.group), None


def load_balancing_loss(router_logits: Optional[tuple[torch.Tensor, ...]], num_experts: int, top_k: int = 2,
                        attention_mask: Optional[torch.Tensor] = None, *,
                        group: dist.ProcessGroup) -> torch.Tensor | int:
    """Hugging Face's load-balancing loss (same arguments) over every token of the ranks in `group`."""
    if router_logits is None or not isinstance(router_logits, tuple):
        return 0
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        weights = torch.nn.functional.softmax(logits.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        mask = (torch.ones(weights.shape[0], dtype=torch.float32, device=device) if attention_mask is None
                else attention_mask.reshape(-1).to(device=device, dtype=torch.float32))
        counts = counts.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        probabilities = probabilities + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + mask.sum()
    counts, rows = all_reduce_sum(counts, group), all_reduce_sum(rows, group)
    probabilities = _SumOverGroup.apply(probabilities, group)
    return torch.sum((counts / rows) * (probabilities / rows)) * num_experts


def use_global_load_balancing(model: nn.Module, group: dist.ProcessGroup) -> bool:
    """Have `model`'s forward compute its load-balancing loss over the ranks of `group` (the ranks whose batches
    make up the global batch). False when its modeling module defines no such loss."""
    module = sys.modules.get(type(model).__module__)
    original = getattr(module, _FUNCTION, None)
    if original is None:
        return False

    def global_loss(*args, **kwargs):
        return load_balancing_loss(*args, **kwargs, group=group)

    # Swapped in for the model's own forward only: other models of the same family keep theirs.
    model.register_forward_pre_hook(lambda *_: setattr(module, _FUNCTION, global_loss))
    model.register_forward_hook(lambda *_: setattr(module, _FUNCTION, original), always_call=True)
    return True
