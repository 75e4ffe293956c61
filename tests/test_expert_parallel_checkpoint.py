"""MoE checkpoints across expert-parallel degrees: saved under EP 2, resumed under EP 2, EP 4 and no EP.

A tiny Mixtral trains 2 AdamW steps under ZeRO-3 with EP 2 on 4 gloo ranks, saves a partial
(sharded) checkpoint, and trains 2 more. Resumed in the same layout, the weights are the saved
ones bit for bit and the next 2 steps repeat the original run's losses and weights bit for bit.
Resumed with EP 4 or without EP, every whole tensor is again exactly the saved one (experts are
resharded, not recomputed) and the 2 steps after it agree with the original run within the
summation-order tolerance of test_expert_parallel_runtime.py.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.testing import run_distributed
from test_expert_parallel import ROWS, TOLERANCE, WORLD, _losses, _model, _optimizer
from tiny_models import dataset, relative_error

BEFORE, AFTER = 2, 2
SAVED_UNDER = {"sharded_data_parallel_degree": WORLD, "expert_parallel_degree": 2}
RESUMED_UNDER = {
    "ep2": SAVED_UNDER,
    "ep4": {"sharded_data_parallel_degree": WORLD, "expert_parallel_degree": 4},
    "no-ep": {"sharded_data_parallel_degree": WORLD},
}


def _run(config: dict, path: str, resume: bool) -> dict:
    """One rank: save after BEFORE steps then train AFTER more, or resume the save and train AFTER steps."""
    sw.init(config)
    model = sw.DistributedModel(_model("mixtral"))
    optimizer = sw.DistributedOptimizer(_optimizer(model))

    @sw.step
    def train_step(model, inputs, targets):
        loss, _ = _losses("mixtral", model, inputs, targets)
        model.backward(loss)
        return loss

    loader = sw.data_loader(dataset("llama", (BEFORE + AFTER) * ROWS * sw.dp_size()), batch_size=ROWS,
                            shuffle=False)
    batches = iter(loader)
    if resume:
        sw.resume_from_checkpoint(path)
        batches = iter(loader)  # a new pass continues from the restored position
    else:
        for _ in range(BEFORE):
            optimizer.zero_grad()
            train_step(model, *next(batches))
            optimizer.step()
        sw.save_checkpoint(path, "saved")
    saved = model.full_state_dict()
    losses = []
    for _ in range(AFTER):
        optimizer.zero_grad()
        losses.append(train_step(model, *next(batches)).reduce_mean().item())
        optimizer.step()
    return {"saved": saved, "losses": losses, "state": model.full_state_dict()}


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> tuple[str, list[dict]]:
    path = str(tmp_path_factory.mktemp("moe-checkpoint"))
    return path, run_distributed(_run, WORLD, SAVED_UNDER, path, False, timeout=600)


@pytest.mark.parametrize("layout", list(RESUMED_UNDER))
def test_a_checkpoint_resumes_in_any_expert_parallel_degree(original, layout):
    path, first = original
    resumed = run_distributed(_run, WORLD, RESUMED_UNDER[layout], path, True, timeout=600)
    exact = layout == "ep2"
    for before, after in zip(first, resumed):
        assert after["saved"].keys() == before["saved"].keys()
        for name, tensor in before["saved"].items():
            assert torch.equal(after["saved"][name], tensor), name
        if exact:
            assert after["losses"] == before["losses"]
        else:
            assert after["losses"] == pytest.approx(before["losses"], rel=TOLERANCE)
        for name, tensor in before["state"].items():
            if exact:
                assert torch.equal(after["state"][name], tensor), name
            else:
                assert relative_error(after["state"][name], tensor) <= TOLERANCE, name
