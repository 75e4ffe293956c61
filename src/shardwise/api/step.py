"""`@step`: run the user's function once per microbatch with gradient accumulation.

Every tensor argument (also inside lists, tuples and dicts, e.g. a Hugging Face
batch) is split into `microbatches` equal parts along dim 0; other arguments
pass through unchanged. Gradients sync once, after the last microbatch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from .. import torch_internals as pytree
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


def _models_among(args: tuple, kwargs: dict) -> list[Any]:
    """The DistributedModels passed to a @step function, in order (also inside lists, tuples and dicts)."""
    from .model import DistributedModel

    found = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, DistributedModel)]
    return list({id(model): model for model in found}.values())


def _step_models(args: tuple, kwargs: dict) -> list[Any]:
    models = _models_among(args, kwargs)
    if not models:
        raise RuntimeError("@step found no sw.DistributedModel among the step function's arguments; pass the "
                           "model in, e.g. train_step(model, inputs, targets)")
    if len(models) > 1 and any(model.runs_whole_step for model in models):
        raise ValueError("a pipelined DistributedModel runs a whole @step through its schedule, so the step takes "
                         "no other DistributedModel; give each model a @step function of its own")
    return models


def step(fn: Callable[..., Any]) -> Callable[..., StepOutput]:
    """Decorate a train/eval step: `fn(model, *batch)` runs per microbatch; returns a `StepOutput`.

    The DistributedModels among the arguments are the ones it acts on: each synchronises its gradients
    after the last microbatch (a teacher and a student in one step, each its own way)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> StepOutput:
        runtime = current("@shardwise.step")
        models = _step_models(args, kwargs)
        parts = runtime.config.microbatches
        pieces = _split((args, kwargs), parts)

        @contextlib.contextmanager
        def around(index: int) -> Iterator[None]:
            runtime.microbatch = (index, parts)
            try:
                with contextlib.ExitStack() as stack:
                    for model in models:
                        stack.enter_context(model.microbatch_context(last=index == parts - 1))
                    yield
            finally:
                runtime.microbatch = None

        outputs = models[0].run_step(fn, pieces, around)
        return StepOutput(outputs, holds_loss=models[0].holds_loss)

    return run
