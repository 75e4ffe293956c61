"""DeepSpeed's stage boundaries for a PipelineModule's layers, computed as DeepSpeed 0.19.8 computes them.

`partition_method` picks the weight of every layer and the split:

- 'uniform': layer counts, `partition_uniform` (the first `n % stages` stages get one layer more);
- 'parameters' (default): each layer's trainable parameters, `partition_balanced`;
- 'type:REGEX': 1 for each layer whose class name matches REGEX (case-insensitive), else 0, `partition_balanced`.

`partition_balanced` is DeepSpeed's dynamic programme for the linear partition
problem: among contiguous splits it picks the one whose heaviest and lightest
stages differ least, the later cut on a tie. It is ported here line for line
(pure Python instead of numpy arrays), so the boundaries are DeepSpeed's for the
same weights: `tests/test_deepspeed_pipe.py` compares them with deepspeed's own
functions where deepspeed is installed. Boundaries are a list `parts` of
`stages + 1` layer indices: stage s holds layers `parts[s]:parts[s + 1]`.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

METHODS = "'parameters', 'uniform' or 'type:REGEX'"


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's `partition_uniform`: `num_items` in `num_parts` runs whose sizes differ by one at most, the
    larger runs first."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's `partition_balanced`: the contiguous split into `num_parts` non-empty runs that minimises the
    difference between the heaviest and the lightest run."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # dp_*[i][j]: the best split of the first i weights into j runs: its heaviest and lightest run, their difference
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], run)
                min_sum = min(dp_min[k][j - 1], run)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:  # `>=`, as DeepSpeed's: on a tie the later cut wins
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = cost, max_sum, min_sum, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


def method_weights(method: Any, counts: Sequence[int], names: Sequence[str | None]) -> tuple[str, list[int] | None]:
    """(the method lower-cased, each layer's weight; None for 'uniform') for `partition_method`. Per layer,
    `counts` are its trainable parameters and `names` the class name 'type:' matches (None: matches nothing).
    A method DeepSpeed does not know, or a type no layer has, is one line."""
    if not isinstance(method, str):
        raise ValueError(f"PipelineModule: partition_method must be a string ({METHODS}), got {method!r}; "
                         "fix: pass one of those (an explicit list of boundaries is not a DeepSpeed method)")
    method = method.lower()  # as DeepSpeed does, the type's regex too
    if method == "uniform":
        return method, None
    if method == "parameters":
        return method, list(counts)
    if method.startswith("type:"):
        pattern = method.split(":")[1]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as error:
            raise ValueError(f"PipelineModule: partition_method {method!r}: {pattern!r} is not a regular "
                             f"expression ({error}); fix: give a class name or a regex over class names") from None
        weights = [1 if name is not None and regex.search(name) else 0 for name in names]
        if not any(weights):
            known = sorted({name for name in names if name is not None})
            raise ValueError(f"PipelineModule: partition_method {method!r} matches no layer's class (the layers "
                             f"are {', '.join(known)}); fix: name one of them, e.g. 'type:{known[0] if known else ''}'")
        return method, weights
    if method == "profile":  # a name DeepSpeed reserves and refuses: no such balancing exists there either
        raise ValueError(f"PipelineModule: partition_method 'profile' balances nothing in DeepSpeed either (it "
                         f"refuses it); fix: use {METHODS}")
    raise ValueError(f"PipelineModule: partition_method {method!r} is not {METHODS}; fix: use one of those")


def partition_layers(weights: list[int] | None, num_layers: int, num_stages: int) -> list[int]:
    """DeepSpeed's boundaries: uniform over the layers when `weights` is None, else balanced over `weights`."""
    if weights is None:
        return partition_uniform(num_layers, num_stages)
    return partition_balanced(weights, num_stages)
