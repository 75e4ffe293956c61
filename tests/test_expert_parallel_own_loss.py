"""A mixture-of-experts model's own loss from `labels=` under a pipeline and under tensor parallelism.

The model's load-balancing loss sums its router statistics over all layers, and a pipeline stage runs only
its own: each stage passes its running sums on beside the hidden states (experts/load_balancing.py). Under
tensor parallelism the model adds that loss to a vocabulary-parallel cross entropy, a DTensor. Tiny Mixtral
trains 3 AdamW steps on 4 gloo ranks (2 for the pipeline alone), 2 microbatches a step, on the loss it
computes from `labels=` (cross entropy plus the weighted load-balancing loss): 2 stages × 2 data-parallel
ranks with EP 2 under ZeRO-3 and without EP under DDP, 2 stages alone, and TP 2 × EP 2 under ZeRO-3. One
process is the reference: the same global microbatches run one after the other with their gradients
accumulated, as `@sw.step` runs them. The mean loss, every rank's load-balancing loss and every whole
parameter match it within 1e-5.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
import test_expert_parallel as experts_tests
from shardwise.testing import run_distributed
from tiny_models import dataset, relative_error

WORLD, GLOBAL_ROWS, MICROBATCHES, STEPS = 4, 8, 2, 3  # GLOBAL_ROWS: one process's batch per step
CONFIGS = {  # and the data-parallel ranks (tensor-parallel peers bring their own rows)
    "pp2-zero3-ep2": ({"pipeline_parallel_degree": 2, "sharded_data_parallel_degree": 2,
                       "expert_parallel_degree": 2, "microbatches": MICROBATCHES}, 2),
    "pp2-ddp": ({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES}, 2),
    "tp2-zero3-ep2": ({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "expert_parallel_degree": 2,
                       "microbatches": MICROBATCHES}, 4),
    "pp2-alone": ({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES}, 1),  # on 2 ranks
}


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    return dataset("llama", STEPS * GLOBAL_ROWS).tensors


@functools.cache
def reference(dp: int) -> dict:
    """One process: per step, microbatch m joins each of the `dp` data-parallel ranks' m-th microbatch; each
    microbatch's loss from labels, divided by their count, is backpropagated before the optimizer steps."""
    model = experts_tests._model("mixtral")
    optimizer = experts_tests._optimizer(model)
    inputs, targets = _batches()
    rows_per_rank = GLOBAL_ROWS // dp
    per = rows_per_rank // MICROBATCHES
    losses, aux = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        step_losses, step_aux = [], []
        for m in range(MICROBATCHES):
            rows = torch.cat([torch.arange(per) + step * GLOBAL_ROWS + rank * rows_per_rank + m * per
                              for rank in range(dp)])
            output = model(input_ids=inputs[rows], labels=targets[rows])
            (output.loss / MICROBATCHES).backward()
            step_losses.append(output.loss.item())
            step_aux.append(output.aux_loss.item())
        optimizer.step()
        losses.append(sum(step_losses) / MICROBATCHES)
        aux.append(sum(step_aux) / MICROBATCHES)
    return {"losses": losses, "aux": aux, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train(config: dict) -> dict:
    """One rank: the model's loss from labels through the pipeline; the mean loss over the data-parallel ranks, this
    rank's load-balancing loss per step and the whole parameters."""
    sw.init(config)
    model = sw.DistributedModel(experts_tests._model("mixtral"))
    optimizer = sw.DistributedOptimizer(experts_tests._optimizer(model))

    inputs, targets = _batches()
    return train_on_own_loss(model, optimizer, inputs, targets, GLOBAL_ROWS, GLOBAL_ROWS // sw.dp_size())


def train_on_own_loss(model, optimizer, inputs: torch.Tensor, targets: torch.Tensor, global_rows: int,
                      rows: int) -> dict:
    """STEPS steps of `model`'s loss from labels, each on this rank's `rows` (by its dp rank) of the step's
    `global_rows`; the mean loss over the ranks, this rank's load-balancing loss per step and the whole parameters."""

    @sw.step
    def train_step(model, input_ids, labels):
        output = model(input_ids=input_ids, labels=labels)
        model.backward(output.loss)
        return output.loss, output.aux_loss.detach()

    losses, aux = [], []
    for step in range(STEPS):
        mine = slice(step * global_rows + sw.dp_rank() * rows, step * global_rows + (sw.dp_rank() + 1) * rows)
        loss, balance = train_step(model, inputs[mine], targets[mine])
        optimizer.step()
        optimizer.zero_grad()
        mean = torch.as_tensor(loss.reduce_mean()).detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / sw.size())
        aux.append(float(balance.reduce_mean()))
    return {"losses": losses, "aux": aux, "state": model.full_state_dict()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_models_own_loss_is_one_processs(name):
    config, dp = CONFIGS[name]
    want = reference(dp)
    world = config["pipeline_parallel_degree"] if dp == 1 else WORLD
    for got in run_distributed(train, world, config, timeout=600):
        assert got["losses"] == pytest.approx(want["losses"], rel=experts_tests.TOLERANCE)
        assert got["aux"] == pytest.approx(want["aux"], rel=experts_tests.TOLERANCE)
        assert got["state"].keys() == want["state"].keys()
        for key, tensor in want["state"].items():
            assert relative_error(got["state"][key], tensor) <= experts_tests.TOLERANCE, key
