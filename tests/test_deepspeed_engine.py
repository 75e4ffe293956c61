"""`shardwise.deepspeed`: DeepSpeed's `initialize` and engine train the same math as one process.

Each rank runs a DeepSpeed-style loop (`engine(batch)`, `engine.backward(loss)`, `engine.step()`) over the
loader `initialize` built from `training_data`. DeepSpeed deals samples to the data-parallel ranks
interleaved, so micro-batch k of every rank together is micro-batch k of one process whose micro batch is
`ranks` times larger: that process, with the same accumulation, is the reference.

- every `initialize` form (args with --deepspeed_config, config=, config_params=, a given optimizer, a
  callable one over param-group dicts, a given or callable scheduler, collate_fn) at ZeRO 0-3 on 2 ranks,
  ZeRO-1 and ZeRO-3 on 4, and MiCS (mics_shard_size) on 4;
- DeepSpeed's counters, learning rates and accumulation boundary;
- two engines in one script (a GAN's generator and discriminator);
- save_checkpoint/load_checkpoint with client state and the `latest` tag, resumed in another layout;
- zero.Init and zero.GatheredParameters under ZeRO-3;
- the one-line errors of misuse.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

from shardwise.testing import run_distributed
from tiny_models import VOCAB, build, dataset, loss_fn

STEPS, GAS, MICRO, ROWS = 3, 2, 2, 64
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-6, "torch_adam": True}}
BASE = {"gradient_accumulation_steps": GAS, "optimizer": ADAMW, "gradient_clipping": 1.0,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}}}
TOLERANCE = 1e-5


def _param_groups(model: torch.nn.Module) -> list[dict]:
    """Two groups as scripts write them: no weight decay on biases and norms."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def _initialize(form: str, config: dict, micro: int, tmp: str):
    """deepspeed.initialize in one of its documented forms."""
    import shardwise.deepspeed as deepspeed

    model = build("stack")
    config = dict(config, train_micro_batch_size_per_gpu=micro)
    data = dataset("stack", ROWS)
    if form == "args":
        path = f"{tmp}/ds_config.json"
        if torch.distributed.get_rank() == 0:
            with open(path, "w") as file:
                json.dump(config, file)
        torch.distributed.barrier()
        parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
        args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
        return deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), training_data=data)
    if form == "config_params":
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config_params=config,
                                    training_data=data)
    if form == "optimizer":  # a torch optimizer and scheduler built by the script
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        config = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}
        return deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config,
                                    training_data=data)
    if form == "callables":  # param-group dicts, an optimizer and a scheduler built from callables
        config = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}
        return deepspeed.initialize(
            model=model, model_parameters=_param_groups(model), config=config, training_data=data,
            optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3, eps=1e-6),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
            collate_fn=lambda rows: tuple(torch.stack(column) for column in zip(*rows)))
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, training_data=data)


def train(form: str, config: dict, micro: int, tmp: str, steps: int = STEPS) -> dict:
    """One rank of the DeepSpeed loop: per-micro-step losses, learning rates, counters, rank 0's parameters."""
    engine, optimizer, loader, scheduler = _initialize(form, config, micro, tmp)
    losses, lrs, boundaries = [], [], []
    batches = iter(loader)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        ids, targets = next(batches)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        loss = loss_fn("stack", engine, ids, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
    state = engine.module_state_dict()
    return {"losses": losses, "lrs": lrs, "boundaries": boundaries, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "micro_steps": engine.micro_steps,
            "optimizer_is_returned": optimizer is engine.optimizer, "scheduler_is_returned":
            scheduler is engine.lr_scheduler, "state": state if torch.distributed.get_rank() == 0 else None}


def _assert_same(ranks: list[dict], want: dict, tolerance: float = TOLERANCE) -> None:
    mean = [sum(values) / len(values) for values in zip(*(r["losses"] for r in ranks))]
    assert mean == pytest.approx(want["losses"], rel=tolerance, abs=tolerance)
    for name, value in want["state"].items():
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=tolerance, atol=tolerance, msg=name)
    assert ranks[0]["lrs"] == pytest.approx(want["lrs"])


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("reference"))
    return {form: run_distributed(train, 1, form, BASE, 2 * MICRO, tmp)[0]
            for form in ("config", "optimizer", "callables")}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_trains_as_one_process(stage, references, tmp_path):
    config = dict(BASE, zero_optimization={"stage": stage})
    ranks = run_distributed(train, 2, "config", config, MICRO, str(tmp_path))
    _assert_same(ranks, references["config"])
    assert ranks[0]["global_steps"] == STEPS and ranks[0]["micro_steps"] == STEPS * GAS
    assert ranks[0]["global_samples"] == STEPS * GAS * MICRO * 2
    assert ranks[0]["boundaries"] == [False, True] * STEPS
    assert ranks[0]["optimizer_is_returned"] and ranks[0]["scheduler_is_returned"]


@pytest.mark.parametrize("form,stage", [("args", 3), ("config_params", 1), ("optimizer", 2), ("callables", 3),
                                        ("callables", 0)])
def test_every_initialize_form_trains_as_one_process(form, stage, references, tmp_path):
    config = dict(BASE, zero_optimization={"stage": stage})
    ranks = run_distributed(train, 2, form, config, MICRO, str(tmp_path))
    _assert_same(ranks, references[{"args": "config", "config_params": "config"}.get(form, form)])


@pytest.mark.parametrize("stage", [1, 3])
def test_four_ranks_train_as_one_process(stage, references, tmp_path):
    config = dict(BASE, zero_optimization={"stage": stage})
    ranks = run_distributed(train, 4, "callables", config, MICRO // 2, str(tmp_path))
    _assert_same(ranks, references["callables"])


def test_scheduler_steps_only_at_the_boundary(references):
    """The learning rate changes after each boundary's optimizer step and holds between them."""
    lrs = references["config"]["lrs"]
    assert [lrs[i] for i in range(1, len(lrs) - 1, GAS)] == [lrs[i + 1] for i in range(1, len(lrs) - 1, GAS)]
    assert len(set(lrs[GAS - 1::GAS])) == STEPS


def _gan(config: dict, micro: int, steps: int) -> dict:
    """DeepSpeedExamples' GAN pattern: two engines, one config, each its own optimizer, the discriminator's
    loss on real and generated rows, the generator's through the discriminator."""
    import shardwise.deepspeed as deepspeed

    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    discriminator = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = dict(config, train_micro_batch_size_per_gpu=micro)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    netD, optD, loader, _ = deepspeed.initialize(model=discriminator, model_parameters=discriminator.parameters(),
                                                 config=config, training_data=data,
                                                 optimizer=torch.optim.Adam(discriminator.parameters(), lr=2e-3))
    netG, optG, _, _ = deepspeed.initialize(model=generator, model_parameters=generator.parameters(), config=config,
                                            optimizer=torch.optim.Adam(generator.parameters(), lr=1e-3))
    losses = []
    for step, (real, noise) in enumerate(loader):
        if step == steps:
            break
        fake = netG(noise)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        errD = (F.binary_cross_entropy_with_logits(netD(real), ones)
                + F.binary_cross_entropy_with_logits(netD(fake.detach()), zeros))
        netD.backward(errD)
        netD.step()
        errG = F.binary_cross_entropy_with_logits(netD(fake), ones)
        netG.backward(errG)
        netG.step()
        netD.zero_grad()  # the generator's backward left gradients in the discriminator
        losses.append((errD.item(), errG.item()))
    states = (netG.module_state_dict(), netD.module_state_dict())
    return {"losses": losses, "states": states if torch.distributed.get_rank() == 0 else None}


@pytest.mark.parametrize("stage", [0, 3])
def test_two_engines_in_one_script_train_as_one_process(stage):
    config = {"zero_optimization": {"stage": stage}}
    want = run_distributed(_gan, 1, config, 2 * MICRO, 4)[0]
    ranks = run_distributed(_gan, 2, config, MICRO, 4)
    mean = [sum(v) / 2 for pair in zip(ranks[0]["losses"], ranks[1]["losses"]) for v in zip(*pair)]
    assert mean == pytest.approx([v for pair in want["losses"] for v in pair], rel=TOLERANCE, abs=TOLERANCE)
    for got, expected in zip(ranks[0]["states"], want["states"]):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=TOLERANCE, atol=TOLERANCE)


def _save_then_resume(save_config: dict, load_config: dict, micro_save: int, micro_load: int, tmp: str,
                      resume: str | None) -> dict:
    """Train 2 steps and save (tag default, client state), then in a fresh engine of `load_config` load the
    latest and train 2 more on the batches after the saved ones (the script skips them itself, as DeepSpeed
    scripts do)."""
    import shardwise as sw
    import shardwise.deepspeed as deepspeed

    first = {"losses": []}
    if not resume:
        engine, _, loader, _ = _initialize("config", save_config, micro_save, tmp)
        batches = iter(loader)
        for _ in range(2 * GAS):
            ids, targets = next(batches)
            loss = loss_fn("stack", engine, ids, targets)
            engine.backward(loss)
            engine.step()
            first["losses"].append(loss.item())
        assert engine.save_checkpoint(f"{tmp}/ckpt", client_sd={"epoch": 7, "note": "mid-epoch"})  # the seed's name
        return first
    engine, _, loader, _ = _initialize("config", load_config, micro_load, tmp)
    path, client = engine.load_checkpoint(f"{tmp}/ckpt", ckpt_id="global_step2" if resume == "by id" else None)
    losses = []
    batches = iter(loader)
    for _ in range(engine.global_steps * GAS):  # the samples the saved steps consumed
        next(batches)
    for _ in range(2 * GAS):
        ids, targets = next(batches)
        loss = loss_fn("stack", engine, ids, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.module_state_dict()
    return {"path": path, "client": client, "global_steps": engine.global_steps, "lr": engine.get_lr()[0],
            "losses": losses, "state": state if sw.rank() == 0 else None,
            "missing": engine.load_checkpoint(f"{tmp}/nothing-here")}


def test_checkpoint_resumes_in_another_layout_with_client_state(references, tmp_path):
    """Saved by ZeRO-3 on 2 ranks, resumed by ZeRO-1 on 2 ranks and by one process: the uninterrupted run's
    losses and parameters, DeepSpeed's (path, client_state) and counters, the `latest` tag file."""
    tmp = str(tmp_path)
    long_config = dict(BASE, zero_optimization={"stage": 3})
    want = run_distributed(train, 1, "config", BASE, 2 * MICRO, tmp, 4)[0]
    run_distributed(_save_then_resume, 2, long_config, None, MICRO, None, tmp, None)
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    for world, stage, micro, resume in ((2, 1, MICRO, "latest"), (1, 0, 2 * MICRO, "by id")):
        ranks = run_distributed(_save_then_resume, world, None, dict(BASE, zero_optimization={"stage": stage}),
                                None, micro, tmp, resume)
        got = ranks[0]
        assert got["path"].endswith("ckpt/global_step2") and got["client"] == {"epoch": 7, "note": "mid-epoch"}
        assert got["global_steps"] == 4 and got["missing"] == (None, None)
        mean = [sum(v) / world for v in zip(*(r["losses"] for r in ranks))]
        assert mean == pytest.approx(want["losses"][2 * GAS:], rel=TOLERANCE, abs=TOLERANCE)
        for name, value in want["state"].items():
            torch.testing.assert_close(got["state"][name], value, rtol=TOLERANCE, atol=TOLERANCE)


def _zero_init_and_gather(world: int) -> dict:
    """A model built inside zero.Init (on the meta device until the engine places its shards), trained one
    step; then GatheredParameters shows whole weights, and rank 0's edit reaches every rank's shards."""
    import shardwise.deepspeed as deepspeed
    from shardwise.deepspeed.runtime.utils import set_random_seed

    set_random_seed(1234)
    config = {"train_micro_batch_size_per_gpu": 8 // world, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                    torch.nn.LayerNorm(32), torch.nn.Linear(32, VOCAB))
    built_on_meta = all(p.is_meta for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=config, training_data=dataset("stack", 32))
    ids, targets = next(iter(engine.training_dataloader))
    engine.backward(F.cross_entropy(engine(ids).flatten(0, 1), targets.flatten()))
    engine.step()
    head = engine.module[4]
    with deepspeed.zero.GatheredParameters(head.weight, modifier_rank=None):
        seen = tuple(head.weight.shape)
    with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=0):
        if deepspeed.comm.get_rank() == 0:
            head.weight.data.fill_(0.5)
    with deepspeed.zero.GatheredParameters(head.weight):
        after = head.weight.detach().clone()
    state = engine.module_state_dict()
    return {"meta": built_on_meta, "seen": seen, "after": after, "state": state}


def test_zero_init_builds_on_meta_and_gathered_parameters_edit_every_shard():
    one = run_distributed(_zero_init_and_gather, 1, 1)[0]
    ranks = run_distributed(_zero_init_and_gather, 2, 2)
    for got in ranks:
        assert got["meta"] and got["seen"] == (128, 32)
        assert bool((got["after"] == 0.5).all())
    for name, value in one["state"].items():
        torch.testing.assert_close(ranks[1]["state"][name], value, rtol=TOLERANCE, atol=TOLERANCE, msg=name)


def _misuse(case: str, tmp: str) -> str:
    import shardwise.deepspeed as deepspeed

    model = build("stack")
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    try:
        if case == "no config":
            deepspeed.initialize(model=model)
        elif case == "config twice":
            args = argparse.Namespace(deepspeed_config=f"{tmp}/x.json")
            deepspeed.initialize(args=args, model=model, config=config)
        elif case == "mpu":
            deepspeed.initialize(model=model, config=config, mpu=object())
        elif case == "no model":
            deepspeed.initialize(config=config)
        elif case == "missing file":
            deepspeed.initialize(model=model, config=f"{tmp}/absent.json")
        elif case == "other layout":
            deepspeed.initialize(model=model, config=config)
            deepspeed.initialize(model=build("stack"), config=dict(config, zero_optimization={"stage": 3}))
        elif case == "no optimizer":
            engine, *_ = deepspeed.initialize(model=model, config=config)
            engine.backward(engine(torch.zeros(2, 8, dtype=torch.long))["logits"].sum())
        elif case == "no_sync at ZeRO-2":
            engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=torch.optim.SGD(
                model.parameters(), lr=0.1))
            with engine.no_sync():
                pass
        elif case == "step in no_sync":
            engine, *_ = deepspeed.initialize(model=model, config=dict(config, zero_optimization={"stage": 0}),
                                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
            with engine.no_sync():
                engine.step()
    except Exception as error:  # noqa: BLE001  (the message is what is checked)
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("case,message", [
    ("no config", "no DeepSpeed config; pass --deepspeed_config FILE"),
    ("config twice", "the config is given twice, by --deepspeed_config"),
    ("mpu", "initialize(mpu=...): shardwise builds its own tensor-parallel groups"),
    ("no model", "requires a model"),
    ("missing file", "file does not exist"),
    ("other layout", "every engine of a process shares one layout"),
    ("no optimizer", "engine.backward needs an optimizer"),
    ("no_sync at ZeRO-2", "no_sync() is incompatible with ZeRO stage 2"),
    ("step in no_sync", "engine.step() is illegal inside engine.no_sync()"),
])
def test_misuse_is_a_one_line_error(case, message, tmp_path):
    error = run_distributed(_misuse, 1, case, str(tmp_path))[0]
    assert message in error and "\n" not in error.strip(), error


def _monitored(tmp: str) -> None:
    config = dict(BASE, steps_per_print=2000, csv_monitor={"enabled": True, "output_path": tmp, "job_name": "run"})
    train("config", config, MICRO, tmp)
    import shardwise as sw

    sw.shutdown()  # closes the sinks


def test_monitors_record_every_step_whatever_steps_per_print(tmp_path):
    """steps_per_print throttles the console line only: the csv monitor has a row per optimizer step, with the
    step's mean loss and its global samples."""
    run_distributed(_monitored, 2, str(tmp_path))
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    header, records = rows[0].split(","), [dict(zip(rows[0].split(","), row.split(","))) for row in rows[1:]]
    assert "loss" in header and len(records) == STEPS
    assert all(int(record["samples"]) == GAS * MICRO * 2 and float(record["loss"]) > 0 for record in records)


def _layout_of(config: dict, micro: int, tmp: str) -> dict:
    result = train("config", config, micro, tmp)
    import shardwise as sw
    from shardwise.runtime.state import current

    layout = current().layout
    return {**result, "groups": (layout.dp_replicate, layout.dp_shard), "ranks": sw.size()}


def test_mics_shard_size_trains_as_one_process_in_partition_groups(references, tmp_path):
    """DeepSpeed's MiCS key: ZeRO-3 inside partition groups of mics_shard_size ranks, replicas across them."""
    config = dict(BASE, zero_optimization={"stage": 3, "mics_shard_size": 2})
    ranks = run_distributed(_layout_of, 4, config, MICRO // 2, str(tmp_path))
    assert ranks[0]["groups"] == (2, 2)
    _assert_same(ranks, references["config"])


def _comm_and_accelerator() -> dict:
    import shardwise.deepspeed as deepspeed
    from shardwise.deepspeed import comm as dist
    from shardwise.deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed()
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    dist.barrier()
    accelerator = get_accelerator()
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "local": dist.get_local_rank(),
            "sum": value.item(), "device": accelerator.device_name(), "backend": accelerator.communication_backend_name(),
            "current": accelerator.current_device_name()}


def test_comm_and_accelerator_answer_as_deepspeed_does():
    ranks = run_distributed(_comm_and_accelerator, 2)
    expected_type = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    for rank, got in enumerate(ranks):
        assert (got["rank"], got["world"], got["local"], got["sum"]) == (rank, 2, rank, 3.0)
        assert got["device"] == expected_type and got["current"].startswith(expected_type)
        assert got["backend"] == ("gloo" if expected_type == "cpu" else got["backend"])


def _module_called_directly(stage: int, micro: int) -> dict:
    """DeepSpeedExamples' DCGAN pattern: the forward calls the module itself, the engine does backward and step."""
    import shardwise.deepspeed as deepspeed

    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model = build("stack")
    engine, _, loader, _ = deepspeed.initialize(model=model, config=config, training_data=dataset("stack", 32))
    batches = iter(loader)
    for _ in range(4):
        ids, targets = next(batches)
        engine.backward(loss_fn("stack", engine.module, ids, targets))
        engine.step()
    return engine.module_state_dict()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_forward_around_the_engine_trains_as_one_process(stage):
    """The module called directly, not the engine: under DDP's replicas (ZeRO-0) its gradients are averaged at
    the boundary, as DeepSpeed's engine does; under ZeRO-3 the module is FSDP2's and reduces by itself."""
    want = run_distributed(_module_called_directly, 1, stage, 4)[0]
    got = run_distributed(_module_called_directly, 2, stage, 2)
    for name, value in want.items():
        torch.testing.assert_close(got[0][name], value, rtol=TOLERANCE, atol=TOLERANCE, msg=name)
