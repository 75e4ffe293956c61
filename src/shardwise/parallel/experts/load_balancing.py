"""The router's load-balancing loss over the whole global batch, as one process computes it.

The Switch-Transformer loss of Mixtral, Qwen-MoE and OLMoE is E · Σ_e f_e · P_e, with
f_e the share of top-k picks that chose expert e and P_e its mean router probability,
both over every token of the batch. Each data-parallel rank sees only its own
tokens, and the product of per-rank means is not the mean of products, so the ranks'
losses would not add up to one process's. Here the counts, the probability sums and
the token count are summed over the data group before the product. The probability
sum's all-reduce sums gradients in backward too: each rank's loss holds the global
term, so its own tokens' share comes back once per rank, and data parallelism's mean
over the ranks leaves exactly one process's gradient.

Hugging Face models call a module-level `load_balancing_loss_func` from their own
modeling module; `use_global_load_balancing` has the model's forward call this one there.

Under a pipeline each stage's forward sees only its own layers' router logits, and
the sums run over every layer: a stage adds its layers' counts and probability sums
to those it received and passes them on beside the hidden states (`stage`, `sent`),
and the last stage takes the product. The probability sums' gradient goes back the
same way, to each stage's routers. Each microbatch is its own batch here, as it is
to one process accumulating the same microbatches' gradients.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...torch_internals import all_reduce_sum

_FUNCTION = "load_balancing_loss_func"
# model -> its GlobalLoadBalancing; beside the model, not on it, so copying the model copies no process group
_installed: "weakref.WeakKeyDictionary[nn.Module, GlobalLoadBalancing]" = weakref.WeakKeyDictionary()


class _SumOverGroup(torch.autograd.Function):
    """Sum over `group`; the backward sums the incoming gradients over `group` as well."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_reduce_sum(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_sum(grad.contiguous(), ctx.group), None


def load_balancing_loss(router_logits: Optional[tuple[torch.Tensor, ...]], num_experts: int, top_k: int = 2,
                        attention_mask: Optional[torch.Tensor] = None, *,
                        group: Optional[dist.ProcessGroup]) -> torch.Tensor | int:
    """Hugging Face's load-balancing loss (same arguments) over every token of the ranks in `group` (None: this
    rank's alone)."""
    if router_logits is None or not isinstance(router_logits, tuple):
        return 0
    return _product(_partial_sums(router_logits, num_experts, top_k, attention_mask), num_experts, group)


def _partial_sums(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                  attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """[picks per expert (E), router probability sums per expert (E), rows] over `router_logits`' layers."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    for logits in router_logits:
        weights = torch.nn.functional.softmax(logits.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        mask = (torch.ones(weights.shape[0], dtype=torch.float32, device=device) if attention_mask is None
                else attention_mask.reshape(-1).to(device=device, dtype=torch.float32))
        counts = counts.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        probabilities = probabilities + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + mask.sum()
    return torch.cat([counts, probabilities, rows])


class _PlainGradient(torch.autograd.Function):
    """Identity whose backward takes a DTensor gradient whole: the model adds this loss to its own, which tensor
    parallelism's vocabulary-parallel cross entropy makes a DTensor, and autograd would bring its gradient here."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _product(sums: torch.Tensor, num_experts: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """E · Σ_e f_e · P_e from `_partial_sums`' layout, the sums first added over `group`."""
    counts, probabilities, rows = sums[:num_experts].detach(), sums[num_experts:2 * num_experts], sums[-1].detach()
    if group is not None:
        counts, rows = all_reduce_sum(counts, group), all_reduce_sum(rows, group)
        probabilities = _SumOverGroup.apply(probabilities, group)
    return _PlainGradient.apply(torch.sum((counts / rows) * (probabilities / rows)) * num_experts)


class GlobalLoadBalancing:
    """A model's load-balancing loss over the ranks of `group` (None: this rank's own) and, under a pipeline,
    over the layers of every stage (module docstring): stands in for `load_balancing_loss_func` in `module`."""

    def __init__(self, module: Any, group: Optional[dist.ProcessGroup]):
        self.module, self.group, self.original = module, group, getattr(module, _FUNCTION)
        self._received: Optional[torch.Tensor] = None  # the earlier stages' sums
        self._last = True
        self._sums: Optional[torch.Tensor] = None  # what a stage before the last passes on

    def __call__(self, router_logits, num_experts, top_k=2, attention_mask=None):
        if router_logits is None or not isinstance(router_logits, tuple):
            return 0
        sums = _partial_sums(router_logits, num_experts, top_k, attention_mask)
        if self._received is not None:
            sums = sums + self._received
        if not self._last:
            self._sums = sums
            return torch.zeros((), device=sums.device)  # the model's aux loss on a stage whose outputs are dropped
        return _product(sums, num_experts, self.group)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """This loss in place of the model's own, for one forward."""
        setattr(self.module, _FUNCTION, self)
        try:
            yield
        finally:
            setattr(self.module, _FUNCTION, self.original)

    @contextlib.contextmanager
    def stage(self, received: Optional[torch.Tensor], last: bool) -> Iterator[None]:
        """One pipeline stage's forward: `received`, the sums of the stages before (None on the first)."""
        self._received, self._last, self._sums = received, last, None
        try:
            with self.swapped():
                yield
        finally:
            self._received, self._last = None, True

    def sent(self, device: torch.device) -> torch.Tensor:
        """The sums a stage before the last passes on (a zero on `device` if the model computed no such loss)."""
        sums, self._sums = self._sums, None
        return torch.zeros(1, device=device) if sums is None else sums


def use_global_load_balancing(model: nn.Module, group: Optional[dist.ProcessGroup]) -> bool:
    """Have `model`'s forward compute its load-balancing loss over the ranks of `group` (the ranks whose batches
    make up the global batch; None: this rank's), and a pipeline's stages theirs over every stage's layers
    (`load_balancing_of`). False when its modeling module defines no such loss."""
    module = sys.modules.get(type(model).__module__)
    if getattr(module, _FUNCTION, None) is None:
        return False
    balancing = GlobalLoadBalancing(module, group)
    _installed[model] = balancing
    # Swapped in for the model's own forward only: other models of the same family keep theirs.
    model.register_forward_pre_hook(lambda *_: setattr(module, _FUNCTION, balancing))
    model.register_forward_hook(lambda *_: setattr(module, _FUNCTION, balancing.original), always_call=True)
    return True


def load_balancing_of(model: nn.Module) -> Optional[GlobalLoadBalancing]:
    """The `GlobalLoadBalancing` installed on `model`, if any."""
    return _installed.get(model)
