"""Where context parallelism meets a model: Hugging Face attention, and a hook for a user's own module.

Hugging Face Llama, Mistral, Qwen2, GPT-2 and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE call
their attention through transformers' attention registry with the module, queries, keys and values (rotary
positions already applied from the sharded `position_ids`), so registering one function there splits them all. A
user's module does the same by calling `attention(self, q, k, v)` in place of `F.scaled_dot_product_attention` and
marking its class with `@context_parallel_attention`: outside context parallelism it is plain SDPA.

    @context_parallel_attention
    class MyAttention(nn.Module):
        def forward(self, x, document_ids=None):
            q, k, v = ...                                    # (batch, heads, local seq, head dim)
            return attention(self, q, k, v, documents=document_ids)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.parallel.context import documents as docs
from shardwise.parallel.context.all_to_all import all_to_all_attention
from shardwise.parallel.context.ring import ring_attention

# Each calls its attention through transformers' registry, from a module with `layer_idx` and `is_causal`
HF_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
REGISTRY_NAME = "shardwise_context_parallel"
_SETTINGS = "context_parallel"  # the attribute each split attention module carries
_USER_CLASSES: set[type] = set()

Mode = Literal["ring", "all_to_all"]


@dataclass(frozen=True)
class ContextSettings:
    """How one attention module splits: the group its sequence is split over, and the mode."""

    group: dist.ProcessGroup
    mode: Mode


def context_parallel_attention(cls: type) -> type:
    """Mark a module class whose forward calls `attention(self, ...)`: context parallelism may split it."""
    _USER_CLASSES.add(cls)
    return cls


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
              scale: float | None = None, causal: bool = True, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Attention (batch, heads, seq, dim) as `module` is set up: over the whole sequence of its context-parallel
    group when split, plain SDPA otherwise; `documents` (batch, seq) keeps packed documents apart."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    settings: ContextSettings | None = getattr(module, _SETTINGS, None)
    if settings is None:
        allowed = None if documents is None else docs.mask(documents, documents, causal)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                              is_causal=causal and allowed is None, scale=scale, enable_gqa=key.shape[1] != query.shape[1])
    device = query.device.type
    # As SDPA does under autocast: attention in the autocast dtype (rotary may have left keys in fp32)
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    query, key, value = (t.to(dtype) for t in (query, key, value))
    split = ring_attention if settings.mode == "ring" else all_to_all_attention
    return split(query, key, value, settings.group, scale=scale, causal=causal, documents=documents)


def _hugging_face_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            document_ids: torch.Tensor | None = None, sliding_window: int | None = None,
                            **_: object) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; the model's own mask is for local positions and is not used."""
    if dropout:
        raise ValueError(f"attention dropout {dropout} under context parallelism: set the model's attention "
                         "dropout to 0 (each rank would drop different weights than one process)")
    settings: ContextSettings | None = getattr(module, _SETTINGS, None)
    window = sliding_window or getattr(module, "sliding_window", None)
    whole = query.shape[2] * (dist.get_world_size(settings.group) if settings else 1)
    if window and window < whole:  # a window as long as the sequence or longer masks nothing
        raise ValueError(f"sliding-window attention of {window} tokens under context parallelism, which attends over "
                         f"the whole {whole}-token sequence: set the model's sliding_window to None (or at least the "
                         "sequence length), or context_parallel_degree to 1")
    out = attention(module, query, key, value, scale=scaling, causal=getattr(module, "is_causal", True),
                    documents=document_ids)
    return out.transpose(1, 2), None  # transformers expects (batch, seq, heads, dim)


def _hugging_face_family(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def _heads(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)


def unsplittable_reason(model: nn.Module, mode: Mode = "ring", degree: int = 1, tensor_parallel: int = 1) -> str | None:
    """Why context parallelism of `degree` in `mode` cannot split `model`'s attention, or None if it can; under
    tensor parallelism of `tensor_parallel` each rank holds that share of the heads."""
    family = _hugging_face_family(model)
    if family not in HF_FAMILIES and not any(type(m) in _USER_CLASSES for m in model.modules()):
        kind = f"Hugging Face model type {family!r}" if family else f"model {type(model).__name__}"
        return (f"context parallelism cannot split the attention of {kind}: it splits Hugging Face "
                f"{', '.join(HF_FAMILIES)} attention, and a module class marked @context_parallel_attention whose "
                "forward calls shardwise.parallel.context.attention")
    heads = _heads(model)
    if mode == "all_to_all" and heads and (heads // tensor_parallel) % degree:
        held = f"{heads}" if tensor_parallel == 1 else \
            f"{heads // tensor_parallel} per tensor-parallel rank ({heads} over tensor_parallel_degree {tensor_parallel})"
        return (f"context_parallel_mode all_to_all splits attention heads over context_parallel_degree {degree}, "
                f"and {type(model).__name__} has {held}: choose a degree dividing {heads // tensor_parallel}, or "
                "mode ring")
    return None


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, mode: Mode,
                           tensor_parallel: int = 1) -> nn.Module:
    """Split every attention of `model` (its heads already split over `tensor_parallel` ranks) over `group`; feed
    it `shard_batch`'s inputs and train on `sequence_loss`."""
    reason = unsplittable_reason(model, mode, dist.get_world_size(group), tensor_parallel)
    if reason:
        raise ValueError(reason)
    settings = ContextSettings(group, mode)
    if _hugging_face_family(model) in HF_FAMILIES:
        from transformers import AttentionInterface

        AttentionInterface.register(REGISTRY_NAME, _hugging_face_attention)
        model.set_attn_implementation(REGISTRY_NAME)
        split = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    else:
        split = [m for m in model.modules() if type(m) in _USER_CLASSES]
    for module in split:
        setattr(module, _SETTINGS, settings)
    return model
