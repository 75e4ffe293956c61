"""Optimizer-state offload (`offload_optimizer_state`): the same math as one plain process, and the notices.

On a CPU device host and device memory are one, but the offload code runs all the
same: ZeRO-1 steps fp32 masters of each rank's share apart from the parameters
(in fp32 training too, where without offload it steps the parameters), and FSDP2
runs under its `CPUOffloadPolicy`. Each rank reports which of the two it ran, so
a layout that silently ignored the key fails; every world trains GPT-2 with AdamW
for a few steps against one plain process.
"""

from __future__ import annotations

import warnings

import pytest
from torch.distributed.fsdp import FSDPModule

import shardwise as sw
from shardwise.config import IneffectiveSettingsWarning, ShardwiseConfig, ineffective_settings
from shardwise.testing import run_distributed
from tiny_models import assert_trains_as, build, dataset, make_optimizer, seed_step, train_reference

ROWS = 2  # per data-parallel rank and step
STEPS = 3
TOLERANCE = 1e-5

# name: (world size, config without the key)
LAYOUTS = {
    "zero1": (2, {"shard_optimizer_state": True}),
    "zero2": (2, {"zero_stage": 2, "sharded_data_parallel_degree": 2}),
    "zero3": (2, {"sharded_data_parallel_degree": 2}),
    "mics": (4, {"sharded_data_parallel_degree": 2}),
    "tp-zero1": (4, {"tensor_parallel_degree": 2, "shard_optimizer_state": True}),
    "tp-zero3": (4, {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2}),
    "pp-zero1": (4, {"pipeline_parallel_degree": 2, "microbatches": 2, "shard_optimizer_state": True}),
    "pp-zero3": (4, {"pipeline_parallel_degree": 2, "microbatches": 2, "sharded_data_parallel_degree": 2}),
}


def offload_used(model: sw.DistributedModel, optimizer: sw.DistributedOptimizer) -> str:
    """"fsdp" when every FSDP2 unit on this rank runs CPUOffloadPolicy, "masters" when the optimizer steps
    tensors apart from the model's trainable parameters (it keeps the frozen ones), else "none"."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if units:  # FSDP2 keeps the policy on each unit's parameter group (private: no public getter)
        groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units]
        policies = {type(group.offload_policy).__name__ for group in groups if group is not None}
        return "fsdp" if policies == {"CPUOffloadPolicy"} else "none"
    trained = {id(p) for p in model.get_module().parameters() if p.requires_grad}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    return "masters" if stepped and not any(id(p) in trained for p in stepped) else "none"


def train_offloaded(config: dict) -> dict:
    """One rank of the seed's loop with optimizer states offloaded: losses, what ran, whole parameters on rank 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IneffectiveSettingsWarning)  # the CPU notice, tested below
        sw.init({**config, "offload_optimizer_state": True})
        model = sw.DistributedModel(build("gpt2", freeze_key_bias=True))
        optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
        train_step = seed_step("gpt2")
        losses = []
        for inputs, targets in sw.data_loader(dataset("gpt2", STEPS * ROWS * sw.dp_size()), batch_size=ROWS,
                                              shuffle=False):
            optimizer.zero_grad()
            out = train_step(model, inputs, targets)
            losses.append(out.reduce_mean().item() if out.holds_loss else None)
            optimizer.step()
    state = model.full_state_dict()  # every rank gathers
    return {"losses": losses, "offload": offload_used(model, optimizer), "dp_size": sw.dp_size(),
            "state": state if sw.rank() == 0 else None}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offloaded_optimizer_states_train_as_one_plain_process(layout):
    world, config = LAYOUTS[layout]
    ranks = run_distributed(train_offloaded, world, config, timeout=300)
    want = train_reference("gpt2", "adamw", STEPS, ROWS * ranks[0]["dp_size"])

    assert {r["offload"] for r in ranks} == {"masters" if "zero1" in layout else "fsdp"}
    assert_trains_as(ranks, want, TOLERANCE)


def notices(config: dict) -> list[str]:
    """The offload_optimizer_state notices this rank gives while building and training two steps."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IneffectiveSettingsWarning)
        sw.init({**config, "offload_optimizer_state": True})
        model = sw.DistributedModel(build("stack"))
        optimizer = sw.DistributedOptimizer(make_optimizer("adamw", model.parameters()))
        train_step = seed_step("stack")
        for inputs, targets in sw.data_loader(dataset("stack", 2 * ROWS * sw.dp_size()), batch_size=ROWS):
            optimizer.zero_grad()
            train_step(model, inputs, targets)
            optimizer.step()
    return [str(w.message) for w in caught if "offload_optimizer_state" in str(w.message)]


CPU_NOTICE = ("these settings have no effect in this layout: offload_optimizer_state (the device is the CPU, whose "
              "memory is the host memory: optimizer states stay where they are); fix: remove them, or set what they "
              "need")


@pytest.mark.parametrize("config", [{"shard_optimizer_state": True}, {"sharded_data_parallel_degree": 2}],
                         ids=["zero1", "zero3"])
def test_on_the_cpu_rank_0_says_once_that_nothing_moves(config):
    rank0, rank1 = run_distributed(notices, 2, config)
    assert rank0 == [CPU_NOTICE]
    assert rank1 == []


def test_without_sharding_the_key_is_named_with_what_it_needs():
    assert ("offload_optimizer_state", "needs shard_optimizer_state or zero_stage 1, 2 or 3") in ineffective_settings(
        ShardwiseConfig(offload_optimizer_state=True))
    for sharded in ({"shard_optimizer_state": True}, {"zero_stage": 2, "sharded_data_parallel_degree": 2}):
        named = [key for key, _ in ineffective_settings(ShardwiseConfig(offload_optimizer_state=True, **sharded))]
        assert "offload_optimizer_state" not in named
