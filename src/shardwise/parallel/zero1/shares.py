"""ZeRO-1's rules on tensor sizes alone: which rank owns each parameter, how gradients and parameters are bucketed.

Pure Python, so the planner follows the runtime by calling the same rules
(optimizer_state.py, gradient_buckets.py and parameter_broadcasts.py apply them to real parameters).
"""

from __future__ import annotations

import heapq

BUCKET_BYTES = 25 * 2 ** 20  # fp32 gradients per reduce, stored parameters per broadcast bucket (DDP's bucket_cap_mb)
IN_FLIGHT = 2  # reduces pending at once: one on the link while the next is queued behind it


def assign_owners(sizes: list[float], ranks: int) -> list[int]:
    """Owner rank of each parameter: largest first, each to the least-loaded rank (ties: lowest rank)."""
    loads = [(0.0, rank) for rank in range(ranks)]
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, owner = heapq.heappop(loads)
        owners[index] = owner
        heapq.heappush(loads, (load + sizes[index], owner))
    return owners


def fill_buckets(sizes: list[float], owners: list[int], bucket_bytes: float) -> list[tuple[int, list[int]]]:
    """(owner, indices) of each bucket, in the order they fill when gradients arrive in the order of `sizes`:
    an owner's bucket closes once it holds `bucket_bytes` of fp32, the rest when its last tensor arrives."""
    open_: dict[int, list[int]] = {}
    held: dict[int, float] = {}
    filled: list[tuple[int, list[int]]] = []
    for index, (size, owner) in enumerate(zip(sizes, owners)):
        open_.setdefault(owner, []).append(index)
        held[owner] = held.get(owner, 0.0) + 4 * size
        if held[owner] >= bucket_bytes:
            filled.append((owner, open_.pop(owner)))
            held[owner] = 0.0
    filled += open_.items()
    return sorted(filled, key=lambda bucket: bucket[1][-1])


def consecutive_buckets(nbytes: list[float], bucket_bytes: float) -> list[list[int]]:
    """Indices of each bucket of consecutive tensors of `nbytes` bytes: a bucket closes once it holds
    `bucket_bytes` (so a larger tensor is a bucket of its own)."""
    buckets: list[list[int]] = [[]]
    held = 0.0
    for index, size in enumerate(nbytes):
        buckets[-1].append(index)
        held += size
        if held >= bucket_bytes:
            buckets.append([])
            held = 0.0
    return [bucket for bucket in buckets if bucket]
