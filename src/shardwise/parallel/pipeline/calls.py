"""The user's @step function under pipeline parallelism, unchanged: what it passes to the model, and
what it does with the model's outputs.

Every stage runs the function up to its `model(...)` call with a stand-in that
records the arguments and stops it (every stage needs them: masks and position
ids are rebuilt from them on every stage). On the last stage the schedule's
loss function runs the function again per microbatch, with a stand-in whose
call returns that microbatch's real outputs and whose `backward` only hands the
loss to the schedule, which runs the backward pass itself.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from ...torch_internals import tree_map


class _Recorded(Exception):
    pass


class _Stand:
    """Answers attribute lookups as the DistributedModel would; subclasses decide what a call does."""

    def __init__(self, model: nn.Module):
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _Recorder(_Stand):
    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.call: Optional[tuple[tuple, dict]] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.call = (args, kwargs)
        raise _Recorded


def as_keywords(forward: Callable | inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The model call's arguments by parameter name (a stage takes the model's inputs as keywords); `forward` is
    the model's forward or its signature.

    A Hugging Face model that can keep a key/value cache is told not to: a
    cache is no use in a training step and the stages could not pass it on.
    """
    signature = forward if isinstance(forward, inspect.Signature) else inspect.signature(forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"the @step function called the model with arguments its forward does not take: "
                        f"{err}") from None
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL and value:
            raise TypeError(f"under pipeline parallelism the model's inputs must have names, but its forward takes "
                            f"*{name}; call it with keyword arguments")
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            named[name] = value
    if "use_cache" in signature.parameters and "use_cache" not in named:
        named["use_cache"] = False
    return named


def call_with(fn: Callable, model: nn.Module, stand_in: Any, args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` with `stand_in` wherever the arguments pass `model`."""
    args, kwargs = tree_map(lambda value: stand_in if value is model else value, (args, kwargs))
    return fn(*args, **kwargs)


def capture(fn: Callable, model: nn.Module, forward: Callable | inspect.Signature, args: tuple,
            kwargs: dict) -> dict[str, Any]:
    """Run `fn(*args, **kwargs)` up to its call of `model` and return that call's inputs by name."""
    recorder = _Recorder(model)
    try:
        call_with(fn, model, recorder, args, kwargs)
    except _Recorded:
        return as_keywords(forward, *recorder.call)
    raise RuntimeError("under pipeline parallelism the @step function must call model(...) (once per microbatch); "
                       f"{getattr(fn, '__name__', fn)} returned without calling it")


class OutputsModel(_Stand):
    """The model as the last stage's loss sees it: a call returns `outputs`; `backward` keeps the loss."""

    def __init__(self, model: nn.Module, outputs: Any):
        super().__init__(model)
        self.outputs: Optional[Any] = outputs
        self.loss: Optional[torch.Tensor] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.outputs is None:
            raise RuntimeError("under pipeline parallelism the @step function may call model(...) only once per "
                               "microbatch: the pipeline runs the one call it recorded")
        outputs, self.outputs = self.outputs, None
        return outputs

    def backward(self, loss: torch.Tensor) -> None:
        self.loss = self._model.scaled_loss(loss)
