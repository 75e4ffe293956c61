"""`sw.init`: one process with no launcher, the config `shardwise run` hands over (merged with one given
to init, conflicts refused), and ranks that disagree on the config failing fast on every rank instead of
hanging.

(The whole `shardwise run --set ...` → `sw.init()` path runs in test_seed_script.py.)
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import shardwise as sw
from shardwise.config import ConfigError, parse_config
from shardwise.rundir import RunDir
from shardwise.runtime.init import CONFIG_ENV
from shardwise.testing import run_distributed
from tiny_models import build, dataset, loss_fn, make_optimizer, relative_error, train_reference, train_seed_loop

LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", CONFIG_ENV)


@pytest.fixture
def no_launcher(monkeypatch):
    """A plain `python train.py`: no torchrun variables, no config from `shardwise run`."""
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    if sw.is_initialized():
        sw.shutdown()


def test_one_process_without_a_launcher_trains_like_plain_pytorch(no_launcher):
    """Defaults (pure data parallelism) on a world of one; two SGD steps equal plain PyTorch's."""
    config = sw.init()
    assert config == parse_config({})
    assert (sw.rank(), sw.size(), sw.dp_size(), sw.local_rank()) == (0, 1, 1, 0)
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    optimizer = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))

    @sw.step
    def train_step(model, inputs, targets):
        loss = loss_fn("gpt2", model, inputs, targets)
        model.backward(loss)
        return loss

    losses = []
    for inputs, targets in sw.data_loader(dataset("gpt2", 8), batch_size=4, shuffle=False):
        optimizer.zero_grad()
        losses.append(train_step(model, inputs, targets).reduce_mean().item())
        optimizer.step()
    want = train_reference("gpt2", "sgd", steps=2, global_batch=4)
    assert losses == pytest.approx(want["losses"], rel=1e-6)
    state = model.full_state_dict()
    assert max(relative_error(state[k], v) for k, v in want["state"].items()) < 1e-6


def test_no_argument_takes_the_config_shardwise_run_wrote(no_launcher, tmp_path, monkeypatch):
    """`shardwise run` writes the validated config into the run directory and names it in the
    environment; `sw.init()` with no argument reads it back unchanged."""
    given = parse_config({"microbatches": 2, "gradient_clipping": 1.0, "zero_stage": 0})
    path = RunDir(tmp_path).create().write_config(given)
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert sw.init() == given


@pytest.fixture
def launched(no_launcher, tmp_path, monkeypatch):
    """`shardwise run --set ...`: the keys given, written as the launcher writes them, named in the environment."""
    def write(given: dict) -> str:
        path = RunDir(tmp_path).create().write_config(parse_config(given))
        monkeypatch.setenv(CONFIG_ENV, str(path))
        return str(path)
    return write


def test_init_config_and_launcher_config_merge(launched):
    """Keys only one source sets come from it; a key both set to the same value is fine."""
    launched({"microbatches": 2, "gradient_clipping": 1.0})
    config = sw.init({"microbatches": 2, "bf16": True})
    assert config == parse_config({"microbatches": 2, "gradient_clipping": 1.0, "bf16": True})


def test_defaults_the_launcher_did_not_get_do_not_conflict(launched, tmp_path):
    """The launcher writes only the keys it was given, so init's own values for the others stand."""
    launched({"bf16": True})
    assert (tmp_path / "config.json").read_text() == '{\n  "bf16": true\n}\n'
    assert sw.init(parse_config({"microbatches": 2})) == parse_config({"bf16": True, "microbatches": 2})


def test_keys_set_differently_are_all_named_with_both_sources(launched):
    """No silent winner: every conflict, with both values and the launcher's file, in one error with the rest."""
    path = launched({"gradient_clipping": 1.0, "microbatches": 2, "bf16": True})
    with pytest.raises(ConfigError) as info:
        sw.init({"gradient_clipping": 0.5, "microbatches": 4, "bf16": True, "bogus": 1})
    fix = "fix: give the key one value: drop it from init() or from the `shardwise run` config, or make them equal"
    assert str(info.value).splitlines() == [
        "invalid shardwise config:",
        f"  gradient_clipping=0.5: init() passes 0.5 but the launcher's config ({path}) sets 1.0; {fix}",
        f"  microbatches=4: init() passes 4 but the launcher's config ({path}) sets 2; {fix}",
        "  bogus=1: unknown key; fix: remove it; valid keys are listed in the README's config reference",
    ]
    assert not torch.distributed.is_initialized()


def test_world_size_without_a_rendezvous_address_is_refused(no_launcher, monkeypatch):
    """Not a world of one in disguise: each process would train alone."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match=r"^WORLD_SIZE=4 is set but MASTER_ADDR is not, so this process cannot "
                                           r"join the other ranks; fix: start the ranks with `shardwise run` or "
                                           r"torchrun, or unset WORLD_SIZE to run one process$"):
        sw.init()
    assert not torch.distributed.is_initialized()


def test_second_init_and_use_before_init_are_explained(no_launcher):
    with pytest.raises(RuntimeError, match=r"shardwise.DistributedModel needs shardwise.init\(\) first"):
        sw.DistributedModel(torch.nn.Linear(2, 2))
    sw.init({})
    with pytest.raises(RuntimeError, match=r"already called in this process; call shardwise.shutdown\(\) first"):
        sw.init({})


def init_catching(configs: list[dict]) -> str:
    """Rank r calls init with configs[r]; returns what it raised."""
    try:
        sw.init(configs[torch.distributed.get_rank()])
    except Exception as err:  # noqa: BLE001 - the test looks at the type and message
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_config_mismatch_is_an_error_on_every_rank():
    """Rank 1 got another config: every rank raises the same error (the hard timeout catches a hang)."""
    configs = [{"sharded_data_parallel_degree": 2}] * 4
    configs[1] = {"sharded_data_parallel_degree": 2, "microbatches": 2}
    errors = run_distributed(init_catching, 4, configs, timeout=60)
    assert len(set(errors)) == 1
    assert errors[0].startswith("ConfigMismatchError: shardwise config differs across ranks: ranks [1] disagree "
                                "with rank 0; pass the same config (file and --set overrides) to every rank")


def test_config_that_does_not_fit_the_world_fails_on_every_rank():
    errors = run_distributed(init_catching, 4, [{"sharded_data_parallel_degree": 3}] * 4, timeout=60)
    assert all(e.startswith(f"{ConfigError.__name__}: invalid shardwise config: sharded_data_parallel_degree=3: "
                            "must divide the data-parallel degree 4") for e in errors)


def train_then_forget(config: dict) -> tuple[bool, bool]:
    """Train two steps, shut down, drop the model (the optimizer went with the loop): are a parameter and the
    model gone after one collection? A gradient hook that held its reducer strongly would keep both, and the process groups, forever."""
    sw.init(config)
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    train_seed_loop(model, "gpt2", steps=2, rows=2)
    param, module = weakref.ref(next(model.parameters())), weakref.ref(model)
    sw.shutdown()
    del model
    gc.collect()
    return param() is None, module() is None


@pytest.mark.parametrize("config", [{"sharded_data_parallel_degree": 2},
                                    {"shard_optimizer_state": True, "tensor_parallel_degree": 2}],
                         ids=["mics-cross-group-reduction", "zero1-gradient-buckets-tp2"])
def test_a_trained_model_is_freed_after_shutdown(config):
    assert run_distributed(train_then_forget, 4, config, timeout=120) == [(True, True)] * 4
