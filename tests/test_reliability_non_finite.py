"""Inf/nan gradients at `optimizer.step()` (`non_finite_gradients`, runtime/non_finite.py), in 2-rank gloo worlds.

Rank 1 alone makes the gradient flowing into the token embedding nan in chosen
steps (a hook on the embedding's output), so only `embed.weight` goes bad, as a
nan born in one rank's backward does:

- skip, under DDP and ZeRO-1 without clipping (the ranks agree by an all-reduce;
  under ZeRO-1 only the rank whose share holds `embed.weight` sees the nan) and
  under ZeRO-3 with clipping (by the clip norm): the bad steps are skipped on both ranks
  (`overflow`, `skipped_steps`, a warning naming the step and `embed.weight`),
  and the final parameters equal one plain process that skips the same steps;
- stop: the first bad step raises on both ranks, naming the step and the parameter,
  before anything is stepped; with `non_finite_stop_after: 2` two bad steps apart
  are both skipped and the run finishes, two in a row stop it at the second;
- fp16 (ZeRO-3): its loss scaler skips the bad step and lowers the scale, counted
  in `skipped_steps`, whatever `non_finite_gradients` says (it is named as ineffective).

Every run saves an asynchronous checkpoint after the first step, still being written when
the first bad step comes; whatever the policy did, it is then complete and reads back as saved.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.config import ShardwiseConfig
from shardwise.config.effects import ineffective_settings
from shardwise.runtime.non_finite import NonFiniteGradientError, NonFiniteGradientWarning
from shardwise.testing import run_distributed
from tiny_models import (assert_checkpoints_intact, build, dataset, loss_fn, make_optimizer, relative_error,
                         train_reference)

STEPS, ROWS, WORLD = 4, 2, 2
# ZeRO-1: only the owner of `embed.weight`'s share sees the nan; ZeRO-3 with clipping agrees by the clip norm
LAYOUTS = {"ddp": {}, "zero1": {"shard_optimizer_state": True},
           "zero3-clipped": {"sharded_data_parallel_degree": 2, "gradient_clipping": 1e6}}
NAMED = "inf/nan gradients (first in 'embed.weight' on rank "


def _nan_gradient(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
    output.register_hook(lambda grad: torch.full_like(grad, float("nan")))


def _poison_embedding(model: torch.nn.Module) -> Any:
    """Until the returned handle is removed, the gradient reaching the embedding's output is nan (so
    `embed.weight`'s alone)."""
    return model.get_module().embed.register_forward_hook(_nan_gradient)


def train(config: dict, bad_steps: set[int], checkpoints: str) -> dict:
    """STEPS AdamW steps of TinyStack; rank 1 poisons the embedding's gradient in `bad_steps`. Stops at a
    NonFiniteGradientError, reporting it and whether the parameters were left as before that step. After the
    first step, an asynchronous save of checkpoint `step1` to `checkpoints` (`saved`: what it holds)."""
    sw.init(config)
    model = sw.DistributedModel(build("stack"))
    optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
    data = dataset("stack", STEPS * ROWS * WORLD)
    out = {"overflow": [], "scales": [], "warnings": [], "error": None}

    @sw.step
    def train_step(model, inputs, targets):
        loss = loss_fn("stack", model, inputs, targets)
        model.backward(loss)
        return loss

    for index in range(STEPS):
        poison = _poison_embedding(model) if index in bad_steps and sw.rank() == 1 else None
        start = (index * WORLD + sw.dp_rank()) * ROWS
        optimizer.zero_grad()
        train_step(model, *data[start:start + ROWS])
        before = {name: value.clone() for name, value in model.full_state_dict().items()}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", NonFiniteGradientWarning)
                optimizer.step()
        except NonFiniteGradientError as error:
            after = model.full_state_dict()
            out.update(error=str(error), at=index, unchanged=all(torch.equal(after[k], v) for k, v in before.items()))
            break
        finally:
            if poison is not None:
                poison.remove()
        out["warnings"] += [str(w.message) for w in caught if issubclass(w.category, NonFiniteGradientWarning)]
        out["overflow"].append(optimizer.overflow)
        out["scales"].append(optimizer.loss_scale)
        if index == 0:
            sw.save_checkpoint(checkpoints, "step1", async_save=True)
            out["saved"] = {"step1": {name: value.clone() for name, value in model.full_state_dict().items()}}
    out.update(skipped=optimizer.skipped_steps, state=model.full_state_dict())
    return out


def train_and_check(config: dict, bad_steps: set[int], tmp_path: Path) -> list[dict]:
    """`train` on WORLD ranks; then the checkpoint it saved before the first bad step must be intact."""
    checkpoints = tmp_path / "ckpt-{}".format("-".join(map(str, sorted(bad_steps))))
    ranks = run_distributed(train, WORLD, config, bad_steps, str(checkpoints), timeout=300)
    assert_checkpoints_intact(checkpoints, ranks[0]["saved"], tmp_path)
    return ranks


def reference(skipped: set[int]) -> dict[str, torch.Tensor]:
    """One plain process on the same global batches, taking no step in `skipped`."""
    return train_reference("stack", "adamw", STEPS, ROWS * WORLD, skipped=tuple(skipped))["state"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_skip_policy_skips_the_bad_step_on_every_rank_as_one_process_skipping_it(layout, tmp_path):
    ranks = train_and_check({**LAYOUTS[layout], "non_finite_gradients": "skip"}, {1}, tmp_path)
    want = reference({1})
    for rank, result in enumerate(ranks):
        assert result["error"] is None
        assert result["overflow"] == [False, True, False, False] and result["skipped"] == 1
        for name, value in want.items():
            assert relative_error(result["state"][name], value) < 1e-5, (rank, name)
    [warning] = ranks[0]["warnings"]
    assert warning.startswith(f"optimizer step 2: {NAMED}") and warning.endswith("); step skipped")
    assert ranks[1]["warnings"] == []
    # the skipped step counts: without it the embedding would have moved
    moved = reference(set())
    assert relative_error(ranks[0]["state"]["embed.weight"], moved["embed.weight"]) > 1e-4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stop_policy_stops_every_rank_at_the_bad_step_naming_it(layout, tmp_path):
    ranks = train_and_check({**LAYOUTS[layout], "non_finite_gradients": "stop"}, {1}, tmp_path)
    for result in ranks:
        assert result["at"] == 1 and result["unchanged"]
        assert result["error"].startswith(f"optimizer step 2: {NAMED}")
        assert "); training stopped (non_finite_gradients: stop, non_finite_stop_after: 1); fix: " in result["error"]
        assert "\n" not in result["error"]


def test_stop_after_k_stops_only_at_k_bad_steps_in_a_row(tmp_path):
    config = {"non_finite_gradients": "stop", "non_finite_stop_after": 2}
    apart, in_a_row = (train_and_check(config, bad, tmp_path) for bad in ({1, 3}, {1, 2}))
    want = reference({1, 3})
    for result in apart:
        assert result["error"] is None and result["skipped"] == 2
        assert result["overflow"] == [False, True, False, True]
        for name, value in want.items():
            assert relative_error(result["state"][name], value) < 1e-5, name
    for result in in_a_row:
        assert result["at"] == 2 and result["unchanged"] and result["overflow"] == [False, True]
        assert result["error"].startswith(f"optimizer step 3: {NAMED}0) in 2 steps in a row; training stopped")


def test_fp16_skips_the_bad_step_lowers_the_scale_and_counts_it(tmp_path):
    config = {"sharded_data_parallel_degree": 2, "fp16": True, "non_finite_gradients": "stop"}
    for result in train_and_check(config, {1}, tmp_path):
        assert result["error"] is None and result["skipped"] == 1
        assert result["overflow"] == [False, True, False, False]
        assert result["scales"][1] == result["scales"][0] / 2


def test_non_finite_keys_are_named_where_they_do_nothing():
    named = dict(ineffective_settings(ShardwiseConfig(fp16=True, non_finite_gradients="skip",
                                                      non_finite_stop_after=3)))
    assert "loss scaler" in named["non_finite_gradients"]
    assert named["non_finite_stop_after"] == "needs non_finite_gradients: stop"
    assert ineffective_settings(ShardwiseConfig(non_finite_gradients="stop", non_finite_stop_after=3)) == []
