"""Each ZeRO stage and MiCS keeps the share of the model states it promises, in bytes.

Measured with torch's `MemTracker` on every rank of a 4-rank world after one
full step (forward, backward, `optimizer.step()`), for fp32 + AdamW with a
parameters, n data-parallel ranks and partition groups of g:

    mode    parameters  gradients  optimizer states
    DDP     4a          4a         8a
    ZeRO-1  4a          4a         8a/n
    ZeRO-2  4a/n        4a/n       8a/n     (whole during the step, resharded after backward)
    ZeRO-3  4a/n        4a/n       8a/n
    MiCS    4a/g        4a/g       8a/g

Tolerances, all in bytes and not machine-dependent:
- sharded tensors: FSDP2 splits each tensor along dim 0 and pads it to a multiple
  of the group size, so a rank may hold up to one extra row per tensor (the
  GPT-2 below has every dim 0 divisible by 4, so in practice it is exact);
- optimizer states: AdamW also keeps a 4-byte `step` counter per tensor;
- ZeRO-1 deals whole tensors to ranks (largest first to the least loaded), so a
  rank's share is within one largest tensor of 8a/n; the shares add up to 8a.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import shardwise as sw
from shardwise.testing import run_distributed
from tiny_models import build, dataset, loss_fn, make_optimizer

WORLD, GROUP = 4, 2
SIZES = {"layers": 4, "hidden": 64, "heads": 4}
ROWS = 2

# mode: (config, divisors of (parameters, gradients, optimizer states))
MODES = {
    "ddp": ({}, (1, 1, 1)),
    "zero1": ({"shard_optimizer_state": True}, (1, 1, WORLD)),
    "zero2": ({"zero_stage": 2, "sharded_data_parallel_degree": WORLD}, (WORLD, WORLD, WORLD)),
    "zero3": ({"sharded_data_parallel_degree": WORLD}, (WORLD, WORLD, WORLD)),
    "mics": ({"sharded_data_parallel_degree": GROUP}, (GROUP, GROUP, GROUP)),
}
CATEGORIES = ("Parameter", "Gradient", "Optstate")


def _by_name(snapshot: dict) -> dict[str, int]:
    return {getattr(category, "value", category): int(value) for category, value in snapshot.items()}


def measure_one_step(config: dict) -> dict[str, dict[str, int]]:
    """This rank's bytes per category right after forward and after one AdamW step of the seed's loop."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2", **SIZES))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    tracker = MemTracker()
    snapshots = {}

    @sw.step
    def train_step(model, inputs, targets):
        loss = loss_fn("gpt2", model, inputs, targets)
        snapshots["forward"] = _by_name(tracker.get_tracker_snapshot()[torch.device("cpu")])
        model.backward(loss)
        return loss

    inputs, targets = next(iter(sw.data_loader(dataset("gpt2", ROWS * sw.dp_size()), batch_size=ROWS)))
    tracker.track_external(model.get_module(), optimizer.optimizer)
    with tracker:
        optimizer.zero_grad()
        train_step(model, inputs, targets)
        optimizer.step()
    snapshots["step"] = _by_name(tracker.get_tracker_snapshot()[torch.device("cpu")])
    return snapshots


@pytest.fixture(scope="module")
def shapes() -> list[torch.Size]:
    return [p.shape for p in build("gpt2", **SIZES).parameters()]


@pytest.fixture(scope="module", params=list(MODES))
def measured(request) -> tuple[str, list[dict]]:
    config, _ = MODES[request.param]
    return request.param, run_distributed(measure_one_step, WORLD, config, timeout=180)


def test_model_states_per_rank(measured, shapes):
    """Parameters, gradients and AdamW states per rank after a step are the promised fraction of the whole."""
    mode, ranks = measured
    a = sum(s.numel() for s in shapes)
    padded_rows = sum(s.numel() // s[0] for s in shapes)  # elements in one row of each tensor
    counters = 4 * len(shapes)  # AdamW's 4-byte step counters
    largest = max(s.numel() for s in shapes)
    for category, per_param, divisor in zip(CATEGORIES, (4, 4, 8), MODES[mode][1]):
        expected = per_param * a / divisor
        low, high = expected, expected + (per_param * padded_rows if divisor > 1 else 0)
        if category == "Optstate":
            high += counters
        if category == "Optstate" and mode == "zero1":
            low, high = low - 8 * largest, high + 8 * largest
        for rank, snapshots in enumerate(ranks):
            got = snapshots["step"].get(category, 0)
            assert low <= got <= high, (f"rank {rank} {category}: {got} bytes, expected {per_param}a/{divisor} = "
                                        f"{expected:.0f} (a={a}) within [{low:.0f}, {high:.0f}]")
    if mode == "zero1":  # each state lives on exactly one rank
        assert 8 * a <= sum(s["step"]["Optstate"] for s in ranks) <= 8 * a + counters


def test_only_zero2_keeps_whole_parameters_between_forward_and_backward(measured, shapes):
    """ZeRO-2 gathers each block once per step (whole parameters plus shards after forward); ZeRO-3 and
    MiCS free each block's gathered parameters after its forward."""
    mode, ranks = measured
    whole = 4 * sum(s.numel() for s in shapes)
    for snapshots in ranks:
        after_forward = snapshots["forward"]["Parameter"]
        if mode == "zero2":
            assert after_forward >= whole + whole / WORLD
        elif mode in ("zero3", "mics"):
            assert after_forward < whole
