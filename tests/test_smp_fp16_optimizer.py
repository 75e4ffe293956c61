"""The members of SMP's FP16_Optimizer that SMP v1's example scripts call on DistributedOptimizer:

    if args.fp16:
        optimizer.clip_master_grads(args.grad_clip)
    optimizer.step()
    if not (args.fp16 and optimizer.overflow):
        lr_scheduler.step()
    print(f"Grad norm: {optimizer._global_grad_norm}")

Tiny GPT-2 with SGD in a 2-rank world, in exactly that pattern:

- fp16 under ZeRO-3 and ZeRO-1: `clip_master_grads(c)` before every step trains
  bit for bit as `gradient_clipping: c` does (c below every gradient norm, so
  every step clips; the last of two calls counts), and rank 1's loss made to
  overflow in step 1 makes `overflow` True for that step only, on both ranks,
  which leaves the weights and the scheduler's learning rate as they were;
- fp32 under ZeRO-3: `clip_master_grads` clips the next step only, as one plain
  process calling `torch.nn.utils.clip_grad_norm_` before those steps does;
- everywhere, `_global_grad_norm` is the norm of the unscaled gradients summed by
  hand over the disjoint parts the ranks' optimizers hold.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.parallel.local import local_tensor
from shardwise.testing import run_distributed
from tiny_models import build, dataset, loss_fn, relative_error

STEPS, ROWS, WORLD = 4, 2, 2
LR, CLIP = 0.1, 0.25  # tiny GPT-2's gradient norms stay above 1 over these steps: CLIP binds every time
HUGE = 1e30  # a loss this large overflows fp16 gradients at any scale
OVERFLOWED = 1  # the step whose loss rank 1 makes overflow
LAYOUTS = {"zero3": {"sharded_data_parallel_degree": 2}, "zero1": {"shard_optimizer_state": True}}


def hand_norm(optimizer: sw.DistributedOptimizer) -> float:
    """The global norm of the unscaled gradients: each rank's optimizer holds a disjoint part of the model
    (its ZeRO-3 shards, or its ZeRO-1 share as fp32 masters), so the squares add up over the ranks."""
    squares = sum(float(local_tensor(p.grad).double().pow(2).sum())
                  for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
    total = torch.tensor(squares, dtype=torch.float64)
    dist.all_reduce(total)
    return math.sqrt(total.item()) / optimizer.loss_scale


def train(config: dict, clips: dict[int, list[float]], huge_step: int | None = None) -> dict:
    """STEPS steps under `config` in the SMP scripts' pattern: before step i, `clip_master_grads` with each
    limit of `clips[i]` in turn; the scheduler steps unless fp16 overflowed. Rank 1 multiplies the loss of
    `huge_step` by HUGE."""
    sw.init(config)
    fp16 = bool(config.get("fp16"))
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    optimizer = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = dataset("gpt2", STEPS * ROWS * sw.dp_size())

    @sw.step
    def train_step(model, inputs, targets, times):
        loss = loss_fn("gpt2", model, inputs, targets)
        model.backward(loss * times)
        return loss

    out = {"norm_before": optimizer._global_grad_norm, "losses": [], "hand": [], "norms": [], "lrs": [],
           "overflow": [], "skipped": []}
    for index in range(STEPS):
        start = (index * sw.dp_size() + sw.dp_rank()) * ROWS
        times = HUGE if index == huge_step and sw.rank() == 1 else 1.0
        optimizer.zero_grad()
        out["losses"].append(train_step(model, *data[start:start + ROWS], times).reduce_mean().item())
        out["hand"].append(hand_norm(optimizer))
        for limit in clips.get(index, []):
            optimizer.clip_master_grads(limit)
        before = [local_tensor(p).detach().clone() for p in model.parameters()]
        out["lrs"].append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if not (fp16 and optimizer.overflow):
            scheduler.step()
        out["overflow"].append(optimizer.overflow)
        out["skipped"].append(all(torch.equal(b, local_tensor(p)) for b, p in zip(before, model.parameters())))
        norm = optimizer._global_grad_norm
        out["norms"].append(None if norm is None else float(norm))
    return {**out, "state": model.full_state_dict()}


def _assert_norms_by_hand(result: dict, steps: list[int]) -> None:
    for step in steps:
        assert result["norms"][step] == pytest.approx(result["hand"][step], rel=1e-5), step


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp16_clip_master_grads_clips_as_gradient_clipping_and_overflow_skips_the_scheduler(layout):
    fp16 = {**LAYOUTS[layout], "fp16": True}
    by_config = run_distributed(train, WORLD, {**fp16, "gradient_clipping": CLIP}, {}, OVERFLOWED, timeout=300)
    # the last limit before a step counts, not the tighter one given first
    by_call = run_distributed(train, WORLD, fp16, {i: [CLIP / 10, CLIP] for i in range(STEPS)}, OVERFLOWED,
                              timeout=300)
    finite = [i for i in range(STEPS) if i != OVERFLOWED]
    for want, got in zip(by_config, by_call):
        assert min(got["hand"][i] for i in finite) > CLIP  # every finite step clips
        assert all(torch.equal(got["state"][k], v) for k, v in want["state"].items())
        assert got["losses"] == want["losses"]
        assert [got["norms"][i] for i in finite] == [want["norms"][i] for i in finite]  # nan on the overflow
        for result in (want, got):
            assert result["overflow"] == result["skipped"] == [i == OVERFLOWED for i in range(STEPS)]
            assert result["lrs"] == [LR, LR / 2, LR / 2, LR / 4]  # the scheduler skipped the overflowed step
            assert result["norm_before"] is None and not math.isfinite(result["norms"][OVERFLOWED])
            _assert_norms_by_hand(result, finite)
    assert by_call[0]["losses"][-1] < by_call[0]["losses"][0]


def reference(clipped: set[int]) -> dict:
    """One plain process on the same global batches, clipping to CLIP before the steps in `clipped`."""
    model = build("gpt2", freeze_key_bias=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data, losses, norms = dataset("gpt2", STEPS * ROWS * WORLD), [], {}
    for index in range(STEPS):
        inputs, targets = data[index * ROWS * WORLD:(index + 1) * ROWS * WORLD]
        optimizer.zero_grad()
        loss = loss_fn("gpt2", model, inputs, targets)
        loss.backward()
        if index in clipped:
            norms[index] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_fp32_clip_master_grads_clips_the_next_step_only_as_one_process():
    clipped = {0, 2}
    want = reference(clipped)
    ranks = run_distributed(train, WORLD, LAYOUTS["zero3"], {i: [CLIP] for i in clipped}, timeout=300)
    losses = torch.tensor([r["losses"] for r in ranks]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(want["losses"]), rtol=1e-5, atol=0)
    for rank, result in enumerate(ranks):
        assert result["overflow"] == [False] * STEPS and result["lrs"] == [LR / 2 ** i for i in range(STEPS)]
        assert result["norm_before"] is None
        # steps 1 and 3 do not clip, so they take no norm: the last clipping step's stays
        assert result["norms"] == [result["norms"][0], result["norms"][0], result["norms"][2], result["norms"][2]]
        assert [result["norms"][i] for i in sorted(clipped)] == pytest.approx(list(want["norms"].values()), rel=1e-5)
        _assert_norms_by_hand(result, sorted(clipped))
        errors = {k: relative_error(result["state"][k], v) for k, v in want["state"].items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-5, f"rank {rank}: {worst} differs by {errors[worst]:.2e} (relative)"


def refusals() -> dict:
    sw.init({})
    model = sw.DistributedModel(build("stack"))
    optimizer = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    errors = {}
    for name, args in {"norm_type": (1.0, float("inf")), "zero": (0.0,), "flag": (True,)}.items():
        try:
            optimizer.clip_master_grads(*args)
        except ValueError as error:
            errors[name] = str(error)
    return errors


def test_clip_master_grads_refuses_other_norms_and_limits():
    assert run_distributed(refusals, 1, timeout=120)[0] == {
        "norm_type": "DistributedOptimizer.clip_master_grads: norm_type=inf is not supported (shardwise clips "
                     "by the global L2 norm); fix: pass norm_type=2",
        "zero": "DistributedOptimizer: max_norm=0.0 must be a number > 0; fix: pass e.g. max_norm=1.0",
        "flag": "DistributedOptimizer: max_norm=True must be a number > 0; fix: pass e.g. max_norm=1.0"}
