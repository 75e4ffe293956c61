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

import functools

import pytest
import torch
import torch.distributed as dist
from shardwise.torch_internals import TorchDispatchMode

import shardwise as sw
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


def train(microbatches: int, reduce_dtype: str) -> dict:
    sw.init({"sharded_data_parallel_degree": PER_NODE, "microbatches": microbatches,
             "cross_group_reduce_dtype": reduce_dtype})
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True, **SIZES))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    train_step = seed_step("gpt2")
    loader = sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS, shuffle=False)
    losses = []
    with InFlightAtReduceScatter(model._strategy.cross_group) as seen:
        for inputs, targets in loader:
            optimizer.zero_grad()
            losses.append(train_step(model, inputs, targets).reduce_mean().item())
            optimizer.step()
            seen.pending.append(seen.reduction.pending)  # after the step
    return {"losses": losses, "state": model.full_state_dict(), "pending": seen.pending,
            "dtypes": seen.all_reduce_dtypes, "replicas": dist.get_world_size(model._strategy.cross_group.group)}


@functools.cache
def reference() -> dict:
    return train_reference("gpt2", "adamw", STEPS, ROWS * WORLD, **SIZES)


def _compare(ranks: list[dict], param_tolerance: float, loss_tolerance: float) -> None:
    want = reference()
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
