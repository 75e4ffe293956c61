"""What context parallelism costs a rank: its share of the activations, and its ring or all-to-all traffic.

Context parallelism of degree n splits every sequence over n ranks (load-balanced chunks, parallel/context/), so
a rank keeps 1/n of every activation that has a sequence dimension, and its attention reaches the rest by traffic:

- ring: the key/value block of a rank (2·b·s/n·kv_heads·head_dim elements) travels n − 1 hops forward; backward
  sends it n − 1 hops again and passes the key/value gradients (fp32, as torch's ring accumulates them) n hops.
  Each hop overlaps the attention of the block that arrived before it: only what outlasts that block is exposed.
- all-to-all: q, k, v go to heads and the output back (each rank keeps 1/n of each tensor and sends the rest), and
  backward the same for their gradients. Nothing overlaps: attention needs the whole exchange first.

Packed documents add `DOCUMENT_CHANNELS` channels to queries and keys (the ids travel with them). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Problem

DOCUMENT_CHANNELS = 2  # parallel/context/documents.py's CHANNELS
_GRADIENT_BYTES = 4  # torch's ring accumulates key/value gradients in fp32
MODES = ("ring", "all_to_all")


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


def splits(mode: str, degree: int, heads: int, seq: int) -> str | None:
    """Why `degree` cannot split this attention in `mode`, or None if it can."""
    if seq % (2 * degree):
        return f"sequence length {seq} does not split into 2 x context_parallel_degree = {2 * degree} chunks"
    if mode == "all_to_all" and heads % degree:
        return f"{heads} attention heads do not split over context_parallel_degree {degree} in all_to_all mode"
    return None


def unplanned(cp: int) -> list[Problem]:
    """The search does not yet predict context-parallel layouts' memory and time: a given one is refused, not
    predicted as if its sequences were whole."""
    if cp == 1:
        return []
    return [Problem("context_parallel_degree", cp, "the planner does not predict context parallelism yet (its "
                    "traffic and activation share are in planner/context.py, not in the memory and time model)",
                    "plan without it, and see docs/context_parallel.md for its measured effect")]
