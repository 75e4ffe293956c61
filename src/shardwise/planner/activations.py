"""Activation bytes a rank keeps for backward, counted tensor by tensor from what PyTorch saves.

The count follows Korthikanti et al. ("Reducing Activation Recomputation in Large
Transformer Models", 2022) but per saved tensor, so it also holds for fp32, for
HF's Python activations (GELU-tanh saves five ffn-sized tensors) and for the
attention kernel in use. Tensor parallelism (Megatron, no sequence parallelism)
shards everything between the column- and row-parallel linears; norms, their
inputs and residual dropout masks stay replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import PlanError
from .hardware import Kernels
from .spec import ModelSpec

# ffn-sized tensors an activation function saves besides its output (which the next linear keeps).
_ACTIVATION_SAVES = {"gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1, "swish": 1, "relu": 0,
                     "gelu_new": 4, "quick_gelu": 2}
_FP32 = 4
CHECKPOINTING = {"none": 0, "per_layer": 1, "group_2": 2}  # strategy → blocks recomputed together


def _mlp_tensors(spec: ModelSpec) -> int:
    """ffn-sized tensors the MLP keeps: activation's own + its output (+ up and gate·up when gated)."""
    if spec.activation not in _ACTIVATION_SAVES:
        raise PlanError(f"model {spec.name!r}: unknown activation {spec.activation!r}; "
                        f"the planner knows {', '.join(sorted(_ACTIVATION_SAVES))}")
    return _ACTIVATION_SAVES[spec.activation] + (3 if spec.gated_mlp else 1)


def _attention_bytes(spec: ModelSpec, seq: int, dtype_bytes: int, mask_bytes: int, kernels: Kernels) -> float:
    """Per token: Q, K, V, the attention output, and the kernel's own state."""
    head_dim = spec.hidden // spec.heads
    qkv_out = (2 * spec.heads + 2 * spec.kv_heads) * head_dim * dtype_bytes
    dropout = spec.attention_dropout > 0
    if kernels.flash_attention and (kernels.flash_attention_dropout or not dropout):
        return qkv_out + spec.heads * _FP32              # + log-sum-exp per head
    probs = spec.heads * seq                             # the math path keeps the s × s probabilities
    return qkv_out + probs * dtype_bytes + (probs * (mask_bytes + dtype_bytes) if dropout else 0)


@dataclass(frozen=True)
class BlockActivations:
    """Bytes per token one transformer block keeps, split by how tensor parallelism treats them."""

    replicated: float
    sharded: float

    def per_rank(self, tp: int) -> float:
        return self.replicated + self.sharded / tp


def block_activations(spec: ModelSpec, seq: int, dtype_bytes: int, kernels: Kernels = Kernels()) -> BlockActivations:
    """What one block keeps per token without checkpointing."""
    mask = kernels.dropout_mask_bytes or dtype_bytes
    h = spec.hidden
    # Two norms: input and output each (RMSNorm in HF also keeps its normalised fp32 product),
    # plus their per-token statistics (mean and rstd, or rstd only).
    norm_tensors, norm_stats = (3, 1) if spec.norm == "rmsnorm" else (2, 2)
    replicated = 2 * (norm_tensors * h * dtype_bytes + norm_stats * _FP32)
    if spec.hidden_dropout > 0:
        replicated += 2 * h * mask                       # after attention and after the MLP
    sharded = _attention_bytes(spec, seq, dtype_bytes, mask, kernels) + _mlp_tensors(spec) * spec.ffn * dtype_bytes
    return BlockActivations(replicated, sharded)


def edge_activations(spec: ModelSpec, dtype_bytes: int, kernels: Kernels = Kernels()) -> tuple[float, float]:
    """(first stage, last stage) bytes per token outside the blocks, before tensor parallelism.

    The head keeps its logits and the fp32 log-softmax the loss computes from them;
    a vocabulary-parallel head shards both, so callers divide the logits part by tp.
    """
    mask = kernels.dropout_mask_bytes or dtype_bytes
    first = spec.embedding_saved_elements * dtype_bytes + (spec.hidden * mask if spec.hidden_dropout > 0 else 0)
    last = spec.head_saved_elements * dtype_bytes
    return first, last


def logits_bytes(spec: ModelSpec, dtype_bytes: int) -> float:
    """Per token: logits in the compute dtype plus the loss's fp32 log-softmax."""
    return spec.head_outputs * (dtype_bytes + _FP32)


@dataclass(frozen=True)
class ActivationMemory:
    device: float      # bytes kept on the device at the peak
    host: float = 0.0  # bytes offloaded to host memory


def rank_activations(spec: ModelSpec, *, seq: int, micro_batch: int, dtype_bytes: int, tp: int, pp: int,
                     in_flight: int, checkpointing: str, offload: bool = False, loading_horizon: int = 4,
                     kernels: Kernels = Kernels()) -> ActivationMemory:
    """Peak activation bytes on the busiest pipeline stage.

    Stage 0 keeps `in_flight` microbatches (1F1B, capped by active_microbatches); the
    last stage keeps one. Checkpointing keeps each group's input and recomputes one
    group of one microbatch at a time; offload moves the kept inputs to the host
    except the `loading_horizon` groups prefetched for backward.
    """
    tokens = micro_batch * seq
    block = block_activations(spec, seq, dtype_bytes, kernels).per_rank(tp) * tokens
    layers = spec.stage_layers(pp)
    group = CHECKPOINTING[checkpointing]
    stored, host, once = float(layers * block), 0.0, 0.0
    if group:
        groups = math.ceil(layers / group)
        group_input = spec.hidden * dtype_bytes * tokens
        stored, once = groups * group_input, min(group, layers) * block   # recompute: one group at a time
        if offload:
            stored, host, once = 0.0, stored, once + min(groups, loading_horizon) * group_input
    first, last = edge_activations(spec, dtype_bytes, kernels)
    first, last = first * tokens, (last + logits_bytes(spec, dtype_bytes) / tp) * tokens
    if pp == 1:
        return ActivationMemory(stored + first + last + once, host)
    busiest = max(in_flight * (stored + first), stored + last) + once
    return ActivationMemory(busiest, in_flight * host)
