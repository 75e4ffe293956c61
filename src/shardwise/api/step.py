"""`@step`: SMP v1's step decorator — the user's function once per microbatch, with gradient accumulation.

Splitting (SMP's rules): every argument is split into `microbatches` equal parts
along its batch dim — 0, or the one `input_split_axes` gives for its name. That
covers tensors, also inside lists, tuples, dicts, sets and any container torch's
pytree knows (a Hugging Face `ModelOutput`), and objects with an
`smp_slice(num_mb, mb, axis)` method, which slice themselves. Arguments named in
`non_split_inputs`, 0-dim tensors and other values reach every microbatch whole.
Gradients sync once, after the last microbatch. With `control_flow_check_interval`
the ranks compare each call's microbatches and model calls (runtime/control_flow.py).

Results: the function's return value comes back with the same structure and a
`StepOutput` of the per-microbatch values at every leaf, so `_, loss = step(...)`
and `out["loss"].reduce_mean()` work as under SMP; a single tensor gives one
`StepOutput`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Iterator, Optional

import torch
from torch.distributed.tensor import DTensor

from ..parallel.compose import first_step_check
from ..observe.recorder import Recorder, recorder_for
from ..parallel.strategy import NOT_HERE, Pieces
from ..runtime.control_flow import ControlFlowCheck, forward_calls
from ..runtime.init import warn_ineffective
from ..runtime.state import current
from .recompute import runtime_offload
from ..torch_internals import tree_flatten, tree_leaves, tree_map, tree_map_only, tree_unflatten


def _as_tensor(value: Any) -> torch.Tensor:
    """An ordinary tensor (a vocabulary-parallel loss comes back as a replicated DTensor; a number as itself)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


class StepOutput:
    """One value a @step function returned, once per microbatch (`outputs`), with SMP's reductions.

    Under pipeline parallelism only the ranks of the last stage compute the results
    (`holds_loss`); as in SMP, pp rank 0 gets every value too and every other rank
    the scalar ones (a loss). Where a value did not arrive `outputs` is empty and
    every reduction returns None.
    """

    outputs: list[Any]  # SMP's attribute: the value of each microbatch, in order
    holds_loss: bool

    def __init__(self, outputs: list[Any], holds_loss: bool = True, recorder: Optional[Recorder] = None):
        self.outputs = outputs
        self.holds_loss = holds_loss
        self._recorder = recorder  # takes the first reduce_mean of a step as its loss (observe/)

    def _combine(self, fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> Optional[torch.Tensor]:
        if not self.outputs:
            return None
        return fn([_as_tensor(value) for value in self.outputs])

    def reduce_mean(self) -> Optional[torch.Tensor]:
        """Mean over the microbatches of this rank (the step's loss when each microbatch returns its mean)."""
        mean = self._combine(lambda xs: torch.stack(xs).mean(0))
        if self._recorder is not None:
            self._recorder.loss_returned(mean)
        return mean

    def reduce_sum(self) -> Optional[torch.Tensor]:
        return self._combine(lambda xs: torch.stack(xs).sum(0))

    def concat(self) -> Optional[torch.Tensor]:
        """Per-sample outputs of all microbatches joined back along dim 0."""
        return self._combine(lambda xs: torch.cat(xs, 0))

    def stack(self) -> Optional[torch.Tensor]:
        return self._combine(torch.stack)

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, index: int) -> Any:
        return self.outputs[index]


def _slices_itself(value: Any) -> bool:
    return not isinstance(value, type) and callable(getattr(value, "smp_slice", None))


def _split_tensor(tensor: torch.Tensor, parts: int, axis: int, name: str) -> list[torch.Tensor]:
    if not -tensor.dim() <= axis < tensor.dim():
        raise ValueError(f"@step cannot split argument {name!r} along dim {axis}: it holds a tensor of shape "
                         f"{tuple(tensor.shape)}; give its batch dim in input_split_axes or list it in "
                         "non_split_inputs")
    if tensor.shape[axis] % parts:
        raise ValueError(f"@step cannot split a batch of {tensor.shape[axis]} rows into {parts} equal microbatches; "
                         f"make the per-rank batch size a multiple of microbatches={parts}")
    return list(tensor.chunk(parts, axis))


def _split_leaf(value: Any, parts: int, axis: int, name: str) -> list[Any]:
    if _slices_itself(value):
        return [value.smp_slice(parts, mb, axis) for mb in range(parts)]
    if isinstance(value, (set, frozenset)):  # SMP splits sets; torch's pytree does not walk them
        members = [_split_value(member, parts, axis, name) for member in value]
        return [type(value)(member[mb] for member in members) for mb in range(parts)]
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return _split_tensor(value, parts, axis, name)
    return [value] * parts


def _split_value(value: Any, parts: int, axis: int, name: str) -> list[Any]:
    """`value` (argument `name`) per microbatch."""
    leaves, spec = tree_flatten(value, is_leaf=_slices_itself)
    columns = [_split_leaf(leaf, parts, axis, name) for leaf in leaves]
    return [tree_unflatten([column[mb] for column in columns], spec) for mb in range(parts)]


class _BatchSplit:
    """How a step function's arguments are split, by their names in its signature (SMP's options)."""

    def __init__(self, fn: Callable, non_split_inputs: Iterable[str], input_split_axes: Mapping[str, int]):
        self.signature = inspect.signature(fn)
        self.whole = frozenset(non_split_inputs)
        self.axes = dict(input_split_axes)
        params = self.signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        name = getattr(fn, "__name__", "the step function")
        for option, names in (("non_split_inputs", self.whole), ("input_split_axes", self.axes)):
            unknown = sorted(n for n in names if n not in params)
            if unknown and not takes_any:
                raise ValueError(f"@step({option}=...): {name} has no argument {unknown[0]!r}; name arguments as "
                                 f"in its signature ({', '.join(params)})")
        both = sorted(self.whole & self.axes.keys())
        if both:
            raise ValueError(f"@step: {both[0]!r} is in both non_split_inputs and input_split_axes; an argument "
                             "is either passed whole or split along one axis")

    def _per_microbatch(self, name: str, value: Any, parts: int) -> list[Any]:
        if name in self.whole:
            return [value] * parts
        return _split_value(value, parts, self.axes.get(name, 0), name)

    def __call__(self, args: tuple, kwargs: dict, parts: int) -> Pieces:
        """The (args, kwargs) of each of `parts` microbatches."""
        bound = self.signature.bind(*args, **kwargs)
        columns = {}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                # names passed through **kwargs are split by their own names
                split = {key: self._per_microbatch(key, v, parts) for key, v in value.items()}
                columns[name] = [{key: column[mb] for key, column in split.items()} for mb in range(parts)]
            else:
                columns[name] = self._per_microbatch(name, value, parts)
        pieces = []
        for mb in range(parts):
            for name, column in columns.items():
                bound.arguments[name] = column[mb]
            pieces.append((bound.args, bound.kwargs))
        return pieces


def _outline(result: Any) -> str:
    """`result` with each value shown as its type: `(Tensor, {loss: Tensor})`."""
    return repr(tree_map(lambda leaf: type(leaf).__name__, result)).replace("'", "")


def _step_outputs(results: list[Any], holds_loss: bool, recorder: Recorder) -> Any:
    """The function's return structure with a StepOutput of the per-microbatch values at every leaf.

    Off the last pipeline stage a value may be `NOT_HERE` (see PipelineParallel._results_everywhere): its
    StepOutput is then empty.
    """
    flat = [tree_flatten(result) for result in results]
    spec = flat[0][1]
    for index, (_, other) in enumerate(flat[1:], 1):
        if other != spec:
            raise ValueError(f"the @step function returned {_outline(results[0])} for microbatch 0 but "
                             f"{_outline(results[index])} for microbatch {index}; return the same structure for "
                             "every microbatch")

    def gathered(column: list[Any]) -> Optional[StepOutput]:
        if all(value is None for value in column):
            return None  # `return loss, None` keeps its None
        return StepOutput([] if any(value is NOT_HERE for value in column) else column, holds_loss, recorder)

    return tree_unflatten([gathered([leaves[i] for leaves, _ in flat]) for i in range(len(flat[0][0]))], spec)


def _detaching(fn: Callable) -> Callable:
    """`fn` with every tensor it returns detached, so no microbatch's graph outlives the step."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return tree_map_only(torch.Tensor, lambda t: t.detach(), fn(*args, **kwargs))

    return run


def _models_among(args: tuple, kwargs: dict) -> list[Any]:
    """The DistributedModels passed to a @step function, in order (also inside lists, tuples and dicts)."""
    from .model import DistributedModel

    found = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, DistributedModel)]
    return list({id(model): model for model in found}.values())


def _step_models(args: tuple, kwargs: dict, live: list[Any]) -> list[Any]:
    """The models a @step call acts on: those among its arguments, else the one live model (SMP's own
    examples call a global model inside the step function)."""
    models = _models_among(args, kwargs)
    if not models:
        if len(live) == 1:
            return live
        raise RuntimeError(f"@step found no sw.DistributedModel among the step function's arguments and {len(live)} "
                           "live ones, so it cannot tell which it runs; pass the model in, e.g. "
                           "train_step(model, inputs, targets)")
    if len(models) > 1 and any(model.runs_whole_step for model in models):
        raise ValueError("a pipelined DistributedModel runs a whole @step through its schedule, so the step takes "
                         "no other DistributedModel; give each model a @step function of its own")
    return models


def _decorate(fn: Callable[..., Any], split: _BatchSplit, detach_outputs: bool) -> Callable[..., Any]:
    per_microbatch = _detaching(fn) if detach_outputs else fn
    flow = ControlFlowCheck(getattr(fn, "__name__", "function"))

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        runtime = current("@shardwise.step")
        models = _step_models(args, kwargs, list(runtime.models))
        parts = runtime.config.microbatches
        pieces = split(args, kwargs, parts)

        @contextlib.contextmanager
        def counted(index: int) -> Iterator[None]:
            with contextlib.ExitStack() as stack:
                for model in models:
                    stack.enter_context(model.counting(index, parts))
                yield

        @contextlib.contextmanager
        def around(index: int) -> Iterator[None]:
            with counted(index), contextlib.ExitStack() as stack:
                for model in models:
                    stack.enter_context(model.microbatch_context(last=index == parts - 1))
                yield

        forwards = forward_calls(models)
        recorder = recorder_for(runtime)
        offload_check = first_step_check(runtime_offload(runtime), warn_ineffective)
        with offload_check, recorder.step_call(runtime, models, args, kwargs):
            results = models[0].run_step(per_microbatch, pieces, around, counted)
        flow.after_call(runtime.config.control_flow_check_interval, runtime.device, len(pieces),
                        forward_calls(models) - forwards, sum(optimizer.steps for optimizer in runtime.optimizers))
        return _step_outputs(results, models[0].holds_loss, recorder)

    return run


def _names(value: Any) -> list[str]:
    if value is None:
        return []
    names = list(value) if isinstance(value, Iterable) and not isinstance(value, str) else None
    if names is None or not all(isinstance(name, str) for name in names):
        raise TypeError(f"@step(non_split_inputs={value!r}): give a list of the step function's argument names, "
                        "e.g. non_split_inputs=['mask']")
    return names


def _axes(value: Any) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                                 for k, v in value.items()):
        raise TypeError(f"@step(input_split_axes={value!r}): give a dict of argument name -> batch dim, "
                        "e.g. input_split_axes={'inputs': 1}")
    return dict(value)


def step(non_split_inputs: Callable | Iterable[str] | None = None, input_split_axes: Optional[Mapping[str, int]] = None,
         detach_outputs: bool = True) -> Any:
    """Decorate a train/eval step `fn(model, *batch)`: it runs per microbatch; returns its results as StepOutputs.

    As SMP's `@smp.step`, used bare or called: `non_split_inputs` names arguments passed whole to every
    microbatch; `input_split_axes` maps argument names to the dim they are split along (default 0);
    `detach_outputs` (default True) detaches the returned tensors, False keeps their graphs. The
    DistributedModels among the arguments are the ones it acts on: each synchronises its gradients after
    the last microbatch (a teacher and a student in one step, each its own way); with none among them, the
    one DistributedModel that exists (a global model, as in SMP's examples).
    """
    if callable(non_split_inputs):  # bare @step: the function itself
        return _decorate(non_split_inputs, _BatchSplit(non_split_inputs, (), {}), detach_outputs=True)
    names, axes = _names(non_split_inputs), _axes(input_split_axes)
    if not isinstance(detach_outputs, bool):
        raise TypeError(f"@step(detach_outputs={detach_outputs!r}): give True or False")
    return lambda fn: _decorate(fn, _BatchSplit(fn, names, axes), detach_outputs)
