"""Never silently wrong: every pair of axis values users combine, trained against one plain process.

The axes (tests/combinations.py): layout (DDP, ZeRO-1/2/3, ZeRO-3 with hpZ, MiCS, TP, TP × sharded,
PP, PP × TP × DP, sequence parallelism), precision, gradient clipping, activation
checkpointing, the optimizer built before or after the model, a save and resume
(through an extra step that must leave no trace) part way, what goes to host memory
(nothing, the optimizer's states, or checkpointed regions' inputs), and the model
family (GPT-2 with its fused attention, Llama, BERT with its tied head, a plain
`nn.Module`). A pairwise covering array picks a few dozen rows that together hold
every pair of values. For each row, the validation `check-config` runs decides:

- accepted: the seed's loop trains three steps with the replica check on every
  step (any replicated parameter differing between its holders stops the run), and
  the mean loss per step, the clip norm on every rank and every whole parameter
  match one plain fp32 process within the precision's tolerance;
- refused: `init` refuses it with a `ConfigError` naming the problem.

Rows the matrix once found wrong (`REGRESSIONS`) run besides the covering array, and so do
a few rows of layout variants (`VARIANTS`: MiCS with its cross-group all-reduce in bf16,
compared within that reduction's own tolerance; the module-graph pipeline cut with two stages
per rank and with tensor-parallel stages; context parallelism, ring under DDP, all-to-all under ZeRO-3, with
tensor and sequence parallelism and with pipeline stages, whose attention splits the causal text families; expert
parallelism under ZeRO-3, beside tensor parallelism, in pipeline stages and with context parallelism, which splits
the experts of a Mixtral, the mixture-of-experts family; ZeRO-1's microbatches accumulated in fp32 on each rank
and reduced once a step, alone and in pipeline stages).

`python bench/combinations.py` runs the full product and writes docs/combinations.md.
"""

from __future__ import annotations

import pytest

from combinations import (AXES, REGRESSIONS, VARIANT_ROWS, compare, config_for, init_only, name_of, pairwise, product,
                          train_combination, within_tolerance)
from shardwise.config import ConfigError
from shardwise.testing import DistributedTestError, run_distributed
from shardwise.topology import Cluster
from shardwise.config.layout import validate

ROWS = pairwise(AXES)
FOUND = [dict(zip(AXES, values)) for values in REGRESSIONS]
VARIANT = [dict(zip(AXES, values)) for values in VARIANT_ROWS]


def test_the_covering_array_holds_every_pair_in_a_few_dozen_rows():
    names = list(AXES)
    pairs = {(a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1:] for va in AXES[a] for vb in AXES[b]}
    covered = {(a, row[a], b, row[b]) for row in ROWS for i, a in enumerate(names) for b in names[i + 1:]}
    assert covered == pairs
    assert len(ROWS) < 65 < len(product(AXES))
    assert ROWS == pairwise(AXES)  # deterministic: the same rows on every run


def refusal(combo: dict) -> str | None:
    world, per_node, config = config_for(combo)
    try:
        validate(config, Cluster(world // per_node, per_node))
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("combo", ROWS + FOUND + VARIANT, ids=[name_of(row) for row in ROWS]
                         + [f"found-{name_of(row)}" for row in FOUND] + [name_of(row) for row in VARIANT])
def test_combination_trains_the_same_math_or_is_refused_at_init(combo):
    world, per_node, _ = config_for(combo)
    refused = refusal(combo)
    if refused is not None:
        with pytest.raises(DistributedTestError) as err:
            run_distributed(init_only, world, combo, nproc_per_node=per_node)
        assert refused.splitlines()[-1].strip() in str(err.value)
        return
    ranks = run_distributed(train_combination, world, combo, nproc_per_node=per_node, timeout=300)
    worst = compare(combo, ranks)
    assert within_tolerance(combo, worst) is None, f"{name_of(combo)}: {within_tolerance(combo, worst)}"
