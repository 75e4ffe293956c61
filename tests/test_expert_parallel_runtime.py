"""Expert parallelism through the seed's API: `expert_parallel_degree` trains as one process with ZeRO.

Tiny Mixtral and Qwen3-MoE (tiny_moe.py) train 3 AdamW steps on 4 gloo ranks through `sw.init`,
`sw.DistributedModel`, `sw.DistributedOptimizer`, `@sw.step` with `model.backward` and
`sw.data_loader`, with EP 2 and 4 borrowed from ZeRO-3's sharding group (each expert share then
sharded over the ranks left), EP 2 under ZeRO-2 and under MiCS (two partition groups of two, whose
cross-group reduction carries the experts' gradients too), and with no EP under DDP, where the
load-balancing loss is still the global batch's; also with global-norm gradient clipping, with every
decoder layer's activations recomputed (its all-to-alls run again in backward) and in bf16. Each
matches one process on the same global batches: the mean loss per step, every rank's load-balancing
loss, and every whole parameter within 1e-5 (bf16, with SGD: 3e-2 against the fp32 process).
The config's rules are checked with their messages, and so are DistributedModel's refusals of a model
without experts and of experts the degree does not divide.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.config import ConfigError
from shardwise.config.layout import layout_for
from shardwise.config import parse_config
from shardwise.testing import run_distributed
from shardwise.topology import Cluster
from test_expert_parallel import ROWS, STEPS, TOLERANCE, WORLD, _losses, _model, _optimizer, reference
CLIP = 0.5
from tiny_models import dataset, relative_error

MODES = {
    "zero3-ep2": {"sharded_data_parallel_degree": WORLD, "expert_parallel_degree": 2, "replica_check_interval": 1},
    "zero3-ep4": {"sharded_data_parallel_degree": WORLD, "expert_parallel_degree": 4},
    "zero2-ep2": {"zero_stage": 2, "sharded_data_parallel_degree": WORLD, "expert_parallel_degree": 2},
    "mics-ep2": {"sharded_data_parallel_degree": 2, "expert_parallel_degree": 2},
    "ddp-no-ep": {},
    # the global gradient norm (about 1.3 at first) clipped every step, experts' shares counted once
    "zero3-ep2-clipping": {"sharded_data_parallel_degree": WORLD, "expert_parallel_degree": 2,
                           "gradient_clipping": CLIP},
    # each decoder layer recomputed in backward, its all-to-alls again
    "zero3-ep4-checkpointing": {"sharded_data_parallel_degree": WORLD, "expert_parallel_degree": 4},
    "zero3-ep2-bf16": {"sharded_data_parallel_degree": WORLD, "expert_parallel_degree": 2, "bf16": True},
    # attention split over 2 tensor-parallel ranks (the built-in plan), experts over the 2 of the sharding group
    "tp2-zero3-ep2": {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "expert_parallel_degree": 2},
}
CASES = [("mixtral", mode) for mode in MODES] + [("qwen3_moe", "zero3-ep2"), ("qwen3_moe", "zero3-ep4")]
# bf16 keeps 8 bits of mantissa through a few steps (the combination matrix's bound)
BF16_TOLERANCE = 3e-2


def _optimizer_of(config: dict) -> str:
    return "sgd" if config.get("bf16") else "adamw"


def train(family: str, config: dict, checkpointing: bool) -> dict:
    """One rank of the seed's loop on an MoE model (SGD in bf16, see _optimizer)."""
    sw.init(config)
    model = sw.DistributedModel(_model(family))
    if checkpointing:
        for layer in model.get_module().model.layers:
            sw.set_activation_checkpointing(layer)
    optimizer = sw.DistributedOptimizer(_optimizer(model, _optimizer_of(config)))

    @sw.step
    def train_step(model, inputs, targets):
        loss, balance = _losses(family, model, inputs, targets)
        model.backward(loss)
        return loss, balance.detach()

    losses, aux = [], []
    loader = sw.data_loader(dataset("llama", STEPS * ROWS * sw.dp_size()), batch_size=ROWS, shuffle=False)
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss, balance = train_step(model, inputs, targets)
        losses.append(loss.reduce_mean().item())  # this rank's
        aux.append(balance.reduce_mean().item())
        optimizer.step()
    return {"losses": losses, "aux": aux, "state": model.full_state_dict()}


@pytest.fixture(scope="module")
def trained() -> dict:
    return {(family, mode): run_distributed(train, WORLD, family, MODES[mode], mode.endswith("-checkpointing"),
                                            timeout=600) for family, mode in CASES}


@pytest.mark.parametrize("family, mode", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_trains_as_one_process(trained, family, mode):
    want = reference(family, MODES[mode].get("gradient_clipping"), _optimizer_of(MODES[mode]))
    tolerance = BF16_TOLERANCE if MODES[mode].get("bf16") else TOLERANCE
    ranks = trained[(family, mode)]
    mean = [sum(step) / len(ranks) for step in zip(*(got["losses"] for got in ranks))]
    assert mean == pytest.approx(want["losses"], rel=tolerance)
    for got in ranks:
        assert got["aux"] == pytest.approx(want["aux"], rel=tolerance)
        assert got["state"].keys() == want["state"].keys()
        for name, tensor in want["state"].items():
            assert relative_error(got["state"][name].float(), tensor) <= tolerance, name


def _message(config: dict, world: int = 4) -> str:
    with pytest.raises(ConfigError) as info:
        layout_for(parse_config(config), Cluster(1, world))
    return str(info.value)


def test_a_degree_that_does_not_divide_the_sharding_group_is_refused():
    assert _message({"sharded_data_parallel_degree": 4, "expert_parallel_degree": 3}) == (
        "invalid shardwise config: expert_parallel_degree=3: must divide the sharding group's 4 ranks it borrows "
        "from (sharded_data_parallel_degree, or the whole data-parallel group under zero_stage 2/3); fix: use a "
        "divisor of 4: 1, 2, 4")


def test_expert_parallelism_without_sharding_is_refused():
    assert _message({"expert_parallel_degree": 2}) == (
        "invalid shardwise config: expert_parallel_degree=2: borrows its ranks from the sharding group, and this "
        "config shards over none (ZeRO-2/3 shard; DDP and ZeRO-1 do not); fix: set sharded_data_parallel_degree "
        "(or zero_stage 2 or 3) so that 2 divides the sharding group")


def test_the_degree_must_be_a_positive_integer():
    with pytest.raises(ConfigError, match=r"expert_parallel_degree=0: "):
        parse_config({"expert_parallel_degree": 0})


def test_a_pipeline_cut_from_the_module_graph_is_refused():
    assert _message({"sharded_data_parallel_degree": 2, "expert_parallel_degree": 2, "pipeline_parallel_degree": 2,
                     "pipeline_cut": "graph"}) == (
        "invalid shardwise config: expert_parallel_degree=2: does not combine with pipeline_cut 'graph' yet (a "
        "pipeline cut from the module graph keeps no experts modules); fix: set pipeline_cut to 'blocks' or 'auto'")


def wrap_refused(kind: str) -> str:
    """One rank: the message DistributedModel raises for a model expert parallelism cannot split."""
    from tiny_moe import PlainExperts

    sw.init({"sharded_data_parallel_degree": 2, "expert_parallel_degree": 2})
    model = torch.nn.Sequential(PlainExperts(3, 4, 8)) if kind == "three experts" else _model("mixtral").model.norm
    try:
        sw.DistributedModel(model)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_wrapping_a_model_without_experts_names_it():
    for message in run_distributed(wrap_refused, 2, "no experts"):
        assert message == ("expert parallelism: MixtralRMSNorm has no experts module (none of Mixtral's, "
                           "Qwen2-MoE's, Qwen3-MoE's, OLMoE's or a registered class); fix: set "
                           "expert_parallel_degree to 1, or register the experts class with sw.register_experts")


def test_wrapping_experts_the_degree_does_not_divide_is_refused():
    for message in run_distributed(wrap_refused, 2, "three experts"):
        assert message == ("expert parallelism: PlainExperts has 3 experts, which expert_parallel_degree 2 does "
                           "not divide; fix: choose a degree dividing 3")
