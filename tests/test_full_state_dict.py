"""Whole tensors out and back in, through the strategy protocol: `full_state_dict()` on every rank, then
`load_full_state_dict()` restores the pieces each rank holds, bit for bit, in every layout."""

from __future__ import annotations

import pytest

import shardwise as sw
from shardwise.testing import run_distributed
from tiny_models import build, dataset, make_optimizer, seed_step

LAYOUTS = {
    "ddp": {},
    "zero1-bf16": {"shard_optimizer_state": True, "bf16": True},
    "zero3": {"sharded_data_parallel_degree": 4},
    "mics": {"sharded_data_parallel_degree": 2},
    "tp-sharded": {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},
    "pp": {"pipeline_parallel_degree": 2, "microbatches": 2},
}


def round_trip(config: dict) -> dict:
    """Save after one step, step again, load the save: how far the weights are from it, before and after."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step("gpt2")
    batches = list(sw.data_loader(dataset("gpt2", 2 * 2 * sw.dp_size()), batch_size=2, shuffle=False))

    def step(index: int) -> None:
        opt.zero_grad()
        train_step(model, *batches[index])
        opt.step()

    step(0)
    saved = {k: v.clone() for k, v in model.full_state_dict().items()}
    step(1)
    moved = {k: v.clone() for k, v in model.full_state_dict().items()}  # plain tensors come back as the live ones
    model.load_full_state_dict(saved)
    back = model.full_state_dict()
    distance = lambda state: max(float((state[k].float() - v.float()).abs().max()) for k, v in saved.items())  # noqa: E731
    return {"moved": distance(moved), "back": distance(back)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_whole_tensors_load_back_into_every_layout(layout):
    for result in run_distributed(round_trip, 4, LAYOUTS[layout], timeout=300):
        assert result["moved"] > 0 and result["back"] == 0
