"""Delayed parameter initialisation without pipeline stages.

The seed's config sets `delayed_parameter_initialization`; the script builds the
model inside `sw.delay_param_initialization()` (the meta device), and
`DistributedModel` materialises it: under ZeRO-2/3 and MiCS one sharding unit at
a time, right before FSDP2 shards it, so no rank ever holds the whole model —
the peak bytes MemTracker sees while `DistributedModel` builds stay near this
rank's shards plus one block — and under DDP as a whole replica. Either way every value is
what one process gets materialising the whole meta-built model with the seed
the ranks agree on, and training then matches that process step for step.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import shardwise as sw
from shardwise.parallel.materialize import materialize
from shardwise.testing import run_distributed
from tiny_models import SEED, build, dataset, make_optimizer, relative_error, seed_step, train_reference

WORLD, ROWS, STEPS, LAYERS = 4, 2, 2, 6
MODES = {
    "zero3": {"sharded_data_parallel_degree": WORLD},
    "zero2": {"zero_stage": 2, "sharded_data_parallel_degree": WORLD},
    "mics": {"sharded_data_parallel_degree": 2},
    "zero3-hpz": {"sharded_data_parallel_degree": WORLD, "zero_hpz_partition_size": 2},  # ZeRO++'s secondary groups
    "ddp": {},
}
SHARDED = ("zero3", "zero2", "mics", "zero3-hpz")


def _peak_bytes(tracker: MemTracker) -> int:
    return sum(int(per_device["Total"]) for per_device in tracker.get_tracker_snapshot("peak").values())


def train_delayed(kind: str, config: dict) -> dict:
    """One rank: build on the meta device, place with DistributedModel (measured), then train."""
    sw.init({**config, "delayed_parameter_initialization": True})
    with sw.delay_param_initialization():
        module = build(kind, freeze_key_bias=True, layers=LAYERS)
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    tracker = MemTracker()
    with tracker:
        model = sw.DistributedModel(module)
    initial = {name: t.clone() for name, t in model.full_state_dict().items()}
    opt = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))

    train_step = seed_step(kind)
    losses = []
    for inputs, targets in sw.data_loader(dataset(kind, STEPS * ROWS * sw.dp_size()), batch_size=ROWS,
                                          shuffle=False):
        opt.zero_grad()
        losses.append(train_step(model, inputs, targets).reduce_mean().item())
        opt.step()
    return {"size": size, "peak": _peak_bytes(tracker), "initial": initial, "losses": losses,
            "state": model.full_state_dict()}


@functools.cache
def reference(kind: str) -> dict:
    """One plain process materialising the whole meta-built model, then training it on the global batches."""
    with torch.device("meta"):
        model = build(kind, freeze_key_bias=True, layers=LAYERS)
    materialize(model, torch.device("cpu"), SEED)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    return {"initial": initial, **train_reference(kind, "sgd", STEPS, ROWS * WORLD, model=model)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_values_and_training_equal_one_process(kind, mode):
    want = reference(kind)
    ranks = run_distributed(train_delayed, WORLD, kind, MODES[mode], timeout=300)
    mean_losses = torch.tensor([rank["losses"] for rank in ranks]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(want["losses"]), rtol=1e-5, atol=0)
    for rank in ranks:
        assert set(rank["initial"]) == set(want["initial"])
        assert all(torch.equal(rank["initial"][name], t) for name, t in want["initial"].items())
        errors = {name: relative_error(rank["state"][name], t) for name, t in want["state"].items()}
        assert max(errors.values()) < 1e-5, max(errors.items(), key=lambda kv: kv[1])
        if mode in SHARDED:  # its shards, and one whole block (of LAYERS) at a time besides, with room to spare
            bound = rank["size"] / MODES[mode]["sharded_data_parallel_degree"] + 2 * rank["size"] / LAYERS
            assert rank["peak"] < bound < rank["size"], "no rank may hold the whole model while it is built"
        else:
            assert rank["peak"] >= rank["size"], "a DDP replica holds the whole model"


class _Scaled(torch.nn.Module):
    """A parameter made in __init__ with no reset_parameters(): nothing could initialise it later."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))


def test_a_module_nothing_can_initialise_is_an_error_not_garbage():
    with torch.device("meta"):
        model = torch.nn.Sequential(_Scaled())
    with pytest.raises(ValueError) as err:
        materialize(model, torch.device("cpu"), SEED)
    assert str(err.value) == (
        "delayed parameter initialisation cannot initialise '0' (_Scaled): it has no reset_parameters() and no Hugging "
        "Face model encloses it; fix: give it a reset_parameters() that sets its own tensors, or build the model "
        "outside sw.delay_param_initialization()")
