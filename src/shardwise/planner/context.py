"""What context parallelism costs a rank: its share of the activations, and its ring or all-to-all traffic.

Context parallelism of degree n splits every sequence over n ranks (load-balanced chunks, parallel/context/), so
a rank keeps 1/n of every activation that has a sequence dimension, and its attention reaches the rest by traffic:

- ring: the key/value block of a rank (2·b·s/n·kv_heads·head_dim elements) travels n − 1 hops forward; backward
  sends it n − 1 hops again and passes the key/value gradients (fp32, as torch's ring accumulates them) n hops.
  Each hop overlaps the attention of the block that arrived before it: only what outlasts that block is exposed.
- all-to-all: q, k, v go to heads and the output back (each rank keeps 1/n of each tensor and sends the rest), and
  backward the same for their gradients. Nothing overlaps: attention needs the whole exchange first.

Packed documents add `DOCUMENT_CHANNELS` channels to queries and keys (the ids travel with them). Pure: no torch.

What a rank holds beyond its share of the activations (`held_bytes`), at the peak of one layer's backward:
- ring: torch's ring accumulates the query, key and value gradients in fp32; the key/value block it received, the
  copy it sends on and the send's output (three blocks), and the same three of the fp32 key/value gradients; one
  block pair's gradients. Its autograd function keeps only q, k, v, the merged output and its logsumexp for
  backward, as a flash kernel does, whatever runs a block: on the CPU the flash kernel, elsewhere plain tensor ops
  in fp32 (parallel/context/ring.py), which also hold one block pair's scores, weights and their gradients.
- all-to-all: the exchange's copies (the slices sent, those received, the reordered result) of q, k, v and the
  output, twice their size at most at once; attention itself runs SDPA as one process, over the whole sequence
  for 1/n of the heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import Problem
from .hardware import Kernels

DOCUMENT_CHANNELS = 2  # parallel/context/documents.py's CHANNELS
_GRADIENT_BYTES = 4  # torch's ring accumulates key/value gradients in fp32
MODES = ("ring", "all_to_all")
# Sequences of this many tokens or more make `shardwise plan` search context parallelism beside the layouts
# without it; below, it searches CP only when no layout without it fits (docs/planner.md).
LONG_SEQUENCE = 8192
# Model families whose attention the runtime splits (parallel/context/hooks.py: Hugging Face GPT-2, Llama, Mistral
# and Qwen2, which the planner reads as llama, and Mixtral); a traced module may call the hook itself.
SPLITTABLE_FAMILIES = ("gpt2", "llama", "mixtral")
_RING_BUFFERS = 3  # received, the copy sent on, the send's output
_SCORE_TENSORS = 4  # a plain-ops block's fp32 scores and weights, and their gradients, at most at once


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's input on one rank before the split: `batch` rows of `seq` tokens."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    element_bytes: int = 4
    documents: bool = False


def _elements(shape: AttentionShape, heads: int, seq: int, extra: int = 0) -> int:
    return shape.batch * heads * seq * (shape.head_dim + extra)


def wire_bytes(mode: str, degree: int, shape: AttentionShape) -> dict[str, float]:
    """Bytes one rank sends to others for one attention layer, forward and backward."""
    if degree == 1:
        return {"forward": 0.0, "backward": 0.0}
    local = shape.seq // degree
    extra = DOCUMENT_CHANNELS if shape.documents else 0
    if mode == "ring":
        key_value = _elements(shape, shape.kv_heads, local, extra) + _elements(shape, shape.kv_heads, local)
        hops = (degree - 1) * key_value * shape.element_bytes
        return {"forward": float(hops), "backward": float(hops + degree * key_value * _GRADIENT_BYTES)}
    if mode == "all_to_all":
        kv_heads = shape.kv_heads if shape.kv_heads % degree == 0 else shape.heads  # repeated until they split
        tensors = (_elements(shape, shape.heads, local, extra) + 2 * _elements(shape, kv_heads, local)
                   + _elements(shape, shape.heads, local))
        sent = tensors * shape.element_bytes * (degree - 1) / degree
        return {"forward": sent, "backward": sent}
    raise ValueError(f"context_parallel_mode {mode!r}: use one of {', '.join(MODES)}")


def exposed_seconds(mode: str, degree: int, shape: AttentionShape, link_bytes_per_s: float,
                    attention_seconds: float) -> float:
    """Communication time of one layer's forward and backward that attention does not hide.

    `attention_seconds` is the layer's whole attention (forward and backward) on one rank under CP."""
    sent = wire_bytes(mode, degree, shape)
    total = (sent["forward"] + sent["backward"]) / link_bytes_per_s
    if mode == "all_to_all" or degree == 1:
        return total
    # n − 1 hops forward and about 2n − 1 backward, each beside one of the n blocks' attention
    per_hop, per_block = total / (3 * degree - 2), attention_seconds / (2 * degree)
    return (3 * degree - 2) * max(0.0, per_hop - per_block)


def activation_share(degree: int) -> float:
    """The part of each sequence-long activation a rank keeps."""
    return 1.0 / degree


def splits(mode: str, degree: int, heads: int, seq: int, tp: int = 1) -> str | None:
    """Why `degree` cannot split this attention in `mode`, or None if it can (`heads` of the whole layer, of
    which a tensor-parallel rank holds 1/tp)."""
    if seq % (2 * degree):
        return f"sequence length {seq} does not split into 2 x context_parallel_degree = {2 * degree} chunks"
    if mode == "all_to_all" and heads // tp % degree:
        per_rank = " per tensor-parallel rank" if tp > 1 else ""
        return (f"{heads // tp} attention heads{per_rank} do not split over context_parallel_degree {degree} in "
                "all_to_all mode")
    return None


def layer_shape(heads: int, kv_heads: int, head_dim: int, tp: int, rows: int, seq: int,
                element_bytes: int) -> AttentionShape:
    """One attention layer's input on one rank: `rows` whole sequences before the split, the heads of one
    tensor-parallel rank (tensor parallelism splits heads and key/value heads)."""
    return AttentionShape(rows, seq, heads // tp, max(kv_heads // tp, 1), head_dim, element_bytes)


def _query_and_key_value(shape: AttentionShape, degree: int, kv_heads: int) -> tuple[int, int]:
    """Elements of the queries and of the keys and values together of one rank's share (no document channels)."""
    local = shape.seq // degree
    return _elements(shape, shape.heads, local), 2 * _elements(shape, kv_heads, local)


def held_bytes(mode: str, degree: int, shape: AttentionShape, fused_blocks: bool = True) -> float:
    """Bytes one layer's exchange holds at once beyond the activations kept for backward (module docstring);
    `fused_blocks`: the ring's blocks run a fused kernel (the CPU's), else plain fp32 tensor ops."""
    if degree == 1:
        return 0.0
    e = shape.element_bytes
    if mode == "ring":
        query, key_value = _query_and_key_value(shape, degree, shape.kv_heads)
        held = (_GRADIENT_BYTES * (query + key_value) + _RING_BUFFERS * key_value * (e + _GRADIENT_BYTES)
                + (query + key_value) * e)
        if not fused_blocks:
            local = shape.seq // degree
            held += _SCORE_TENSORS * shape.batch * shape.heads * local * local * _GRADIENT_BYTES
        return float(held)
    if mode == "all_to_all":
        kv_heads = shape.kv_heads if shape.kv_heads % degree == 0 else shape.heads
        query, key_value = _query_and_key_value(shape, degree, kv_heads)
        return float(2 * (2 * query + key_value) * e)  # q, k, v and the output
    raise ValueError(f"context_parallel_mode {mode!r}: use one of {', '.join(MODES)}")


def saved_kernels(mode: str, kernels: Kernels) -> Kernels:
    """The kernel facts that say what attention keeps for backward under context parallelism: the ring's autograd
    function keeps what a flash kernel keeps, whatever runs its blocks; all-to-all keeps what the device's SDPA
    keeps over the whole sequence for its heads."""
    return replace(kernels, flash_attention=True, flash_attention_dropout=True) if mode == "ring" else kernels


def compute_kernels(mode: str, kernels: Kernels, fused_blocks: bool) -> Kernels:
    """The kernel facts that say how attention computes: ring blocks without a fused kernel compute their scores
    as plain products, as the math path does."""
    return replace(kernels, flash_attention=False) if mode == "ring" and not fused_blocks else kernels


def fused_ring_blocks(memory_is_host: bool) -> bool:
    """Whether ring blocks run a fused kernel on this device: the CPU's flash kernel (parallel/context/ring.py's
    FUSED_KERNELS has no other)."""
    return memory_is_host


def model_problem(family: str, traced: bool, attention_dropout: float, mode: str, degree: int, heads: int, tp: int,
                  seq: int) -> Problem | None:
    """Why the runtime cannot split this model's attention `degree` ways in `mode` over sequences of `seq`
    tokens, or None if it can: its family, attention dropout (each rank would drop other weights than one
    process), the 2 × degree chunks, and under all_to_all the heads of one tensor-parallel rank."""
    if degree == 1:
        return None
    if family not in SPLITTABLE_FAMILIES and not traced:
        return Problem("context_parallel_degree", degree, f"the attention of a {family} model cannot be split "
                       "(context parallelism splits causal decoders: Hugging Face GPT-2, Llama, Mistral, Qwen2 and "
                       "Mixtral, or a module calling its hook)", "set context_parallel_degree to 1")
    if attention_dropout > 0:
        return Problem("context_parallel_degree", degree, f"the model's attention dropout {attention_dropout} does not "
                       "run under context parallelism (each rank would drop other weights than one process)",
                       "set the model's attention dropout to 0, or context_parallel_degree to 1")
    reason = splits(mode, degree, heads, seq, tp)
    if reason is None:
        return None
    if reason.startswith("sequence length"):
        fix = f"pad sequences to a multiple of {2 * degree}, or use a degree dividing half the sequence length"
    else:
        fix = f"use a degree dividing {heads // tp}, or context_parallel_mode ring"
    return Problem("context_parallel_degree", degree, reason, fix)
