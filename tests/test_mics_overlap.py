"""MiCS's cross-group gradient all-reduce overlaps backward, in fp32 and in bf16, and trains one process's model.

Two simulated nodes of two ranks, each node one partition group
(`sharded_data_parallel_degree: 2`), train a 4-block GPT-2 (5 sharding units:
the blocks and the root) for three steps with AdamW. A dispatch mode sees every
reduce-scatter inside a group and reads, at that moment, how many cross-group
all-reduces are issued and not yet waited for: on the last microbatch of a step
the k-th unit's reduce-scatter finds the units before it in flight, up to the
bound of two (FSDP2's own hybrid sharding waits for each before backward goes
on: none), on the others none (the all-reduce runs once per step), and none are
left after the step. The final parameters match one plain process on the same
global batches: within 1e-5 in fp32, and in bf16 (`cross_group_reduce_dtype`)
within the rounding of one bf16 sum per step (below).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from shardwise.torch_internals import TorchDispatchMode

import shardwise as sw
from shardwise.parallel.sharding import mics as cross_group
from shardwise.parallel.zero1.shares import IN_FLIGHT
from shardwise.testing import run_distributed
from tiny_models import build, dataset, make_optimizer, relative_error, seed_step, train_reference

WORLD, PER_NODE = 4, 2
STEPS, ROWS = 3, 2
SIZES = {"layers": 4}
UNITS = SIZES["layers"] + 1
FP32_TOLERANCE = 1e-5
# bf16 keeps 8 bits: each step's averaged gradient is off by up to 2^-9 relative, and AdamW, which divides
# by the gradient's own scale, carries that into every parameter's update (these three steps move the
# weights by about half their size). Measured: parameters 1.0e-3 relative (median tensor), 7.6e-3 (worst,
# a bias), losses 4e-6; fp32 gives 6e-7 and 1e-7. The bound is test_same_math's for DDP in bf16.
BF16_PARAM_TOLERANCE, BF16_LOSS_TOLERANCE = 2e-2, 1e-4


class InFlightAtReduceScatter(TorchDispatchMode):
    """At every reduce-scatter inside this rank's partition group, the cross-group all-reduces then pending;
    and the dtype of every cross-group all-reduce."""

    def __init__(self, reduction):
        super().__init__()
        self.reduction = reduction
        self.pending: list[int] = []
        self.all_reduce_dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func._opname.strip("_")
        if op == "reduce_scatter_tensor_coalesced" or op == "reduce_scatter_base":
            self.pending.append(self.reduction.pending)
        elif op == "allreduce":
            self.all_reduce_dtypes.update(t.dtype for t in args[0])
        return func(*args, **(kwargs or {}))


def schedule(step: int) -> float:
    """The learning rate's factor after `step` steps: a scheduler sets the next one while shards still land."""
    return 0.5 ** step


def train(microbatches: int, reduce_dtype: str, overlap: str = "backward", set_to_none: bool = True) -> dict:
    sw.init({"sharded_data_parallel_degree": PER_NODE, "microbatches": microbatches,
             "cross_group_reduce_dtype": reduce_dtype, "cross_group_overlap": overlap})
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True, **SIZES))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, schedule) if overlap == "forward" else None
    reduction = model._strategy.cross_group
    train_step = seed_step("gpt2")
    loader = sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS, shuffle=False)
    losses, landing = [], []
    with InFlightAtReduceScatter(reduction) as seen:
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=set_to_none)
            losses.append(train_step(model, inputs, targets).reduce_mean().item())
            optimizer.step()
            seen.pending.append(reduction.pending)  # after the step
            landing.append(reduction.landing)
            if scheduler is not None:
                scheduler.step()
    return {"losses": losses, "state": model.full_state_dict(), "pending": seen.pending, "landing": landing,
            "dtypes": seen.all_reduce_dtypes, "replicas": dist.get_world_size(reduction.group)}


@functools.cache
def reference(scheduled: bool = False) -> dict:
    return train_reference("gpt2", "adamw", STEPS, ROWS * WORLD, schedule=schedule if scheduled else None, **SIZES)


def _compare(ranks: list[dict], param_tolerance: float, loss_tolerance: float, scheduled: bool = False) -> None:
    want = reference(scheduled)
    losses = torch.tensor([r["losses"] for r in ranks]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(want["losses"]), rtol=loss_tolerance, atol=0)
    for rank, result in enumerate(ranks):
        errors = {name: relative_error(result["state"][name], value) for name, value in want["state"].items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= param_tolerance, f"rank {rank}: {worst} differs by {errors[worst]:.2e} (relative)"


@pytest.mark.parametrize("microbatches", [1, 2])
def test_all_reduces_stay_in_flight_through_backward_and_match_one_process(microbatches):
    ranks = run_distributed(train, WORLD, microbatches, "fp32", nproc_per_node=PER_NODE, timeout=240)
    earlier = [0] * UNITS * (microbatches - 1)  # microbatches before the last send nothing
    per_step = earlier + [min(k, IN_FLIGHT) for k in range(UNITS)] + [0]  # the k-th unit's; after the step
    for result in ranks:
        assert result["replicas"] == WORLD // PER_NODE
        assert result["pending"] == per_step * STEPS
        assert result["dtypes"] == {torch.float32}
    _compare(ranks, FP32_TOLERANCE, FP32_TOLERANCE)


def test_bf16_cross_group_reduction_trains_within_bf16_rounding():
    ranks = run_distributed(train, WORLD, 2, "bf16", nproc_per_node=PER_NODE, timeout=240)
    for result in ranks:
        assert result["dtypes"] == {torch.bfloat16}  # only the cross-group all-reduce is bf16
        assert result["state"]["transformer.h.0.mlp.c_fc.weight"].dtype == torch.float32
    _compare(ranks, BF16_PARAM_TOLERANCE, BF16_LOSS_TOLERANCE)


def train_on_a_slow_link(microbatches: int, set_to_none: bool, slow: bool) -> dict:
    """`train` deferred; with `slow`, no all-reduce is ever found done: each lands only when something waits
    for it, as on a link slower than the whole step."""
    with slow_link() if slow else contextlib.nullcontext():
        return train(microbatches, "fp32", "forward", set_to_none)


@contextlib.contextmanager
def slow_link():
    """No all-reduce is found done (this worker process may run other tests after)."""
    done, cross_group._done = cross_group._done, lambda work: False
    try:
        yield
    finally:
        cross_group._done = done


@pytest.mark.parametrize("microbatches, set_to_none, slow", [(1, True, True), (2, False, True), (2, True, False)])
def test_all_reduces_outliving_backward_are_stepped_as_they_land_and_match_one_process(microbatches, set_to_none,
                                                                                      slow):
    """`cross_group_overlap: forward`: backward sends while it runs and returns with all-reduces in flight. On
    a slow link step() leaves units to land, so the next forward, the scheduler's new lr in between and a
    zero_grad (to None or to zeros) meet shards still on the link."""
    ranks = run_distributed(train_on_a_slow_link, WORLD, microbatches, set_to_none, slow, nproc_per_node=PER_NODE,
                            timeout=240)
    earlier = [0] * UNITS * (microbatches - 1)
    for result in ranks:
        seen = result["pending"][len(earlier):len(earlier) + UNITS]
        assert result["pending"][:len(earlier)] == earlier and seen[0] == 0 and seen[1] == 1
        assert max(seen) <= IN_FLIGHT
        if slow:
            assert seen == [min(k, IN_FLIGHT) for k in range(UNITS)]
            assert result["landing"] == [True] * STEPS
    _compare(ranks, FP32_TOLERANCE, FP32_TOLERANCE, scheduled=True)


def test_a_gradient_written_in_place_before_its_all_reduce_went_is_an_error():
    ranks = run_distributed(_zero_in_place_after_step, WORLD, nproc_per_node=PER_NODE, timeout=240)
    assert all("written in place after backward" in message for message in ranks)


def _zero_in_place_after_step() -> str:
    with slow_link():
        return _zero_in_place_then_synchronize()


def _zero_in_place_then_synchronize() -> str:
    sw.init({"sharded_data_parallel_degree": PER_NODE, "cross_group_overlap": "forward"})
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True, **SIZES))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    inputs, targets = next(iter(sw.data_loader(dataset("gpt2", ROWS * sw.dp_size()), batch_size=ROWS)))
    seed_step("gpt2")(model, inputs, targets)
    optimizer.step()
    for param in model.get_module().parameters():  # not through the optimizer: its units still to go see it
        if param.grad is not None:
            param.grad.zero_()
    try:
        optimizer.synchronize()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_deferred_units_go_half_as_backward_finishes_them_then_in_the_next_forwards_order():
    backward = ["head", "b3", "b2", "b1", "b0", "root"]  # the order backward finishes them
    assert cross_group.send_order(backward) == ["head", "b3", "b2", "root", "b0", "b1"]
    assert cross_group.send_order(backward[2:]) == ["b2", "b1", "root", "b0"]  # at least IN_FLIGHT ahead
