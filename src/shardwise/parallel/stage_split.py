"""How a run of blocks is dealt to pipeline stages (contiguous, the costliest stage as cheap as it can be) and the
stages to pipeline ranks.

Pure Python on costs alone, so the planner predicts the cut the runtime makes (parallel/pipeline/partition.py
and graph_cut.py call it on a real model's parameters; planner/bubbles.py on a model spec's).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence


def min_max_split(costs: list[int], stages: int, first: int, last: int, fixed: Sequence[Optional[int]]) -> list[int]:
    """Stage sizes (in blocks) minimising the costliest stage and, among the splits that do, the sum of squared
    stage costs: the stages that heavy ends (an embedding, a head) do not bound share the blocks evenly.
    `first`/`last` add to the end stages; a block with a `fixed` stage stays on it (placement.py has checked
    that every stage can still get a block)."""
    worst, _ = _best_split(costs, stages, first, last, fixed, lambda cost, rest: max(cost, rest), float("inf"))
    return _best_split(costs, stages, first, last, fixed, lambda cost, rest: cost * cost + rest, worst)[1]


def _best_split(costs: list[int], stages: int, first: int, last: int, fixed: Sequence[Optional[int]],
                combine: Callable[[int, float], float], cap: float) -> tuple[float, list[int]]:
    """The split whose stages cost at most `cap` each with the least value, a stage's cost `combine`d with the
    value of the stages after it: (that value, the stage sizes)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: least value when stages s.. cover blocks i..n-1
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[stages][n] = 0
    for s in range(stages - 1, -1, -1):
        extra = (first if s == 0 else 0) + (last if s == stages - 1 else 0)
        for i in range(n - (stages - s) + 1):
            for j in range(i + 1, n - (stages - s - 1) + 1):
                if fixed[j - 1] not in (None, s):
                    break
                cost = prefix[j] - prefix[i] + extra
                if cost > cap:
                    break
                if s == stages - 1 and j < n or best[s + 1][j] == inf:
                    continue
                value = combine(cost, best[s + 1][j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], 0
    for s in range(stages):
        sizes.append(cut[s][i] - i)
        i = cut[s][i]
    return best[0][0], sizes


def stage_ranks(schedule: str, pp: int, stages: int) -> list[int]:
    """The pp rank of every stage: looped (stage s on rank s % pp), or V-shaped for zbv_zero_bubble (rank r runs
    stages r and 2·pp − 1 − r, so the first and the last share rank 0)."""
    if schedule == "zbv_zero_bubble":
        return [s if s < pp else 2 * pp - 1 - s for s in range(stages)]
    return [s % pp for s in range(stages)]
