"""Op-selective activation checkpointing: inside a checkpointed region, keep the outputs of chosen ops.

A region checkpointed in full keeps only its inputs and runs its whole forward
again in backward. With a `policy`, torch's selective checkpointing
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) also keeps the
outputs of the ops the policy names and recomputes only the rest: with
`"matmul"`, the matrix products and attention kernels (the costly ops) are kept
and the cheap elementwise ops (norms, activations, dropout, residual adds) are
run again. The functional collectives a region issues (tensor parallelism's
redistributions) are kept too, so its recomputation does not send them again.
A policy is one of

- `None`: recompute everything (full checkpointing);
- `"matmul"`: keep `MATMUL_OPS`' outputs;
- `"alternate_matmul"`: torchtitan's "op" policy (`AlternateMatmul`): keep the attention kernels' and the
  collectives' outputs and every other `aten.mm` of the region in forward order (the 1st, 3rd, ...);
- a list of `OpOverload`s (`torch.ops.aten.mm.default`): keep those;
- a callable `policy_fn(ctx, op, *args, **kwargs)` returning a
  `torch.utils.checkpoint.CheckpointPolicy` (or a bool: True saves), as torch takes it;
- a class whose instances are such callables: a policy that counts ops (as `AlternateMatmul` does) gets a
  fresh instance for every region call, so each forward and its recomputation choose alike.

What a policy keeps stays on the device: activation offloading moves only the
regions' inputs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterator, Union

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ...torch_internals import (ATTENTION_KERNELS, HigherOrderOperator, OpOverload, OpOverloadPacket,
                                functional_collective_ops)

ContextFn = Callable[[], tuple[ContextManager, ContextManager]]
Policy = Union[None, str, list, Callable[..., Any]]

_aten, _c10d = torch.ops.aten, functional_collective_ops
MATMUL_OPS = [
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, *ATTENTION_KERNELS,
    _c10d.all_reduce.default, _c10d.reduce_scatter_tensor.default, _c10d.all_gather_into_tensor.default,
    _c10d.all_to_all_single.default,
]


class AlternateMatmul:
    """torchtitan's "op" selective checkpointing (torchtitan/parallelisms/parallelize_llama.py, `_save_list` and
    `_custom_policy` at 9dec370: "Saves output of all compute ops, except every second mm"): keep the attention
    kernels' and the functional collectives' outputs and, counting the region's `aten.mm` calls in forward order,
    the 1st, 3rd, ...; recompute the rest (of a Llama block's projections q, v, gate and down are kept). A fresh
    one counts each region call, in forward and again in its recomputation, so both make the same choices."""

    KEPT = (*ATTENTION_KERNELS, *(op for op in MATMUL_OPS if op.namespace != "aten"))

    def __init__(self) -> None:
        self.counts = {False: 0, True: 0}   # aten.mm calls so far, in forward (False) and in recomputation

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op == _aten.mm.default:
            self.counts[ctx.is_recompute] += 1
            keep = self.counts[ctx.is_recompute] % 2 == 1
        else:
            keep = op in self.KEPT
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


NAMED = {"matmul": MATMUL_OPS, "alternate_matmul": AlternateMatmul}  # config/recompute.POLICIES, the planner's names


def checked_policy(policy: Policy) -> Policy:
    """`policy` as torch's selective checkpointing takes it (a list of ops or a policy function), or None;
    a one-line error for anything else."""
    if policy is None or callable(policy) and not isinstance(policy, OpOverloadPacket):
        return policy
    if isinstance(policy, str):
        if policy not in NAMED:
            raise ValueError(f"checkpointing policy {policy!r} is not one of {sorted(NAMED)}; pass None to recompute "
                             "everything, a name, a list of ops (torch.ops.aten.mm.default) or a policy function")
        return NAMED[policy]
    if isinstance(policy, (list, tuple)):
        for op in policy:
            if not isinstance(op, (OpOverload, HigherOrderOperator)):
                hint = (f"; name an overload, e.g. {op}.default" if isinstance(op, OpOverloadPacket)
                        else "")
                raise ValueError(f"checkpointing policy: {op!r} is not an op overload{hint}")
        return list(policy)
    raise TypeError(f"checkpointing policy must be None, a name ({', '.join(sorted(NAMED))}), a list of ops or a "
                    f"policy function, got {type(policy).__name__}")


def with_policy(context_fn: ContextFn, policy: Policy) -> ContextFn:
    """A checkpoint `context_fn` that enters `context_fn`'s contexts and, with a policy, the selective ones."""
    if policy is None:
        return context_fn
    return functools.partial(_both, context_fn, policy)


def _both(context_fn: ContextFn, policy: Policy) -> tuple[ContextManager, ContextManager]:
    forward, recompute = context_fn()
    keep, replay = create_selective_checkpoint_contexts(policy() if isinstance(policy, type) else policy)
    return _entered(forward, keep), _entered(recompute, replay)


@contextlib.contextmanager
def _entered(first: ContextManager, second: ContextManager) -> Iterator[None]:
    with first, second:
        yield

