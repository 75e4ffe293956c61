"""Op-selective activation checkpointing: what a policy keeps is not recomputed, and training is the same math.

`set_activation_checkpointing(..., policy="matmul")` keeps the outputs of matrix
products inside each region: backward then runs the region's elementwise ops again
but no matmul, where a fully checkpointed region runs its matmuls twice. Counted
with a dispatch mode on one process; trained in multi-rank worlds under ZeRO-3,
tensor parallelism, a pipeline with microbatches, and with offloading, against
one plain process.
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

import shardwise as sw
from shardwise.config import IneffectiveSettingsWarning
from shardwise.parallel.recompute.apply import lift_checkpointing, restore_checkpointing
from shardwise.parallel.pipeline.stage import Elsewhere
from shardwise.testing import run_distributed
from tiny_models import assert_trains_as, blocks, build, train_reference, train_seed_loop

ROWS, STEPS, TOLERANCE = 2, 3, 1e-5
aten = torch.ops.aten


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return torch.tanh(self.down(nn.functional.gelu(self.up(x))))


def _stack(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(Block() for _ in range(3)))


def _backward_ops(model: nn.Module) -> tuple[Counter, list[torch.Tensor]]:
    """The ops backward runs (recomputation included), and the gradients it leaves."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().sum()
    with OpCounter() as counter:
        loss.backward()
    return counter.ops, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("policy", [None, "matmul", [aten.addmm.default],
                                    lambda ctx, op, *args, **kwargs: (CheckpointPolicy.MUST_SAVE if op == aten.addmm.default
                                                                      else CheckpointPolicy.PREFER_RECOMPUTE)],
                         ids=["full", "matmul", "op-list", "policy-fn"])
def test_a_policy_keeps_the_matmuls_and_recomputes_the_rest(policy):
    plain_ops, plain_grads = _backward_ops(_stack())
    model = _stack()
    for block in model:
        sw.set_activation_checkpointing(block, policy=policy)
    ops, grads = _backward_ops(model)

    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    recomputed = ops - plain_ops
    assert recomputed[aten.gelu.default] == 3 and recomputed[aten.tanh.default] == 3  # elementwise: always again
    assert recomputed[aten.addmm.default] == (6 if policy is None else 0)   # two linears a block, kept by a policy


def test_strategies_group_with_a_policy_and_a_graph_capture_keeps_it():
    plain_ops, plain_grads = _backward_ops(_stack())
    model = _stack()
    sw.set_activation_checkpointing(model, strategy="group_2", policy="matmul")  # regions: blocks 0-1, block 2
    ops, grads = _backward_ops(model)
    recomputed = ops - plain_ops
    assert recomputed[aten.addmm.default] == 0 and recomputed[aten.gelu.default] == 3
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    block = _stack()[0]
    sw.set_activation_checkpointing(block, policy="matmul")
    lifted = lift_checkpointing(nn.ModuleDict({"b": block}))
    assert lifted["b"][2] is not None and not hasattr(block, "_shardwise_checkpointed")
    restore_checkpointing(nn.ModuleDict({"b": block}), lifted)
    assert block._shardwise_checkpointed == lifted["b"]


class MatmulBlock(nn.Module):
    """Three bias-free products in a row (each one aten.mm, as a Llama block's projections)."""

    def __init__(self):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x):
        for linear in self.linears:
            x = torch.tanh(linear(x))
        return x


def test_alternate_matmul_keeps_every_other_product_of_each_region_call():
    """torchtitan's op policy: of a region's three aten.mm, the 1st and 3rd are kept and the 2nd runs again in
    backward, in each of the three regions and on each of two steps (the count starts afresh every call)."""
    torch.manual_seed(0)
    plain = nn.Sequential(*(MatmulBlock() for _ in range(3)))
    model = nn.Sequential(*(MatmulBlock() for _ in range(3)))
    model.load_state_dict(plain.state_dict())
    for block in model:
        sw.set_activation_checkpointing(block, policy="alternate_matmul")
    for _ in range(2):
        plain_ops, plain_grads = _backward_ops(plain)
        ops, grads = _backward_ops(model)
        recomputed = ops - plain_ops
        assert recomputed[aten.mm.default] == 3 and recomputed[aten.tanh.default] == 3 * 3
        for got, want in zip(grads, plain_grads):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


class _FirstMatmulOnly:
    """A user's counting policy: keep a region's first aten.mm, recompute the rest."""

    def __init__(self) -> None:
        self.seen = {False: 0, True: 0}

    def __call__(self, ctx, op, *args, **kwargs):
        if op != aten.mm.default:
            return CheckpointPolicy.PREFER_RECOMPUTE
        self.seen[ctx.is_recompute] += 1
        return CheckpointPolicy.MUST_SAVE if self.seen[ctx.is_recompute] == 1 else CheckpointPolicy.PREFER_RECOMPUTE


def test_a_policy_class_counts_afresh_in_every_region_call():
    """A class is a policy whose instances count: each region call, forward and recomputation, gets a new one,
    so every region of every step keeps its own first product (two of three run again, in all three regions)."""
    torch.manual_seed(0)
    plain = nn.Sequential(*(MatmulBlock() for _ in range(3)))
    model = nn.Sequential(*(MatmulBlock() for _ in range(3)))
    model.load_state_dict(plain.state_dict())
    for block in model:
        sw.set_activation_checkpointing(block, policy=_FirstMatmulOnly)
    for _ in range(2):
        plain_ops, plain_grads = _backward_ops(plain)
        ops, grads = _backward_ops(model)
        assert (ops - plain_ops)[aten.mm.default] == 2 * 3
        for got, want in zip(grads, plain_grads):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("policy", [None, "matmul", "alternate_matmul"])
def test_a_hugging_face_model_outside_distributed_model_checkpoints_without_its_cache(policy):
    """A plain Llama builds a key/value cache when training (use_cache defaults on) and hands it to its blocks; a
    checkpointed block's replay must not append to it again. Its blocks run without it while training, as in Hugging
    Face's own gradient checkpointing: loss and gradients exactly those of the model without checkpointing."""
    from tiny_models import tiny_llama

    torch.manual_seed(0)
    plain, model = tiny_llama(layers=2), tiny_llama(layers=2)
    model.load_state_dict(plain.state_dict())
    for block in model.model.layers:
        sw.set_activation_checkpointing(block, policy=policy)
    tokens = torch.randint(0, 128, (2, 8))
    losses = [m(input_ids=tokens, labels=tokens).loss for m in (model, plain)]
    for loss in losses:
        loss.backward()
    assert losses[0].item() == losses[1].item()
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


@pytest.mark.parametrize("policy, message", [
    ("matmuls", "checkpointing policy 'matmuls' is not one of ['alternate_matmul', 'matmul']"),
    ([aten.mm], "name an overload, e.g. aten.mm.default"),
    (3, "checkpointing policy must be None, a name (alternate_matmul, matmul), a list of ops or a policy function, "
        "got int"),
])
def test_a_bad_policy_is_one_line_naming_the_fix(policy, message):
    with pytest.raises((ValueError, TypeError)) as caught:
        sw.set_activation_checkpointing(_stack()[0], policy=policy)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def train_selective(config: dict, kind: str = "gpt2", policy: str = "matmul") -> dict:
    """One rank of the seed's loop, every block it holds checkpointed with `policy`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IneffectiveSettingsWarning)  # offloading on a CPU device moves nothing
        sw.init(config)
    model = sw.DistributedModel(build(kind, freeze_key_bias=True))
    for block in blocks(model.get_module()):
        if not isinstance(block, Elsewhere):
            sw.set_activation_checkpointing(block, policy=policy)
    return train_seed_loop(model, kind, STEPS, ROWS)

@pytest.mark.parametrize("config", [
    {"sharded_data_parallel_degree": 2},
    {"tensor_parallel_degree": 2},
    {"pipeline_parallel_degree": 2, "microbatches": 2},
    {"sharded_data_parallel_degree": 2, "microbatches": 2, "offload_activations": True},
], ids=["zero3", "tp", "pp-microbatches", "zero3-microbatches-offload"])
def test_selective_checkpointing_trains_as_one_plain_process(config):
    ranks = run_distributed(train_selective, 2, config, timeout=240)
    assert_trains_as(ranks, train_reference("gpt2", "sgd", STEPS, ROWS * ranks[0]["dp_size"]), TOLERANCE)


@pytest.mark.parametrize("config", [{"tensor_parallel_degree": 2}, {"sharded_data_parallel_degree": 2}],
                         ids=["tp", "zero3"])
def test_torchtitans_op_policy_trains_a_llama_as_one_plain_process(config):
    """"alternate_matmul" on a Llama (rotary slices, grouped KV heads), its region's products split by tensor
    parallelism or gathered by ZeRO-3."""
    ranks = run_distributed(train_selective, 2, config, "llama", "alternate_matmul", timeout=240)
    assert_trains_as(ranks, train_reference("llama", "sgd", STEPS, ROWS * ranks[0]["dp_size"]), TOLERANCE)


def test_the_planner_and_the_runtime_know_the_same_policy_names():
    """config/recompute.POLICIES (read by the planner, which loads no torch) lists what NAMED maps to ops."""
    from shardwise.config.recompute import POLICIES
    from shardwise.parallel.recompute.selective import NAMED

    assert sorted(POLICIES) == sorted(NAMED)
