"""CUDA tier: op-selective checkpointing keeps the outputs of CUDA's SDPA kernels (flash and memory-efficient).

On the CPU, SDPA runs its CPU flash kernel; on CUDA it picks among the flash,
memory-efficient and cuDNN kernels, each a different aten op, all of which the
"matmul" policy must keep (`torch_internals.ATTENTION_KERNELS`). A stack of
causal attention blocks runs with one kernel forced: with the policy, backward
recomputes no attention kernel and no matmul; fully checkpointed, it runs each
block's attention again. Gradients match the uncheckpointed blocks' to the
kernel's rounding (the flash backward accumulates in a nondeterministic order).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import shardwise as sw
from shardwise.torch_internals import ATTENTION_KERNELS, TorchDispatchMode
from tiny_models import relative_error

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tier: torch sees no CUDA device")]

aten = torch.ops.aten
BLOCKS, HIDDEN, HEADS, TOKENS, ROWS = 3, 256, 4, 128, 2
KERNELS = {  # the forced backend, and the aten op it dispatches to
    SDPBackend.FLASH_ATTENTION: aten._scaled_dot_product_flash_attention.default,
    SDPBackend.EFFICIENT_ATTENTION: aten._scaled_dot_product_efficient_attention.default,
}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


class AttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(F.gelu(attended.transpose(1, 2).flatten(2)))


def _stack(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(AttentionBlock() for _ in range(BLOCKS))).to("cuda", dtype)


def _run(model: nn.Module, backend: SDPBackend) -> tuple[Counter, Counter, list[torch.Tensor]]:
    """The ops forward and backward dispatch under the forced kernel, and the gradients."""
    x = torch.randn(ROWS, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1)).to("cuda", model[0].qkv.weight.dtype)
    with sdpa_kernel([backend]):
        with OpCounter() as forward:
            loss = model(x).float().square().mean()
        with OpCounter() as backward:
            loss.backward()
    return forward.ops, backward.ops, [p.grad.float() for p in model.parameters()]


@pytest.mark.parametrize("backend, dtype", [(SDPBackend.FLASH_ATTENTION, torch.bfloat16),
                                            (SDPBackend.EFFICIENT_ATTENTION, torch.bfloat16),
                                            (SDPBackend.EFFICIENT_ATTENTION, torch.float32)],
                         ids=["flash-bf16", "efficient-bf16", "efficient-fp32"])
@pytest.mark.parametrize("policy", [None, "matmul"], ids=["full", "matmul"])
def test_a_policy_keeps_the_cuda_attention_kernels(backend, dtype, policy):
    kernel = KERNELS[backend]
    assert kernel in ATTENTION_KERNELS
    plain_forward, plain_backward, plain_grads = _run(_stack(dtype), backend)
    assert plain_forward[kernel] == BLOCKS, f"{kernel} did not run: {sorted(map(str, plain_forward))}"

    model = _stack(dtype)
    for block in model:
        sw.set_activation_checkpointing(block, policy=policy)
    _, backward, grads = _run(model, backend)

    recomputed = backward - plain_backward
    assert recomputed[kernel] == (BLOCKS if policy is None else 0)
    products = sum(recomputed[op] for op in (aten.mm.default, aten.addmm.default, aten.bmm.default))
    assert (products > 0) if policy is None else (products == 0), recomputed
    assert recomputed[aten.gelu.default] == BLOCKS  # elementwise: always again
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    worst = max(relative_error(got, want) for got, want in zip(grads, plain_grads))
    assert worst <= tolerance, f"gradients differ by {worst:.2e} (relative)"
