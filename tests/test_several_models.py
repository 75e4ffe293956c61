"""Several DistributedModels in one process, each acted on explicitly: a GAN and a distillation.

`@sw.step` acts on the DistributedModels among its arguments and each
`DistributedOptimizer` on the model owning its parameters, so nothing depends on
which model was built last. Both scripts train on 4 gloo ranks under DDP, ZeRO-1,
ZeRO-3 and MiCS and match one plain process that runs the same script without
shardwise: losses per step and every parameter of every model within 1e-5.

- GAN: a generator and a discriminator (plain modules with repeated blocks), two
  optimizers (AdamW and SGD), `gradient_clipping` (each optimizer clips its own
  model), alternating steps; the generator's step runs both models and steps only
  the generator.
- Distillation: a GPT-2 teacher, frozen, under the same layout (sharded under
  ZeRO-3 and MiCS), and a GPT-2 student trained on the teacher's soft targets.

Two pipelined models train side by side, each in a @step of its own; one @step
cannot take a pipelined model and another (a one-line error).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.testing import run_distributed
from tiny_models import build, dataset, relative_error, seed_step, train_reference

WORLD, ROWS, STEPS, NOISE, WIDTH = 4, 2, 3, 8, 16
CLIP = 0.5
LAYOUTS = {
    "ddp": {},
    "zero1": {"shard_optimizer_state": True},
    "zero3": {"sharded_data_parallel_degree": WORLD},
    "mics": {"sharded_data_parallel_degree": 2},
}


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(NOISE, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.inp(z)
        for block in self.blocks:
            x = block(x)
        return x


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x).squeeze(-1)


def gan_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(7)
    return Generator(), Discriminator()


def gan_data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(rows, NOISE, generator=g), torch.randn(rows, WIDTH, generator=g) * 0.5 + 1.0


def d_loss(gen: nn.Module, disc: nn.Module, z: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    fake = gen(z).detach()
    return (F.binary_cross_entropy_with_logits(disc(real), torch.ones(len(real)))
            + F.binary_cross_entropy_with_logits(disc(fake), torch.zeros(len(fake))))


def g_loss(gen: nn.Module, disc: nn.Module, z: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(disc(gen(z)), torch.ones(len(z)))


def optimizers(gen_params, disc_params) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return torch.optim.AdamW(gen_params, lr=1e-2, eps=1e-6), torch.optim.SGD(disc_params, lr=0.1, momentum=0.9)


def train_gan(config: dict) -> dict:
    sw.init({**config, "gradient_clipping": CLIP})
    gen_module, disc_module = gan_models()
    gen, disc = sw.DistributedModel(gen_module), sw.DistributedModel(disc_module)
    gen_opt, disc_opt = (sw.DistributedOptimizer(o) for o in optimizers(gen.parameters(), disc.parameters()))

    @sw.step
    def disc_step(gen, disc, z, real):
        loss = d_loss(gen, disc, z, real)
        disc.backward(loss)
        return loss

    @sw.step
    def gen_step(gen, disc, z):
        loss = g_loss(gen, disc, z)
        gen.backward(loss)
        return loss

    z_all, real_all = gan_data(STEPS * ROWS * sw.dp_size())
    mine = slice(sw.dp_rank() * ROWS, (sw.dp_rank() + 1) * ROWS)
    losses = []
    for step in range(STEPS):
        batch = slice(step * ROWS * sw.dp_size(), (step + 1) * ROWS * sw.dp_size())
        z, real = z_all[batch][mine], real_all[batch][mine]
        disc_opt.zero_grad()
        losses.append(disc_step(gen, disc, z, real).reduce_mean().item())
        disc_opt.step()
        gen_opt.zero_grad()
        losses.append(gen_step(gen, disc, z).reduce_mean().item())
        gen_opt.step()
    return {"losses": losses, "gen": gen.full_state_dict(), "disc": disc.full_state_dict()}


@functools.cache
def gan_reference() -> dict:
    gen, disc = gan_models()
    gen_opt, disc_opt = optimizers(gen.parameters(), disc.parameters())
    z_all, real_all = gan_data(STEPS * ROWS * WORLD)
    losses = []
    for step in range(STEPS):
        batch = slice(step * ROWS * WORLD, (step + 1) * ROWS * WORLD)
        for opt, model, loss_of in ((disc_opt, disc, lambda: d_loss(gen, disc, z_all[batch], real_all[batch])),
                                    (gen_opt, gen, lambda: g_loss(gen, disc, z_all[batch]))):
            opt.zero_grad()
            loss = loss_of()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            losses.append(loss.item())
    return {"losses": losses, "gen": gen.state_dict(), "disc": disc.state_dict()}


def distillation_loss(student: nn.Module, teacher: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        soft = F.softmax(teacher(ids)["logits"], dim=-1)
    return F.cross_entropy(student(ids)["logits"].flatten(0, 1), soft.flatten(0, 1))


def train_distillation(config: dict) -> dict:
    sw.init(config)
    teacher_module = build("gpt2", seed=99).requires_grad_(False)
    teacher = sw.DistributedModel(teacher_module)
    student = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    opt = sw.DistributedOptimizer(torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9))

    @sw.step
    def distill_step(student, teacher, ids):
        loss = distillation_loss(student, teacher, ids)
        student.backward(loss)
        return loss

    losses = []
    for ids, _ in sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS, shuffle=False):
        opt.zero_grad()
        losses.append(distill_step(student, teacher, ids).reduce_mean().item())
        opt.step()
    return {"losses": losses, "student": student.full_state_dict(), "teacher": teacher.full_state_dict()}


@functools.cache
def distillation_reference() -> dict:
    teacher, student = build("gpt2", seed=99).requires_grad_(False), build("gpt2", freeze_key_bias=True)
    opt = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)
    data = dataset("gpt2", STEPS * ROWS * WORLD)
    losses = []
    for step in range(STEPS):
        ids, _ = data[step * ROWS * WORLD:(step + 1) * ROWS * WORLD]
        opt.zero_grad()
        loss = distillation_loss(student, teacher, ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "student": student.state_dict(), "teacher": teacher.state_dict()}


def _check(ranks: list[dict], want: dict, models: tuple[str, ...]) -> None:
    losses = torch.tensor([r["losses"] for r in ranks]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(want["losses"]), rtol=1e-5, atol=0)
    for rank, got in enumerate(ranks):
        for model in models:
            errors = {k: relative_error(got[model][k], v) for k, v in want[model].items()}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= 1e-5, f"rank {rank}: {model}.{worst} differs by {errors[worst]:.2e}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gan_trains_the_same_math_as_one_process(layout):
    _check(run_distributed(train_gan, WORLD, LAYOUTS[layout], timeout=300), gan_reference(), ("gen", "disc"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_distillation_with_a_frozen_teacher_trains_the_same_math(layout):
    _check(run_distributed(train_distillation, WORLD, LAYOUTS[layout], timeout=300), distillation_reference(),
           ("student", "teacher"))


def misuse() -> dict[str, str]:
    """One message per way of using a second model or optimizer wrongly."""
    sw.init({})
    first, second = sw.DistributedModel(nn.Linear(4, 4)), sw.DistributedModel(nn.Linear(4, 4))
    messages = {}
    cases = {
        "foreign optimizer": lambda: sw.DistributedOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)),
        "two models": lambda: sw.DistributedOptimizer(
            torch.optim.SGD(list(first.parameters()) + list(second.parameters()), lr=1)),
        "no model in step": lambda: sw.step(lambda x: x)(torch.ones(2, 4)),
    }
    for name, call in cases.items():
        try:
            call()
        except (ValueError, RuntimeError) as err:
            messages[name] = str(err)
    return messages


def test_a_second_model_or_optimizer_used_wrongly_is_a_one_line_error():
    assert run_distributed(misuse, 2)[0] == {
        "foreign optimizer": "DistributedOptimizer: none of the optimizer's parameters belongs to a "
                             "sw.DistributedModel; create the DistributedModel first and build the optimizer from "
                             "its parameters",
        "two models": "DistributedOptimizer: the optimizer's parameters belong to 2 DistributedModels; give each "
                      "model an optimizer of its own",
        "no model in step": "@step found no sw.DistributedModel among the step function's arguments and 2 live "
                            "ones, so it cannot tell which it runs; pass the model in, e.g. "
                            "train_step(model, inputs, targets)",
    }


def pipelined_with_another() -> str:
    sw.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    piped, other = sw.DistributedModel(build("gpt2")), sw.DistributedModel(build("gpt2"))

    @sw.step
    def both(piped, other, ids):
        return piped(ids)["logits"].sum() + other(ids)["logits"].sum()

    try:
        both(piped, other, torch.zeros(2, 8, dtype=torch.long))
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_pipelined_model_takes_a_step_of_its_own():
    assert run_distributed(pipelined_with_another, 2)[0] == (
        "a pipelined DistributedModel runs a whole @step through its schedule, so the step takes no other "
        "DistributedModel; give each model a @step function of its own")


def two_pipelines() -> dict:
    """Two pipelined GPT-2s built alike, each with its own optimizer and @step, trained alternately."""
    sw.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    models = [sw.DistributedModel(build("gpt2", freeze_key_bias=True)) for _ in range(2)]
    optimizers = [sw.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) for m in models]
    train_step = seed_step("gpt2")
    losses: dict[int, list] = {0: [], 1: []}
    for ids, targets in sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS, shuffle=False):
        for index, (model, opt) in enumerate(zip(models, optimizers)):
            opt.zero_grad()
            out = train_step(model, ids, targets)
            opt.step()
            losses[index].append(out.reduce_mean().item() if out.holds_loss else None)
    return losses


def test_two_pipelined_models_train_side_by_side_in_steps_of_their_own():
    want = train_reference("gpt2", "sgd", STEPS, ROWS * 2)["losses"]   # 2 replicas of 2 stages
    held = [r for r in run_distributed(two_pipelines, WORLD, timeout=300) if r[0][0] is not None]
    for index in (0, 1):
        got = torch.tensor([r[index] for r in held]).mean(0)
        torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=0)


def _owner_despite_a_stale_original() -> list[str]:
    """Model A, from an earlier build and not yet collected, took the new model's parameters for originals it
    replaced (as when a freed original's id is reused by a parameter of the same shape): the optimizer built from
    model B's own parameters still belongs to B, and one built before A from A's originals to A."""
    sw.init({"sharded_data_parallel_degree": 2})
    first = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    early = torch.optim.SGD(first.parameters(), lr=0.1)  # built before its model, from the originals
    old = sw.DistributedModel(first)
    new = sw.DistributedModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    stale = old.original_names._originals
    record = type(next(iter(stale.values())))
    for param in new.get_module().parameters():  # the reused ids, simulated
        stale[id(param)] = record(("0.weight",), param.shape, param.dtype)
    sw.DistributedOptimizer(torch.optim.SGD(new.parameters(), lr=0.1))
    sw.DistributedOptimizer(early)
    return ["ok"]


def test_the_model_holding_the_parameters_owns_the_optimizer_before_one_that_replaced_them():
    assert run_distributed(_owner_despite_a_stale_original, 2) == [["ok"], ["ok"]]
