"""Context parallelism through the runtime: `sw.init({"context_parallel_degree": n, ...})`, `DistributedModel`,
`@sw.step` and `DistributedOptimizer`, with the training loop of one process unchanged (whole rows into
`model(input_ids=..., labels=...)`).

On 4 gloo ranks, CP 2 beside two data-parallel replicas under DDP, ZeRO-1, ZeRO-2 (all-to-all) and ZeRO-3, and
CP 4 alone and under ZeRO-3 with every block recomputed, Hugging Face Llama and GPT-2 train 3 SGD steps (packed
documents in one case): losses and every parameter match one process that averages each replica's loss as data
parallelism does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.testing import run_distributed
from test_context_parallel import POSITIONS, SEQ, VOCAB, tiny

STEPS = 3
TOLERANCE = 2e-5


def _batch(step: int, replicas: int, packed: bool) -> dict:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (replicas, SEQ), generator=generator)
    labels = ids.clone()
    labels[-1, -3:] = -100  # the last replica's row ends in padding
    return {"input_ids": ids, "labels": labels, "position_ids": POSITIONS[packed][:1].expand(replicas, -1)}


def train_kind(kind: str, packed: bool, checkpoint: bool) -> float:
    torch.manual_seed(0)
    reference = tiny(kind)
    model = sw.DistributedModel(copy.deepcopy(reference))
    if checkpoint:
        for block in (model.get_module().transformer.h if kind == "gpt2" else model.get_module().model.layers):
            sw.set_activation_checkpointing(block)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = sw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    @sw.step
    def train_step(model, input_ids, labels, position_ids):
        loss = model(input_ids=input_ids, labels=labels, position_ids=position_ids).loss
        model.backward(loss)
        return loss

    replicas, errors = sw.rdp_size(), []
    for step in range(STEPS):
        batch = _batch(step, replicas, packed)
        ref_loss = sum(reference(**{k: v[r:r + 1] for k, v in batch.items()}, use_cache=False).loss
                       for r in range(replicas)) / replicas
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = {k: v[sw.rdp_rank():sw.rdp_rank() + 1] for k, v in batch.items()}
        loss = torch.as_tensor(train_step(model, **mine).reduce_mean()).detach().clone()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss)
        errors.append(abs(loss.item() / sw.size() - ref_loss.item()))
    full, want = model.full_state_dict(), reference.state_dict()
    errors += [((full[k] - v).norm() / v.norm().clamp_min(1e-3)).item() for k, v in want.items()]
    return max(errors)


def train_all(config: dict, kinds: tuple, packed: bool = False, checkpoint: bool = False) -> dict:
    sw.init(config)
    return {kind: train_kind(kind, packed, checkpoint) for kind in kinds}


CASES = {
    "cp2-ddp": ({"context_parallel_degree": 2}, False, False),
    "cp2-zero1-packed": ({"context_parallel_degree": 2, "shard_optimizer_state": True}, True, False),
    "cp2-zero2-all_to_all": ({"context_parallel_degree": 2, "context_parallel_mode": "all_to_all", "zero_stage": 2,
                              "sharded_data_parallel_degree": 2}, False, False),
    "cp2-zero3": ({"context_parallel_degree": 2, "sharded_data_parallel_degree": 2}, False, False),
    "cp4": ({"context_parallel_degree": 4}, False, False),
    "cp4-zero3-checkpointing": ({"context_parallel_degree": 4, "zero_stage": 3}, True, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_same_math_as_one_process(name):
    config, packed, checkpoint = CASES[name]
    errors = run_distributed(train_all, 4, config, ("llama", "gpt2"), packed, checkpoint, timeout=600)[0]
    assert max(errors.values()) < TOLERANCE, errors
