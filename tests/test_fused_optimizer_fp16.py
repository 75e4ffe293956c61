"""A fused torch optimizer (`AdamW(fused=True)`, the Hugging Face Trainer's default) steps under fp16's loss scale.

torch's fused kernels take the loss scaler's overflow flag as a 0-dim tensor, as torch's GradScaler makes it;
shardwise's sharded scaler makes it so too. A tiny GPT-2 trains 4 steps in fp16 under ZeRO-3 on 2 ranks with the
fused AdamW, the third step's loss made infinite: that step is skipped on every rank (the fused kernel reads the
flag, summed over the ranks and put back to 1) and the weights end as with the unfused (foreach) AdamW in the same
world, which skips it alike (the same fp16 arithmetic: a world of other ranks rounds otherwise, see
tests/test_hf_trainer.py's fp16 case for the comparison with one process to fp16's precision).
"""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.testing import run_distributed
from tiny_models import build, dataset, loss_fn, relative_error

STEPS = 4
OVERFLOW_AT = 2
ROWS = 4  # per step, over every rank


def train(config: dict, fused: bool) -> dict:
    sw.init({"fp16": True, **config})
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    optimizer = sw.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused,
                                                          foreach=None if fused else True))

    @sw.step
    def train_step(model, inputs, targets, blow_up):
        loss = loss_fn("gpt2", model, inputs, targets) * blow_up
        model.backward(loss)
        return loss

    inputs, targets = dataset("gpt2", ROWS * STEPS).tensors
    share, index = ROWS // sw.dp_size(), sw.dp_rank()
    skipped = []
    for step in range(STEPS):
        rows = slice(step * ROWS + index * share, step * ROWS + (index + 1) * share)
        optimizer.zero_grad()
        train_step(model, inputs[rows], targets[rows], float("inf") if step == OVERFLOW_AT else 1.0)
        optimizer.step()
        skipped.append(optimizer.overflow)
    state = model.full_state_dict()
    return {"skipped": skipped, "state": {k: v.float().clone() for k, v in state.items()} if sw.rank() == 0 else None}


def test_fused_adamw_under_zero3_fp16_skips_the_overflow_and_trains_as_unfused():
    zero3 = {"sharded_data_parallel_degree": 2}
    want = run_distributed(train, 2, zero3, False, timeout=300)[0]
    ranks = run_distributed(train, 2, zero3, True, timeout=300)
    overflowed = [step == OVERFLOW_AT for step in range(STEPS)]
    assert want["skipped"] == overflowed
    for got in ranks:
        assert got["skipped"] == overflowed
    for name, value in want["state"].items():
        assert relative_error(ranks[0]["state"][name], value) <= 1e-4, name  # the kernels round apart, fp16 carries it
