"""Which submodules FSDP2 shards as units of their own (parallel/sharding/units.py)."""

from __future__ import annotations

from torch import nn

import tiny_models
from shardwise.parallel.sharding.units import sharding_units


def _units(model: nn.Module) -> list[str]:
    path = {id(module): name for name, module in model.named_modules()}
    return [path[id(unit)] for unit in sharding_units(model, min_params=10_000_000)]


def test_an_embedding_and_a_head_beside_the_blocks_are_units_in_forward_order():
    # embedding 4096 and head 4224 parameters, blocks 4256 each: more than half a block each
    assert _units(tiny_models.TinyStack()) == ["embed", "blocks.0", "blocks.1", "head"]


def test_a_tied_embedding_stays_with_the_root():
    assert _units(tiny_models.tiny_gpt2(layers=2)) == ["transformer.h.0", "transformer.h.1"]


def test_modules_under_half_a_block_stay_with_the_root():
    model = tiny_models.TinyStack()
    model.head = nn.Linear(32, 8)  # 264 parameters
    assert _units(model) == ["embed", "blocks.0", "blocks.1"]
