"""CUDA tier: `torch.compile` of each transformer block trains the same math as eager, under ZeRO-3 and TP.

As torchtitan does, each block is compiled on its own (`block.compile()`, which
keeps the module tree, so names and wrapping are unchanged) and then sharded;
FSDP2's hooks stay eager around the compiled blocks (dynamo skips them). The
compiled run matches the eager run of the same layout on the same device to
inductor's reordering of fp32 sums. Tensor parallelism needs a device per rank
(NCCL refuses two ranks on one GPU), so its case runs only where there are two.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.runtime import state
from shardwise.testing import run_distributed
from tiny_models import blocks, build, dataset, make_optimizer, relative_error, seed_step

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tier: torch sees no CUDA device")]

ROWS, STEPS = 4, 3
TOLERANCE = 1e-4


def _train(config: dict, compiled: bool) -> dict:
    sw.init(config)
    module = build("gpt2", freeze_key_bias=True)
    if compiled:
        for block in blocks(module):
            block.compile()
    model = sw.DistributedModel(module)
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    train_step = seed_step("gpt2")
    losses = []
    for inputs, targets in sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS,
                                          shuffle=False):
        optimizer.zero_grad()
        losses.append(train_step(model, inputs, targets).reduce_mean().item())
        optimizer.step()
    result = {"losses": losses, "state": {k: v.detach().cpu() for k, v in model.full_state_dict().items()}}
    state.set_current(None)  # the next run starts afresh on the same process group
    return result


def compiled_and_eager(config: dict) -> tuple[dict, dict]:
    return _train(config, True), _train(config, False)


def _same(compiled: dict, eager: dict) -> None:
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=TOLERANCE,
                               atol=0)
    worst = max(eager["state"], key=lambda k: relative_error(compiled["state"][k], eager["state"][k]))
    error = relative_error(compiled["state"][worst], eager["state"][worst])
    assert error <= TOLERANCE, f"{worst} differs by {error:.2e} (relative)"


def test_compiled_blocks_under_zero3_train_as_eager():
    [(compiled, eager)] = run_distributed(compiled_and_eager, 1, {"sharded_data_parallel_degree": 1}, timeout=240)
    _same(compiled, eager)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="tensor parallelism needs a device per rank: NCCL refuses two ranks on one GPU")
@pytest.mark.skipif(torch.__version__ < "2.13",
                    reason="tensor parallelism of GPT-2's packed q/k/v needs torch 2.13 (docs/torch.md)")
def test_compiled_blocks_under_tensor_parallelism_train_as_eager():
    ranks = run_distributed(compiled_and_eager, 2, {"tensor_parallel_degree": 2}, timeout=240)
    for compiled, eager in ranks:
        _same(compiled, eager)
