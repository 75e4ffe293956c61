"""Expert parallelism by itself: experts split over `ep` ranks with all-to-all dispatch train as one process.

Tiny Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (tiny_moe.py), and a model of plain modules whose
experts class is registered with `register_experts`, train 3 steps with AdamW on
4 gloo ranks, each rank its own rows of the global batch, with EP 2 (two replicas of each
expert share) and EP 4 (every rank its own expert). Data parallelism here is the plain
rule (non-expert gradients averaged over all ranks, expert gradients over each expert's
replicas), so that only the technique is under test; test_expert_parallel_runtime.py runs
it through `sw.init` with ZeRO. Each must match one process training the same weights on
the same global batches:

- the loss (mean over ranks) and the load-balancing loss (every rank's) per step;
- every whole parameter, norm-relative, within 1e-5.

The all-to-all bytes each rank sends, as shardwise's collective watch records them, are
planner/experts.py's for the rows that rank's experts received.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardwise.observe.comms import CollectiveWatch
from shardwise.parallel.experts import apply_expert_parallel, expert_parallel_modules, register_experts
from shardwise.planner.experts import all_to_all_bytes, expert_shape
from shardwise.testing import run_distributed
from tiny_models import dataset, relative_error
from tiny_moe import EXPERTS, HIDDEN, TOP_K, PlainExperts, moe_loss, plain_loss, plain_moe, tiny_moe

WORLD, ROWS, STEPS = 4, 2, 3
TOLERANCE = 1e-5
CASES = [("mixtral", 2), ("mixtral", 4), ("qwen3_moe", 2), ("qwen3_moe", 4), ("qwen2_moe", 4), ("olmoe", 2),
         ("plain", 2), ("plain", 4)]


def _model(family: str) -> nn.Module:
    return plain_moe() if family == "plain" else tiny_moe(family)


def _losses(family: str, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple:
    """The training loss and the load-balancing loss (0 for the plain model, which has none)."""
    if family == "plain":
        return plain_loss(model, inputs, targets), torch.zeros(())
    return moe_loss(model, inputs, targets)


def _optimizer(model: nn.Module, name: str = "adamw") -> torch.optim.Optimizer:
    """AdamW, or SGD with momentum where rounding noise must not be amplified (Adam normalises tiny gradients'
    noise into full steps: bf16's rounding would swamp the comparison)."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


@functools.cache
def reference(family: str, clip: float | None = None, optimizer: str = "adamw") -> dict:
    """One plain process: STEPS steps on consecutive global batches of WORLD × ROWS rows (the gradients' global
    norm clipped to `clip` when set)."""
    model = _model(family)
    opt = _optimizer(model, optimizer)
    inputs, targets = dataset("llama", STEPS * WORLD * ROWS).tensors
    losses, aux = [], []
    for step in range(STEPS):
        rows = slice(step * WORLD * ROWS, (step + 1) * WORLD * ROWS)
        opt.zero_grad()
        loss, balance = _losses(family, model, inputs[rows], targets[rows])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
        aux.append(balance.item())
    return {"losses": losses, "aux": aux, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _average_gradients(model: nn.Module, expert_replicas: dist.ProcessGroup) -> None:
    """Non-expert gradients averaged over every rank; an expert share's over the ranks holding the same share."""
    for parameter in model.parameters():
        if parameter.grad is None:
            continue
        if isinstance(parameter.grad, DTensor):
            grad, group = parameter.grad.to_local(), expert_replicas
        else:
            grad, group = parameter.grad, None
        dist.all_reduce(grad, group=group)
        grad /= dist.get_world_size(group)


def train_ep(cases: list[tuple[str, int]]) -> list[dict]:
    """One rank: each case's model with its experts split over `ep` ranks, trained on this rank's rows."""
    results = []
    rank = dist.get_rank()
    for family, ep in cases:
        mesh = init_device_mesh("cpu", (WORLD // ep, ep), mesh_dim_names=("replicas", "ep"))
        model = _model(family)
        apply_expert_parallel(model, mesh["ep"], dist.group.WORLD)
        opt = _optimizer(model)
        inputs, targets = dataset("llama", STEPS * WORLD * ROWS).tensors
        losses, aux = [], []
        for step in range(STEPS):
            first = step * WORLD * ROWS + rank * ROWS
            opt.zero_grad()
            loss, balance = _losses(family, model, inputs[first:first + ROWS], targets[first:first + ROWS])
            loss.backward()
            _average_gradients(model, mesh["replicas"].get_group())
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / WORLD)
            aux.append(balance.item())
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                 for k, v in model.state_dict().items()}
        results.append({"losses": losses, "aux": aux, "state": state,
                        "split": len(expert_parallel_modules(model))})
    return results


@pytest.fixture(scope="module")
def trained() -> dict:
    return dict(zip(CASES, zip(*run_distributed(train_ep, WORLD, CASES, timeout=600))))


@pytest.mark.parametrize("family, ep", CASES, ids=[f"{f}-ep{ep}" for f, ep in CASES])
def test_trains_as_one_process(trained, family, ep):
    want = reference(family)
    for rank_result in trained[(family, ep)]:
        assert rank_result["split"] == 2  # both layers' experts
        assert rank_result["losses"] == pytest.approx(want["losses"], rel=TOLERANCE)
        assert rank_result["aux"] == pytest.approx(want["aux"], rel=TOLERANCE)
        assert rank_result["state"].keys() == want["state"].keys()
        for name, tensor in want["state"].items():
            assert relative_error(rank_result["state"][name], tensor) <= TOLERANCE, name


class _TwoRanks:
    """Stands for a 2-rank `ep` mesh where only its size and this rank's index are read."""

    def size(self) -> int:
        return 2

    def get_local_rank(self) -> int:
        return 0


def test_a_model_without_experts_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^expert parallelism: Sequential has no experts module .* fix: set "
                                         r"expert_parallel_degree to 1, or register the experts class"):
        apply_expert_parallel(nn.Sequential(nn.Linear(2, 2)), _TwoRanks(), None)


def test_experts_the_degree_does_not_divide_are_refused():
    model = nn.Sequential(PlainExperts(3, 4, 8))
    with pytest.raises(ValueError, match=r"^expert parallelism: PlainExperts has 3 experts, which "
                                         r"expert_parallel_degree 2 does not divide; fix: choose a degree dividing 3"):
        apply_expert_parallel(model, _TwoRanks(), None)


def test_register_experts_takes_only_module_classes_and_attribute_names():
    with pytest.raises(TypeError, match="register_experts: expected an nn.Module class"):
        register_experts()(int)
    with pytest.raises(TypeError, match="register_experts: num_experts must name the attribute"):
        register_experts(num_experts="")(PlainExperts)


def traffic(ep: int, tokens: int) -> dict:
    """One rank: one training step of a one-layer tiny Mixtral, its all-to-all bytes on the EP group as
    shardwise's collective watch records them, and the rows its experts received."""
    mesh = init_device_mesh("cpu", (WORLD // ep, ep), mesh_dim_names=("replicas", "ep"))
    model = tiny_moe("mixtral", layers=1)
    apply_expert_parallel(model, mesh["ep"], dist.group.WORLD)
    layer, = expert_parallel_modules(model)
    layer.traffic = []
    ids = torch.randint(0, 128, (tokens // 8, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    group = mesh["ep"].get_group()
    with CollectiveWatch({group.group_name: ("ep", ep)}) as watch:
        model(input_ids=ids, labels=ids).loss.backward()
    exchanges = [c.nbytes for c in watch.collectives if c.name == "all_to_all" and c.group == "ep"]
    return {"bytes": sum(exchanges), "calls": len(exchanges),
            "received": sum(sum(record.received) for record in layer.traffic)}


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_bytes_are_the_planners_for_the_rows_each_rank_received(ep):
    tokens = 64
    shape = expert_shape(EXPERTS, TOP_K, 1, HIDDEN, 2 * HIDDEN)
    ranks = run_distributed(traffic, WORLD, ep, tokens)
    for got in ranks:
        # counts, then dispatch and combine forward and again in backward
        assert got["calls"] == 5
        assert got["bytes"] == all_to_all_bytes(shape, tokens, ep, 4, skew=got["received"] / (tokens * TOP_K))
    # every row dispatched is received somewhere: on average a rank's bytes are the balanced router's
    assert sum(got["bytes"] for got in ranks) / WORLD == all_to_all_bytes(shape, tokens, ep, 4, skew=1.0)
