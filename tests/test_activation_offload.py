"""Activation offloading: the order of moves, the same math in multi-rank worlds, and the notices.

On a CPU device nothing moves, but the schedule runs all the same: a recording
mover shows which region's kept inputs are stored, fetched back and taken, and
when; a copying mover (a fresh tensor each way, as host and device copies are)
stands in for the accelerator's in the training runs, which must match one
plain process.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.config import IneffectiveSettingsWarning
from shardwise.api.recompute import runtime_offload
from shardwise.parallel.recompute.offload import StayOnDevice
from shardwise.parallel.pipeline.stage import Elsewhere
from shardwise.runtime.state import current
from shardwise.testing import run_distributed
from tiny_models import (assert_trains_as, blocks, build, dataset, make_optimizer, seed_step, train_reference,
                         train_seed_loop)

BLOCKS = 6
ROWS = 2  # per data-parallel rank and step
STEPS = 3
TOLERANCE = 1e-5


class Recording(StayOnDevice):
    """Numbers what it stores (one kept input per region here, so the region's number) and logs every move."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []

    def store(self, tensor):
        number = sum(kind == "pack" for kind, _ in self.events)
        self.events.append(("pack", number))
        return number, tensor

    def fetch(self, stored):
        self.events.append(("prefetch", stored[0]))
        return stored

    def take(self, fetched):
        self.events.append(("unpack", fetched[0]))
        return fetched[1]


class Copying(StayOnDevice):
    """A fresh copy on store and on fetch, as a host buffer and a device buffer are; counts its moves."""

    def __init__(self):
        self.moves = {"store": 0, "fetch": 0, "take": 0}

    def store(self, tensor):
        self.moves["store"] += 1
        return tensor.detach().clone()

    def fetch(self, stored):
        self.moves["fetch"] += 1
        return stored.clone()

    def take(self, fetched):
        self.moves["take"] += 1
        return fetched


def _block() -> nn.Module:
    return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh())


@pytest.fixture
def one_process(monkeypatch):
    """sw.init in this process with a config; shut down afterwards."""
    for name in ("WORLD_SIZE", "MASTER_ADDR", "SHARDWISE_CONFIG"):
        monkeypatch.delenv(name, raising=False)

    def start(config: dict):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IneffectiveSettingsWarning)  # the CPU notice, tested below
            sw.init(config)
            return runtime_offload(current())

    yield start
    sw.shutdown()


def expected_order(regions: int, horizon: int) -> list[tuple[str, int]]:
    """Every pack in forward order; then, backward reaching region r, r and the `horizon` before it fetched
    (those not fetched yet), and r taken."""
    events = [("pack", r) for r in range(regions)]
    fetched: set[int] = set()
    for r in reversed(range(regions)):
        for ahead in range(r, max(r - horizon, 0) - 1, -1):
            if ahead not in fetched:
                fetched.add(ahead)
                events.append(("prefetch", ahead))
        events.append(("unpack", r))
    return events


def check_order(events: list[tuple[str, int]], regions: int, horizon: int) -> None:
    packs = [r for kind, r in events if kind == "pack"]
    assert packs == list(range(regions)) and events[:regions] == [("pack", r) for r in range(regions)]
    for at, (kind, r) in enumerate(events):
        if kind == "unpack":
            assert ("prefetch", r) in events[:at], f"region {r} taken before it was fetched"
        if kind == "prefetch":
            reached = next(u for k, u in events[at:] if k == "unpack")  # where backward is
            assert 0 <= reached - r <= horizon, f"region {r} fetched {reached - r} regions ahead of {reached}"


@pytest.mark.parametrize("horizon", [0, 1, 4])
def test_regions_are_packed_in_forward_order_and_fetched_at_most_horizon_ahead(one_process, horizon):
    schedule = one_process({"offload_activations": True, "activation_loading_horizon": horizon})
    schedule.mover = Recording()
    torch.manual_seed(0)
    model = nn.Sequential(*(_block() for _ in range(BLOCKS)))
    plain = nn.Sequential(*(_block() for _ in range(BLOCKS)))
    plain.load_state_dict(model.state_dict())
    sw.set_activation_checkpointing(model)  # strategy "each": one region per block
    x = torch.randn(4, 8)

    model(x).square().sum().backward()
    plain(x).square().sum().backward()

    check_order(schedule.mover.events, BLOCKS, horizon)
    assert schedule.mover.events == expected_order(BLOCKS, horizon)
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def test_a_region_inside_another_is_left_to_the_outer_one(one_process):
    """The outer region recomputes the inner ones in backward, so only its own input is kept and offloaded."""
    schedule = one_process({"offload_activations": True, "activation_loading_horizon": 1})
    schedule.mover = Recording()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(_block(), _block()), _block())
    plain = nn.Sequential(nn.Sequential(_block(), _block()), _block())
    plain.load_state_dict(model.state_dict())
    sw.set_activation_checkpointing(model[0])  # the inner blocks...
    sw.set_activation_checkpointing(model)  # ...inside the outer regions
    x = torch.randn(4, 8, requires_grad=True)

    model(x).square().sum().backward()
    plain(x).square().sum().backward()

    assert schedule.mover.events == expected_order(2, 1)
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def train_offloaded(config: dict, kind: str = "gpt2") -> dict:
    """One rank of the seed's loop, every block checkpointed and its kept inputs copied away and back."""
    sw.init({**config, "offload_activations": True, "activation_loading_horizon": 1})
    mover = runtime_offload(current()).mover = Copying()
    model = sw.DistributedModel(build(kind, freeze_key_bias=True))
    held = [block for block in blocks(model.get_module()) if not isinstance(block, Elsewhere)]
    for block in held:
        sw.set_activation_checkpointing(block)
    trained = train_seed_loop(model, kind, STEPS, ROWS)
    return {**trained, "moves": mover.moves, "regions": STEPS * len(held) * config.get("microbatches", 1)}


@pytest.mark.parametrize("config", [
    {"sharded_data_parallel_degree": 2},
    {"tensor_parallel_degree": 2},
    {"pipeline_parallel_degree": 2, "microbatches": 2},
], ids=["zero3", "tp", "pp"])
def test_offloaded_training_matches_one_plain_process(config):
    ranks = run_distributed(train_offloaded, 2, config, timeout=240)
    want = train_reference("gpt2", "sgd", STEPS, ROWS * ranks[0]["dp_size"])

    for rank in ranks:  # one kept input (the hidden states) per block, microbatch and step, each back once; the
        # pipeline's first step also runs microbatch 0 once more to learn the shapes (on the last stage with its loss)
        moves, regions = rank["moves"], rank["regions"]
        extra = int("pipeline_parallel_degree" in config)
        assert regions <= moves["fetch"] == moves["take"] <= moves["store"] == regions + extra
    assert_trains_as(ranks, want, TOLERANCE)


def offload_notices(checkpointing: bool) -> list[str]:
    """The offload_activations notices this rank gives over three training steps on the CPU."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IneffectiveSettingsWarning)
        train_step = seed_step("stack")
        sw.init({"offload_activations": True})
        model = sw.DistributedModel(build("stack"))
        if checkpointing:
            for block in blocks(model.get_module()):
                sw.set_activation_checkpointing(block)
        optimizer = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
        for inputs, targets in sw.data_loader(dataset("stack", STEPS * ROWS * sw.dp_size()), batch_size=ROWS):
            optimizer.zero_grad()
            train_step(model, inputs, targets)
            optimizer.step()
    return [str(w.message) for w in caught if "offload_activations" in str(w.message)]


def test_on_the_cpu_rank_0_says_once_that_nothing_moves():
    rank0, rank1 = run_distributed(offload_notices, 2, True)
    assert rank0 == [("these settings have no effect in this layout: offload_activations (the device is the CPU, "
                      "whose memory is the host memory: checkpointed activations stay where they are); fix: remove "
                      "them, or set what they need")]
    assert rank1 == []


def test_offloading_without_checkpointed_regions_is_named_after_the_first_step():
    rank0, rank1 = run_distributed(offload_notices, 2, False)
    assert len(rank0) == 2 and "the device is the CPU" in rank0[0]
    assert rank0[1] == ("these settings have no effect in this layout: offload_activations (no activation-"
                        "checkpointed region ran in the first training step, and only what checkpointed regions "
                        "keep is offloaded; checkpoint modules with sw.set_activation_checkpointing); fix: remove "
                        "them, or set what they need")
    assert rank1 == []
