"""An optimizer built before `DistributedModel`, as SMP scripts build it, trains as one built after.

    opt = torch.optim.AdamW(groups(module.named_parameters()))
    model = sw.DistributedModel(module)
    opt = sw.DistributedOptimizer(opt)

Sharding, tensor parallelism and the pipeline replace the Parameter objects or
leave them to other ranks; `DistributedOptimizer` maps the optimizer's
parameters to the model's by name (parallel/param_mapping.py). Each config's world
trains a tiny GPT-2 (token embedding tied to the head) for 3 steps both ways,
with three param groups of different lr and weight decay, the third holding
only the position embedding (so it is empty on the second pipeline stage), and
checks:

- before against after: losses, every whole parameter (`full_state_dict()`) on
  every rank, and each group's size and options, to 1e-6 relative (measured:
  bitwise equal in every config);
- both against one plain process with the same groups, 1e-5 relative as in
  test_same_math.py (except in bf16 and with delayed initialisation).
"""

from __future__ import annotations

import functools

import pytest
import torch

import shardwise as sw
from shardwise.testing import run_distributed
from tiny_models import build, dataset, loss_fn, relative_error, seed_step

WORLD = 4
ROWS = 2  # per data-parallel rank and step
STEPS = 3
SAME = 1e-6  # before against after
TOLERANCE = 1e-5  # against one plain process
POSITIONS = "transformer.wpe.weight"

CONFIGS = {
    "ddp": {},
    "zero1": {"shard_optimizer_state": True},
    "zero1-bf16": {"shard_optimizer_state": True, "bf16": True},
    "zero2": {"zero_stage": 2, "sharded_data_parallel_degree": WORLD},
    "zero3": {"sharded_data_parallel_degree": WORLD},
    "mics": {"sharded_data_parallel_degree": 2},
    "tp2": {"tensor_parallel_degree": 2},
    "tp2-sdp2": {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},
    "tp2-sequence-parallel": {"tensor_parallel_degree": 2, "sequence_parallel": True},
    "pp2": {"pipeline_parallel_degree": 2, "microbatches": 2},
    # built on the meta device: the optimizer holds meta parameters, which initialisation replaces
    "zero3-delayed": {"sharded_data_parallel_degree": WORLD, "delayed_parameter_initialization": True},
}
# No plain process to compare with: bf16 rounds, and delayed initialisation draws its own initial weights.
NO_REFERENCE = {"zero1-bf16", "zero3-delayed"}


def adamw(named_parameters) -> torch.optim.AdamW:
    """Decay for matrices, none for biases and norms (higher lr), and the position embedding on its own."""
    named = list(named_parameters)

    def pick(rule):
        return [p for name, p in named if rule(name, p)]

    return torch.optim.AdamW([
        {"params": pick(lambda name, p: p.dim() >= 2 and name != POSITIONS), "weight_decay": 0.1},
        {"params": pick(lambda name, p: p.dim() < 2), "weight_decay": 0.0, "lr": 3e-3},
        {"params": pick(lambda name, p: name == POSITIONS), "weight_decay": 0.05, "lr": 5e-4},
    ], lr=1e-3, eps=1e-6)


def train(before: bool) -> dict:
    """The seed's loop on this rank, the optimizer built `before` the model or after it."""
    with sw.delay_param_initialization():  # on the meta device if the config asks for it
        module = build("gpt2", freeze_key_bias=True)
    if before:
        optimizer = adamw(module.named_parameters())
        model = sw.DistributedModel(module)
    else:
        model = sw.DistributedModel(module)
        optimizer = adamw(model.named_parameters())
    opt = sw.DistributedOptimizer(optimizer)
    train_step = seed_step("gpt2")
    losses = []
    for inputs, targets in sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS,
                                          shuffle=False):
        opt.zero_grad()
        loss = train_step(model, inputs, targets).reduce_mean()  # None off the last pipeline stage
        losses.append(None if loss is None else loss.item())
        opt.step()
    groups = [(len(g["params"]), g["lr"], g["weight_decay"]) for g in opt.param_groups]
    return {"losses": losses, "state": model.full_state_dict(), "groups": groups}


def both_orders(config: dict) -> dict:
    sw.init(config)
    return {"after": train(before=False), "before": train(before=True), "dp_size": sw.dp_size()}


@functools.cache
def reference(global_batch: int) -> dict:
    """One plain process, no shardwise, the same groups and global batches."""
    model = build("gpt2", freeze_key_bias=True)
    opt = adamw(model.named_parameters())
    data = dataset("gpt2", STEPS * global_batch)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_fn("gpt2", model, *data[step * global_batch:(step + 1) * global_batch])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def mean_losses(results: list[dict]) -> torch.Tensor:
    """Per step, over the ranks that hold the loss."""
    return torch.tensor([r["losses"] for r in results if r["losses"][0] is not None]).mean(0)


def assert_close_state(got: dict, want: dict, tolerance: float, what: str) -> None:
    assert set(got) >= set(want), what
    errors = {name: relative_error(got[name], value) for name, value in want.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, f"{what}: {worst} differs by {errors[worst]:.2e} (relative)"


@pytest.mark.parametrize("mode", CONFIGS)
def test_optimizer_built_before_the_model_trains_as_one_built_after(mode):
    ranks = run_distributed(both_orders, WORLD, CONFIGS[mode], timeout=180)
    for rank, result in enumerate(ranks):
        before, after = result["before"], result["after"]
        assert before["groups"] == after["groups"], f"rank {rank}"
        if after["losses"][0] is None:
            assert before["losses"] == after["losses"], f"rank {rank}"
        else:
            assert before["losses"] == pytest.approx(after["losses"], rel=SAME, abs=0), f"rank {rank}"
        assert_close_state(before["state"], after["state"], SAME, f"rank {rank}, before against after")
    if mode == "pp2":  # the second stage keeps the position embedding's group, empty, with its options
        assert {r["before"]["groups"][2] for r in ranks} == {(1, 5e-4, 0.05), (0, 5e-4, 0.05)}
    if mode in NO_REFERENCE:
        return
    want = reference(ROWS * ranks[0]["dp_size"])
    for order in ("before", "after"):
        torch.testing.assert_close(mean_losses([r[order] for r in ranks]), torch.tensor(want["losses"]),
                                   rtol=TOLERANCE, atol=0)
        for rank, result in enumerate(ranks):
            assert_close_state(result[order]["state"], want["state"], TOLERANCE, f"rank {rank}, {order}")


def wrap_catching(config: dict) -> dict:
    """What `DistributedOptimizer` says of an optimizer built before the model that has stepped, and of one
    that holds a parameter of no model."""
    sw.init(config)
    said = {}
    for case in ("stepped", "foreign"):
        module = build("gpt2", freeze_key_bias=True)
        optimizer = adamw(module.named_parameters())
        if case == "stepped":
            for param in module.parameters():
                param.grad = torch.zeros_like(param)
            optimizer.step()
        else:
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, 3))]})
        model = sw.DistributedModel(module)  # kept, as a script keeps it: the optimizer binds to a live model
        try:
            sw.DistributedOptimizer(optimizer)
            said[case] = "no error"
        except Exception as err:  # noqa: BLE001 - the test looks at the type and message
            said[case] = f"{type(err).__name__}: {err}"
        del model
    return said


STEPPED = ("RuntimeError: DistributedOptimizer: the optimizer has already taken steps on parameters that "
           "DistributedModel replaced; build or wrap it before training")
FOREIGN = ("ValueError: DistributedOptimizer: the optimizer's param_groups[3]['params'][0] (shape (2, 3)) is not "
           "a parameter of the DistributedModel; build the optimizer from that model's parameters")


@pytest.mark.parametrize("mode, stepped", [("zero3", STEPPED), ("ddp", "no error")])
def test_stepped_or_foreign_optimizers_are_explained(mode, stepped):
    """State for replaced parameters cannot follow them (DDP keeps the objects, so its state stays valid);
    a parameter of no model would silently never train."""
    assert run_distributed(wrap_catching, WORLD, CONFIGS[mode]) == [{"stepped": stepped, "foreign": FOREIGN}] * WORLD
