"""The configurations bench/link.py compares: one MLP and loop under shardwise, plain PyTorch and DeepSpeed.

The model is issue 11's: `blocks` residual blocks of a `width`-wide linear layer
and a ReLU, then a linear head (9 layers of 1024 × 1024 + bias at the defaults,
9.45M parameters), fp32, trained with Adam on a regression target, `batch` rows
per rank (different on every rank, the same for every configuration). Each
function returns a `setups.Setup` on a running gloo process group of 2 nodes ×
`per_node` ranks (global ranks node by node).
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from setups import Setup
from torch import nn

LR = 1e-3


class Shape(NamedTuple):
    width: int = 1024
    blocks: int = 8
    batch: int = 32

    @property
    def parameters(self) -> int:
        return (self.blocks + 1) * (self.width * self.width + self.width)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


class MLP(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.blocks = nn.ModuleList(Block(shape.width) for _ in range(shape.blocks))
        self.head = nn.Linear(shape.width, shape.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build(shape: Shape) -> MLP:
    torch.manual_seed(0)
    return MLP(shape)


def _batch(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(dist.get_rank())
    return (torch.randn(shape.batch, shape.width, generator=generator),
            torch.randn(shape.batch, shape.width, generator=generator))


def _plain(module: nn.Module, shape: Shape) -> Setup:
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)
    inputs, targets = _batch(shape)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.mse_loss(module(inputs), targets).backward()
        optimizer.step()

    return Setup(step, (module, optimizer))


def compute_only(shape: Shape, per_node: int) -> Setup:
    """Every rank trains its own copy, nothing is sent: the compute a step cannot be faster than."""
    return _plain(_build(shape), shape)


def torch_ddp(shape: Shape, per_node: int) -> Setup:
    return _plain(nn.parallel.DistributedDataParallel(_build(shape)), shape)


def _fully_shard(shape: Shape, mesh) -> Setup:
    from torch.distributed.fsdp import fully_shard

    module = _build(shape)
    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return _plain(module, shape)


def torch_fsdp2(shape: Shape, per_node: int) -> Setup:
    """ZeRO-3 over every rank, as torch documents it."""
    from torch.distributed.device_mesh import init_device_mesh

    return _fully_shard(shape, init_device_mesh("cpu", (dist.get_world_size(),)))


def torch_hsdp(shape: Shape, per_node: int) -> Setup:
    """FSDP2's hybrid sharding on a (nodes × per_node) mesh: sharded inside a node, replicated across."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size() // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    return _fully_shard(shape, mesh)


def _sized(settings: dict, per_node: int) -> dict:
    """`settings` with the values "node" and "world" replaced by the ranks of a node and of the world."""
    sizes = {"node": per_node, "world": dist.get_world_size()}
    return {key: sizes.get(value, value) if isinstance(value, str) else value for key, value in settings.items()}


def shardwise(config: dict) -> Callable[[Shape, int], Setup]:
    """The seed's loop under `config` (sizes as `_sized` reads them)."""

    def build(shape: Shape, per_node: int) -> Setup:
        import shardwise as sw
        from shardwise.runtime import state

        sw.init(_sized(config, per_node))
        module = sw.DistributedModel(_build(shape))
        optimizer = sw.DistributedOptimizer(torch.optim.Adam(module.parameters(), lr=LR))
        inputs, targets = _batch(shape)

        @sw.step
        def train_step(module, inputs, targets):
            loss = nn.functional.mse_loss(module(inputs), targets)
            module.backward(loss)
            return loss

        def step() -> None:
            optimizer.zero_grad()
            train_step(module, inputs, targets)
            optimizer.step()

        return Setup(step, (module, optimizer.optimizer), lambda: state.set_current(None), optimizer.synchronize)

    return build


def deepspeed(zero: dict) -> Callable[[Shape, int], Setup]:
    """DeepSpeed's ZeRO-3 with `zero` (sizes as `_sized` reads them) added to its section, torch's Adam, on the running gloo group; every
    parameter partitioned and none kept gathered between uses (so its traffic is ZeRO-3's, not a cache's)."""

    def build(shape: Shape, per_node: int) -> Setup:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
        section = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
                   "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                   "reduce_bucket_size": shape.width * shape.width, **_sized(zero, per_node)}
        config = {"train_micro_batch_size_per_gpu": shape.batch, "zero_optimization": section,
                  "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True}}}
        module = _build(shape)
        engine, _, _, _ = ds.initialize(model=module, model_parameters=module.parameters(), config=config)
        inputs, targets = _batch(shape)

        def step() -> None:
            engine.backward(nn.functional.mse_loss(engine(inputs), targets))
            engine.step()

        return Setup(step, (engine.module,))

    return build


# name: how to build it; DeepSpeed's run in processes of their own (it keeps its groups in globals)
CONFIGURATIONS: dict[str, Callable[[Shape, int], Setup]] = {
    "compute only (nothing sent)": compute_only,
    "torch DDP": torch_ddp,
    "torch FSDP2 (flat)": torch_fsdp2,
    "torch FSDP2 HSDP": torch_hsdp,
    "shardwise DDP": shardwise({}),
    "shardwise ZeRO-3": shardwise({"sharded_data_parallel_degree": "world"}),
    "shardwise MiCS": shardwise({"sharded_data_parallel_degree": "node"}),
    "shardwise MiCS bf16 cross-group": shardwise({"sharded_data_parallel_degree": "node",
                                                  "cross_group_reduce_dtype": "bf16"}),
    "shardwise MiCS overlapping forward": shardwise({"sharded_data_parallel_degree": "node",
                                                     "cross_group_overlap": "forward"}),
    "shardwise MiCS bf16 overlapping forward": shardwise({"sharded_data_parallel_degree": "node",
                                                          "cross_group_reduce_dtype": "bf16",
                                                          "cross_group_overlap": "forward"}),
}
DEEPSPEED = {
    "DeepSpeed ZeRO-3": deepspeed({}),
    "DeepSpeed ZeRO++ hpZ": deepspeed({"zero_hpz_partition_size": "node"}),
}
