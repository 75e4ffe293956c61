"""Pure bf16 (`bf16_master_weights_and_grads`): parameters, gradients, their reduction and the optimizer's states
in bf16, no fp32 master, under DDP, ZeRO-1, ZeRO-2 and ZeRO-3; 4 gloo ranks train as one process that trains the
model cast to bf16 with a plain optimizer; what cannot be honoured is refused in one line; the planner predicts the
same bytes MemTracker measures."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.testing import run_distributed
from tiny_models import build, dataset, make_optimizer, relative_error, seed_step

WORLD = 4
ROWS = 2  # per data-parallel rank and step
STEPS = 3
PURE = {"bf16": True, "bf16_master_weights_and_grads": True}
MODES = {"ddp": {}, "zero1": {"shard_optimizer_state": True},
         "zero2": {"zero_stage": 2, "sharded_data_parallel_degree": WORLD},
         "zero3": {"sharded_data_parallel_degree": WORLD}}
# Measured (tiny GPT-2, SGD, 3 steps): losses within 3e-5 of the one-process pure-bf16 run, all parameters together
# within 3.7e-4 (each rank rounds its share of the gradient to bf16 before the bf16 reduction); bf16 mixed precision
# (fp32 parameters under autocast) lies 9.2e-4 from that run, so the parameter check tells the two apart.
LOSS_TOLERANCE = 1e-4
PARAMETER_TOLERANCE = 6e-4


def floating_dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors if torch.is_tensor(t) and t.is_floating_point()
                   and t.dim() > 0})


def train_pure(config: dict) -> dict:
    """One rank of the seed's loop in pure bf16: losses, what dtypes parameters, gradients and the optimizer's
    states have, and the whole parameters."""
    sw.init({**PURE, **config})
    model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
    optimizer = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train_step = seed_step("gpt2")
    losses, gradients = [], []
    for inputs, targets in sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS,
                                          shuffle=False):
        optimizer.zero_grad()
        losses.append(train_step(model, inputs, targets).reduce_mean().item())
        gradients = floating_dtypes(p.grad for p in model.parameters())
        optimizer.step()
    states = [value for state in optimizer.state.values() for value in state.values()]
    return {"losses": losses, "parameters": floating_dtypes(model.parameters()), "gradients": gradients,
            "states": floating_dtypes(states), "state": model.full_state_dict()}


@functools.cache
def one_process(pure: bool) -> dict:
    """The same model, data and optimizer in one plain process: cast to bf16 (`pure`), or fp32 under autocast."""
    model = build("gpt2", freeze_key_bias=True)
    if pure:
        model.to(torch.bfloat16)
    optimizer = make_optimizer("sgd", model.parameters())
    data, batch = dataset("gpt2", STEPS * ROWS * WORLD), ROWS * WORLD
    losses = []
    for step in range(STEPS):
        inputs, targets = data[step * batch:(step + 1) * batch]
        optimizer.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=not pure):
            logits = model(inputs)["logits"]
        loss = F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), targets[:, 1:].flatten())  # as shardwise's
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def flat(state: dict, names) -> torch.Tensor:
    return torch.cat([state[name].double().flatten() for name in names])


@pytest.mark.parametrize("mode", MODES)
def test_trains_as_one_pure_bf16_process(mode):
    want = one_process(pure=True)
    ranks = run_distributed(train_pure, WORLD, MODES[mode], timeout=240)
    for result in ranks:
        assert (result["parameters"], result["gradients"], result["states"]) == (["bfloat16"],) * 3
    losses = torch.tensor([r["losses"] for r in ranks]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(want["losses"]), rtol=LOSS_TOLERANCE, atol=0)
    names = sorted(want["state"])
    error = relative_error(flat(ranks[0]["state"], names), flat(want["state"], names))
    assert error <= PARAMETER_TOLERANCE, f"parameters differ from one pure-bf16 process by {error:.2e}"
    # the check tells the modes apart: mixed precision's fp32 parameters lie further from the pure-bf16 run
    mixed = relative_error(flat(one_process(pure=False)["state"], names), flat(want["state"], names))
    assert mixed > PARAMETER_TOLERANCE, mixed


@pytest.mark.parametrize("config, message", [
    ({"bf16_master_weights_and_grads": True},
     "bf16_master_weights_and_grads=True: is pure bf16 and needs bf16: true; fix: set bf16: true"),
    ({"fp16": True, "bf16_master_weights_and_grads": True}, "(fp16 always keeps fp32 masters)"),
    ({**PURE, "shard_optimizer_state": True, "offload_optimizer_state": True},
     "offload_optimizer_state=True: under ZeRO-1 offloads fp32 master weights, which pure bf16"),
])
def test_what_pure_bf16_cannot_honour_is_refused_in_one_line(config, message):
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    assert message in str(refused.value) and "\n" not in str(refused.value).strip()


def test_deepspeed_bf16_master_weights_and_grads_is_pure_bf16():
    from shardwise.config.deepspeed import translate

    pure = translate({"train_batch_size": 8, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                                      "bf16_optimizer_states": True}})
    assert load_config(pure.config).pure_bf16
    assert not load_config(translate({"train_batch_size": 8, "bf16": {"enabled": True}}).config).pure_bf16


# The planner: memory per category against MemTracker (tests/test_planner_measured.py's measure and tolerances), and
# what pure bf16 changes from mixed bf16 in its predictions.
PLANNED = {f"{name} pure bf16": {**config, **PURE} for name, config in
           {"DDP": {}, "ZeRO-1": {"shard_optimizer_state": True},
            "ZeRO-3": {"sharded_data_parallel_degree": WORLD}}.items()}


def test_planner_memory_matches_memtracker_in_pure_bf16():
    from shardwise.config import parse_config
    from shardwise.config.layout import layout_for
    from shardwise.planner import predict_memory, spec_from_hf
    from shardwise.topology import Cluster
    from test_planner_measured import BATCH, CPU, GPT2, _check, measure_all

    per_rank = run_distributed(measure_all, WORLD, PLANNED, timeout=300)
    for name, config in PLANNED.items():
        measured = {k: max(rank[name][k] for rank in per_rank) for k in per_rank[0][name]}
        config = parse_config(config)
        predicted = predict_memory(spec_from_hf(GPT2.to_dict(), "gpt2"), config,
                                   layout_for(config, Cluster(1, WORLD)), BATCH, 64, device=CPU)
        _check(name, predicted, measured)


@pytest.mark.parametrize("layout", ["ddp", "zero1", "zero3"])
def test_planner_halves_states_and_reductions_against_mixed_bf16(layout):
    """Against mixed bf16 through `evaluate`: Adam's moments and the gradient reduction take half the bytes, and so
    do parameters and gradients where mixed bf16 stores them in fp32 (ZeRO-1's half-precision replicas already are
    bf16, and its fp32 masters go); activations stay as they are where mixed bf16 already computes from bf16
    parameters, and shrink under DDP, whose autocast keeps fp32 residuals and bf16 weight copies."""
    from shardwise.planner import cluster_preset, evaluate, spec_from_hf
    from test_planner_measured import GPT2

    spec = spec_from_hf({**GPT2.to_dict(), "n_embd": 1024, "n_layer": 8, "n_head": 16, "n_positions": 512}, "gpt2")
    cluster = cluster_preset("local")
    keys = {"ddp": {}, "zero1": {"shard_optimizer_state": True}, "zero3": {"sharded_data_parallel_degree": 2}}[layout]
    mixed, pure = (evaluate(spec, cluster, {"bf16": True, **keys, **extra}, global_batch=8, seq=512)
                   for extra in ({}, PURE))
    high, low = mixed.memory, pure.memory
    assert low.parameters == pytest.approx(high.parameters * (1 if layout == "zero1" else 0.5))
    if layout != "zero1":  # ZeRO-1's mixed replicas send their bf16 gradients off bucket by bucket
        assert low.gradients == pytest.approx(high.gradients / 2)
    assert low.optimizer == pytest.approx(high.optimizer * 4 / (12 if layout == "zero1" else 8))
    if layout == "ddp":
        assert low.activations < high.activations
    else:
        assert low.activations == pytest.approx(high.activations)
    reduced = [{c.name: c.bytes_per_step for c in e.time.collectives if c.name.startswith("gradient")}
               for e in (mixed, pure)]
    if layout != "zero1":  # ZeRO-1's mixed reduction already went to fp32 masters; pure's all-reduce is bf16
        assert reduced[1] == {name: pytest.approx(nbytes / 2) for name, nbytes in reduced[0].items()}
