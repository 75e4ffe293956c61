"""CUDA tier: several ranks on one device, with the backends that allow it.

NCCL refuses two ranks on one GPU; gloo moves CUDA tensors for some
collectives (through host staging). With fewer devices than ranks the harness
starts a gloo world, and shardwise puts every rank on the device it has. The
first test tries each collective shardwise's layouts use on CUDA tensors and
prints what worked (`pytest -s`, or the check's log, shows the table), with
DTensor's gather, a functional collective, tried in a world of its own; the next
train ZeRO-3 and tensor parallelism on two ranks and MiCS 2×2 on four of the one
device, reported as skipped with the failure's own words where a collective they
need fails; the last shows NCCL's refusal. With a device per rank the harness gives every rank NCCL instead, and
these tests say they are for one device.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import shardwise as sw
from shardwise.testing import DistributedTestError, run_distributed
from tiny_models import build, dataset, make_optimizer, relative_error, seed_step, train_reference

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tier: torch sees no CUDA device"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2,
                                 reason="several ranks on one device: this machine has a device per rank")]

WORLD, ROWS, STEPS = 2, 2, 3
TOLERANCE = 1e-4


def refusal(error: Exception) -> str:
    """A backend's refusal in one line: its type and the first line of its message."""
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:160]}"


def _outcome(run) -> str:
    try:
        return "ok" if run() else "wrong result"
    except Exception as error:
        return refusal(error)


def collectives_on_cuda_tensors() -> dict[str, str]:
    """Each collective on CUDA tensors over the world's gloo group: "ok", "wrong result" or the error."""
    rank, device = dist.get_rank(), torch.device("cuda", 0)
    mine = torch.full((4,), float(rank + 1), device=device)
    total = float(sum(range(1, WORLD + 1)))

    def all_reduce():
        t = mine.clone()
        dist.all_reduce(t)
        return bool((t == total).all())

    def broadcast():
        t = mine.clone()
        dist.broadcast(t, src=0)
        return bool((t == 1).all())

    def all_gather_into_tensor():
        out = torch.empty(4 * WORLD, device=device)
        dist.all_gather_into_tensor(out, mine)
        return out.tolist() == [float(r + 1) for r in range(WORLD) for _ in range(4)]

    def reduce_scatter_tensor():
        out = torch.empty(4 // WORLD, device=device)
        dist.reduce_scatter_tensor(out, mine)
        return bool((out == total).all())

    def all_to_all_single():
        out = torch.empty(4, device=device)
        dist.all_to_all_single(out, mine)
        return out.tolist() == [float(r + 1) for r in range(WORLD) for _ in range(4 // WORLD)]

    # Point-to-point is left out: a send that gloo took while the matching receive was refused would wait for good.
    tries = {f.__name__: f for f in (all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor,
                                     all_to_all_single)}
    results = {}
    for name, run in tries.items():
        results[name] = _outcome(run)
        dist.barrier()  # a refused collective on one rank must not leave the other inside the next one
    return results


def test_gloo_collectives_on_cuda_tensors_report_what_works():
    ranks = run_distributed(collectives_on_cuda_tensors, WORLD, timeout=90)
    print("\ngloo over CUDA tensors, 2 ranks on one device:")
    for name, outcome in ranks[0].items():
        print(f"  {name:24s} {outcome}")
    print(f"  {'DTensor full_tensor':24s} {functional_collectives_on_cuda()}")
    assert [{k: v == "ok" for k, v in rank.items()} for rank in ranks[1:]] == \
        [{k: v == "ok" for k, v in ranks[0].items()}] * (WORLD - 1), ranks
    assert "wrong result" not in ranks[0].values(), ranks[0]
    assert ranks[0]["all_reduce"] == ranks[0]["broadcast"] == "ok"  # gloo documents both for CUDA tensors


def whole_on_host(model) -> dict:
    """Each parameter whole, gathered from host copies of the shards: gloo gathers CPU tensors through the functional
    collectives DTensor uses, which on CUDA tensors crashed the process (torch 2.11, an H200; `full_state_dict`
    gathers on the device)."""
    return {name: (value.detach().to("cpu").full_tensor() if isinstance(value, DTensor) else value.detach().cpu())
            for name, value in model.get_module().state_dict().items()}


def gather_through_dtensor() -> list[float]:
    """DTensor's gather (a functional collective) of one CUDA shard per rank."""
    mesh = DeviceMesh("cuda", list(range(WORLD)))  # as shardwise builds it: init_device_mesh picks cuda:rank
    mine = torch.full((2,), float(dist.get_rank() + 1), device=torch.device("cuda", 0))
    return DTensor.from_local(mine, mesh, [Shard(0)]).full_tensor().tolist()


@functools.cache
def functional_collectives_on_cuda() -> str:
    """"ok", or how DTensor's functional collectives over gloo on CUDA tensors failed: tried in a world of its own,
    since the failure seen was a crash of the process (tensor parallelism's forward runs on them)."""
    try:
        ranks = run_distributed(gather_through_dtensor, WORLD, timeout=60)
    except DistributedTestError as error:
        return str(error).splitlines()[0]
    return "ok" if ranks[0] == [1.0, 1.0, 2.0, 2.0] else f"wrong result: {ranks[0]}"


def skip_tensor_parallelism_without_functional_collectives(what: str) -> None:
    """Skip `what` (tensor parallelism) on ranks sharing one device where DTensor's functional collectives fail."""
    if torch.cuda.device_count() < 2 and (outcome := functional_collectives_on_cuda()) != "ok":
        pytest.skip(f"{what} over gloo on one device: DTensor's functional collectives on CUDA tensors: {outcome}")


def train_on_one_device(config: dict, kind: str) -> dict:
    try:
        sw.init(config)
        model = sw.DistributedModel(build(kind, freeze_key_bias=True))
        optimizer = sw.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
        train_step = seed_step(kind)
        losses = []
        for inputs, targets in sw.data_loader(dataset(kind, STEPS * ROWS * sw.dp_size()), batch_size=ROWS,
                                              shuffle=False):
            optimizer.zero_grad()
            losses.append(train_step(model, inputs, targets).reduce_mean().item())
            optimizer.step()
        return {"losses": losses, "dp_size": sw.dp_size(), "state": whole_on_host(model)}
    except (RuntimeError, NotImplementedError, ValueError) as error:
        return {"refused": refusal(error)}


# ZeRO-3 over the whole world; MiCS's partition groups of 2, whose cross-group reduction runs on a side stream;
# tensor parallelism of Llama (DTensor's collectives; GPT-2's packed q/k/v needs torch 2.13, docs/torch.md).
SHARED_DEVICE_LAYOUTS = {"zero3": (2, {"sharded_data_parallel_degree": 2}, "gpt2"),
                         "mics-2x2": (4, {"sharded_data_parallel_degree": 2}, "gpt2"),
                         "tp": (2, {"tensor_parallel_degree": 2}, "llama")}


@pytest.mark.parametrize("layout", SHARED_DEVICE_LAYOUTS)
def test_layouts_on_ranks_sharing_one_device_over_gloo(layout):
    world, config, kind = SHARED_DEVICE_LAYOUTS[layout]
    if "tensor_parallel_degree" in config:
        skip_tensor_parallelism_without_functional_collectives(layout)
    ranks = run_distributed(train_on_one_device, world, config, kind, timeout=120)
    refused = [r["refused"] for r in ranks if "refused" in r]
    if refused:
        pytest.skip(f"{layout} on {world} ranks of one device over gloo: {refused[0]}")
    want = train_reference(kind, "sgd", STEPS, ROWS * ranks[0]["dp_size"])  # tensor-parallel peers bring rows too
    losses = torch.tensor([r["losses"] for r in ranks]).mean(0)
    torch.testing.assert_close(losses, torch.tensor(want["losses"]), rtol=TOLERANCE, atol=0)
    worst = max(relative_error(ranks[0]["state"][k], v) for k, v in want["state"].items())
    assert worst <= TOLERANCE


def nccl_on_one_device() -> str:
    group = dist.new_group(backend="nccl")
    t = torch.ones(1, device=torch.device("cuda", 0))
    return _outcome(lambda: dist.all_reduce(t, group=group) or torch.accelerator.synchronize() or True)


def test_nccl_refuses_two_ranks_on_one_device():
    outcomes = run_distributed(nccl_on_one_device, WORLD, timeout=60)
    print(f"\nNCCL, 2 ranks on one device: {outcomes}")
    assert all(outcome != "ok" for outcome in outcomes), outcomes
