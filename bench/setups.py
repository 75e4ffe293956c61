"""The configurations compared: the same GPT-2 and loop under plain PyTorch, shardwise and DeepSpeed.

Each setup builds the model from the same seed, wraps it its own way and returns
a `Setup`: one training step (zero_grad, forward with the model's own loss,
backward, AdamW step), what MemTracker should track, and how to tear it down.
`precision` is "fp32" or "bf16"; in bf16 each computes in bfloat16 its own
documented way: autocast for DDP, FSDP2's MixedPrecisionPolicy (fp32 gradient
reduction), shardwise's `bf16` key, DeepSpeed's `bf16` section (at its defaults,
which reduce gradients in bf16).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import transformers
from torch import nn

MODELS = {
    # The tests' tiny GPT-2: seconds per configuration, for smoke runs.
    "gpt2-tiny": dict(config=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64), seq=64),
    # 5.3M parameters, 4 blocks: big enough that compute, not Python overhead, sets the step time.
    "gpt2-small": dict(config=dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128), seq=128),
}
LR = 1e-3
# DeepSpeed's default 5e8-element gradient buckets (2 GB in fp32) dwarf these models; cap them at
# torch DDP's 25 MiB, as its tuning guide advises for small models.
DEEPSPEED_BUCKET = 25 * 2 ** 20 // 4


class Setup(NamedTuple):
    step: Callable[[], None]
    tracked: tuple           # the model and optimizer objects MemTracker needs to know
    close: Callable[[], None] = lambda: None
    settle: Callable[[], None] = lambda: None  # wait for work a step leaves in flight (a deferred all-reduce)


def hf_config(model: str) -> transformers.GPT2Config:
    return transformers.GPT2Config(**MODELS[model]["config"])


def _build(model: str) -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(hf_config(model))


def _batch(model: str, batch_size: int) -> dict:
    """This rank's batch: different on every rank, the same for every configuration."""
    spec = MODELS[model]
    generator = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, spec["config"]["vocab_size"], (batch_size, spec["seq"]), generator=generator)
    return {"input_ids": ids, "labels": ids}


def _stepped_apart(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What `optimizer` steps that is not one of `module`'s parameters (fp32 masters, flat partitions): created
    before MemTracker starts, so it must be named to it (it counts them as "Other")."""
    own = {id(p) for p in module.parameters()}
    return [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]


def _plain(module: nn.Module, batch: dict, autocast: bool = False) -> Setup:
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    device = next(module.parameters()).device.type

    def step() -> None:
        optimizer.zero_grad()
        with torch.autocast(device, torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = module(**batch).loss
        loss.backward()
        optimizer.step()

    return Setup(step, (module, optimizer))


def plain_ddp(model: str, batch_size: int, precision: str = "fp32") -> Setup:
    """torch DDP; in bf16 under autocast, as torch's AMP recipe does (fp32 parameters and all-reduce)."""
    module = nn.parallel.DistributedDataParallel(_build(model))
    return _plain(module, _batch(model, batch_size), autocast=precision == "bf16")


def plain_fsdp2(model: str, batch_size: int, precision: str = "fp32") -> Setup:
    """ZeRO-3 as torch documents it: `fully_shard` each block, then the root; in bf16 with a
    MixedPrecisionPolicy gathering bf16 parameters and reducing fp32 gradients."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if precision == "bf16" else MixedPrecisionPolicy())
    module = _build(model)
    for block in module.transformer.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    return _plain(module, _batch(model, batch_size))


def shardwise(config: dict, model: str, batch_size: int, precision: str = "fp32") -> Setup:
    """The seed's loop: sw.init, DistributedModel, DistributedOptimizer, @sw.step."""
    import shardwise as sw
    from shardwise.runtime import state

    sw.init({**config, "bf16": precision == "bf16"})
    module = sw.DistributedModel(_build(model))
    optimizer = sw.DistributedOptimizer(torch.optim.AdamW(module.parameters(), lr=LR))
    batch = _batch(model, batch_size)

    @sw.step
    def train_step(module, batch):
        loss = module(**batch).loss
        module.backward(loss)
        return loss

    def step() -> None:
        optimizer.zero_grad()
        train_step(module, batch)
        optimizer.step()

    # ZeRO-1 in bf16 steps fp32 masters. Forget this runtime but keep the process group for the next configuration.
    masters = _stepped_apart(module, optimizer.optimizer)
    return Setup(step, (module, optimizer.optimizer, *masters), lambda: state.set_current(None))


def deepspeed(stage: int, model: str, batch_size: int, precision: str = "fp32") -> Setup:
    """DeepSpeed's ZeRO stage on the existing gloo group, with torch's AdamW (its CPU Adam needs a compiler)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import deepspeed as ds

    ds.init_distributed(dist_backend=dist.get_backend())
    zero = {"stage": stage, "reduce_bucket_size": DEEPSPEED_BUCKET, "allgather_bucket_size": DEEPSPEED_BUCKET}
    config = {"train_micro_batch_size_per_gpu": batch_size, "zero_optimization": zero,
              "bf16": {"enabled": precision == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}}
    module = _build(model)
    engine, optimizer, _, _ = ds.initialize(model=module, model_parameters=module.parameters(), config=config)
    batch = _batch(model, batch_size)

    def step() -> None:
        engine.backward(engine(**batch).loss)
        engine.step()

    # DeepSpeed's ZeRO optimizers wrap a torch optimizer that updates flat fp32 partitions, and ZeRO-3
    # keeps each parameter's shard in `ds_tensor`: MemTracker counts those as "Other".
    inner = getattr(optimizer, "optimizer", optimizer)
    partitions = _stepped_apart(engine.module, inner)
    shards = [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
    return Setup(step, (engine.module, inner, *partitions, *shards))
