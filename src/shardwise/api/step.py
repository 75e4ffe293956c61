"""`@step`: run the user's function once per microbatch with gradient accumulation.

Every tensor argument (also inside lists, tuples and dicts, e.g. a Hugging Face
batch) is split into `microbatches` equal parts along dim 0; other arguments
pass through unchanged. Gradients sync once, after the last microbatch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ..parallel.tensor import loss_context
from ..runtime.state import current


def _plain(value: torch.Tensor) -> torch.Tensor:
    """A detached ordinary tensor (a vocabulary-parallel loss comes back as a replicated DTensor)."""
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach()


class StepOutput:
    """The per-microbatch return values of a @step function, with SMP's reductions.

    Under pipeline parallelism only the ranks of the last stage run the loss, so
    only they hold the results: elsewhere `holds_loss` is False, the output is
    empty and every reduction returns None.
    """

    def __init__(self, outputs: list[Any], holds_loss: bool = True):
        self.outputs = outputs
        self.holds_loss = holds_loss

    def _combine(self, fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> Any:
        if not self.holds_loss:
            return None
        flat = [pytree.tree_flatten(o) for o in self.outputs]
        spec = flat[0][1]
        leaves = [fn([_plain(f[0][i]) for f in flat]) for i in range(len(flat[0][0]))]
        return pytree.tree_unflatten(leaves, spec)

    def reduce_mean(self) -> Any:
        """Mean over the microbatches of this rank (as SMP's reduce_mean)."""
        return self._combine(lambda xs: torch.stack(xs).mean(0))

    def reduce_sum(self) -> Any:
        return self._combine(lambda xs: torch.stack(xs).sum(0))

    def concat(self) -> Any:
        """Per-sample outputs of all microbatches joined back along dim 0."""
        return self._combine(lambda xs: torch.cat(xs, 0))

    def stack(self) -> Any:
        return self._combine(torch.stack)

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, index: int) -> Any:
        return self.outputs[index]


def _split(tree: Any, parts: int) -> list[Any]:
    leaves, spec = pytree.tree_flatten(tree)
    columns = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] % parts:
                raise ValueError(
                    f"@step cannot split a batch of {leaf.shape[0]} rows into {parts} equal microbatches; "
                    f"make the per-rank batch size a multiple of microbatches={parts}")
            columns.append(leaf.chunk(parts, 0))
        else:
            columns.append([leaf] * parts)
    return [pytree.tree_unflatten([col[i] for col in columns], spec) for i in range(parts)]


def step(fn: Callable[..., Any]) -> Callable[..., StepOutput]:
    """Decorate a train/eval step: `fn(model, *batch)` runs per microbatch; returns a `StepOutput`."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> StepOutput:
        runtime = current("@shardwise.step")
        if runtime.model is None:
            raise RuntimeError("@step needs a sw.DistributedModel; create it before calling the step function")
        parts = runtime.config.microbatches
        pieces = _split((args, kwargs), parts)
        if runtime.config.pipeline_parallel_degree > 1:
            outputs = runtime.model.run_pipeline(fn, pieces)
            return StepOutput(outputs, holds_loss=bool(outputs))
        outputs = []
        try:
            for index, (mb_args, mb_kwargs) in enumerate(pieces):
                runtime.microbatch = (index, parts)
                # loss_context: vocabulary-parallel logits need forward, loss and backward under loss_parallel().
                with runtime.model.microbatch_context(last=index == parts - 1), loss_context(runtime.model.get_module()):
                    outputs.append(fn(*mb_args, **mb_kwargs))
        finally:
            runtime.microbatch = None
        return StepOutput(outputs)

    return run
