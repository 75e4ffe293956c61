"""Drive the pipeline schedule from @step: the user's batch in, the user's per-microbatch results out.

`microbatches` splits the batch; the schedule runs them in rounds of
`active_microbatches` (all at once when unset, or when 1f1b bounds them anyway),
so at most that many are in flight on a stage and their activations alive. Each round ends with a gradient
reduction over the data-parallel ranks (the schedule's last backward); the
reductions add up to the same gradients as one reduction at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...torch_internals import tree_flatten, tree_map, tree_unflatten
from ..clipping import clip_grad_norm_
from ..strategy import NOT_HERE, OptimizerBinding, Pieces, Strategy
from ..tensor import loss_context
from . import schedule as schedules
from .schedule import EvalSafeStage, build_schedule
from .calls import OutputsModel, call_with, capture
from .ties import TiedWeights


@dataclasses.dataclass(frozen=True)
class _TensorLeaf:  # not a NamedTuple, which pytrees would open up
    shape: torch.Size
    dtype: torch.dtype

    @property
    def scalar(self) -> bool:
        return self.shape.numel() == 1


def _plain(value: torch.Tensor) -> torch.Tensor:
    """A result tensor as the wire carries it (a replicated DTensor, e.g. a vocabulary-parallel loss, whole)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _describe(value: Any) -> Any:
    """What the other pp ranks learn of a result before it is sent: a tensor's shape and dtype, else itself."""
    return _TensorLeaf(value.shape, value.dtype) if isinstance(value, torch.Tensor) else value


class StageModules(nn.Module):
    """This rank's (wrapped) stage modules; the model itself runs only inside a @step function."""

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(modules)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("with pipeline_parallel_degree > 1 the model runs only inside a @sw.step function, "
                           "which feeds its microbatches through the pipeline; call the step function instead")


def _join(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Microbatch inputs joined along dim 0 into one round's batch (the schedule splits it again).

    Only tensors with a dim 0 are split again; any other input reaches every microbatch as it is."""
    def join(name: str, *values: Any) -> Any:
        first = values[0]
        if isinstance(first, torch.Tensor) and first.dim():
            return torch.cat(values)
        if any(value is not first and bool(value != first) for value in values[1:]):
            raise TypeError(f"under pipeline parallelism the model's input {name!r} may differ between microbatches "
                            f"only as a tensor with a batch dim, but it is a {type(first).__name__}; pass the model "
                            "its tensors instead")
        return first

    return {name: tree_map(functools.partial(join, name), value, *(call[name] for call in calls[1:]))
            for name, value in calls[0].items()}


class PipelineParallel(Strategy):
    """A pipelined model's strategy: this rank's stages under a schedule that runs the whole @step."""

    runs_whole_step = True

    def __init__(self, inner: nn.Module, stages: list[Any], wrapped: list[nn.Module], ties: TiedWeights,
                 pp_group: dist.ProcessGroup, schedule: str, total: int, per_round: int, device: torch.device,
                 signature: Optional[inspect.Signature] = None, binding: Optional[OptimizerBinding] = None):
        """`stages`: this rank's `StageModule`s (or graph stages), `wrapped` what each runs; `schedule`: torch's
        schedule name, over `total` stages, `per_round` microbatches at a time; `device`: this rank's; `signature`:
        the model's forward's, which names the inputs (default `inner.forward`'s); `binding`: ZeRO-1's, where the
        composition chose it."""
        super().__init__(StageModules(wrapped), inner, binding=binding)  # inner: this rank's stages, names unsplit
        self.device = device
        self.signature = signature or inspect.signature(inner.forward)
        self.stages = stages
        self.ties = ties
        self.pp_group = pp_group
        self.per_round = per_round  # microbatches each run of the schedule takes (config.pipeline_round)
        self.holds_loss = any(stage.is_last for stage in stages)
        self.schedule = build_schedule(schedule, [
            EvalSafeStage(module, stage.index, total, device, group=pp_group)
            for module, stage in zip(wrapped, stages)], per_round, self.loss)
        self._step: Optional[dict[str, Any]] = None  # the @step call being run

    def microbatch_context(self, last: bool) -> ContextManager:
        """Never entered by @step (the schedule runs the microbatches); a call of the model outside one is refused
        by the stage modules."""
        return self.loss_context()

    def stage_modules(self) -> list[nn.Module]:
        return list(self.module.stages)

    def run_step(self, model: nn.Module, fn: Callable, pieces: Pieces, around: Callable[[int], ContextManager],
                 counted: Callable[[int], ContextManager]) -> list[Any]:
        """Run one @step batch through the pipeline; the per-microbatch results of `fn` on the last stage,
        their structure elsewhere. The schedule calls `loss` per microbatch, which enters `counted(index)` itself
        (`around` is unused); `fn` detaches what it returns if the step asks for it."""
        calls = [capture(fn, model, self.signature, args, kwargs) for args, kwargs in pieces]
        train = torch.is_grad_enabled()
        device = self.device
        per_round = self.per_round
        self._step = {"fn": fn, "model": model, "pieces": pieces, "train": train, "results": {}, "counted": counted}
        earlier = self.ties.set_aside() if train else []
        try:
            for start in range(0, len(pieces), per_round):
                target = torch.arange(start, start + per_round, device=device) if self.holds_loss else None
                with loss_context(self.inner):
                    schedules.run(self.schedule, train, target, _join(calls[start:start + per_round]))
            results = self._step["results"]
        finally:
            self._step = None
        if train:
            self.ties.sum_grads(self.local_gradient)
            self.ties.add_back(earlier)
            self.after_backward_passes()
        return self._results_everywhere([results[i] for i in range(len(pieces))] if self.holds_loss else [])

    def _results_everywhere(self, results: list[Any]) -> list[Any]:
        """Per microbatch, the step function's results on the last stage, delivered as SMP did: every value to
        pp rank 0, where the script runs, and scalars (a loss) to every rank; elsewhere `NOT_HERE` stands for a
        value this rank does not get. One small all-gather tells every rank the structure, then one broadcast
        per scalar output and one send per other tensor to pp rank 0."""
        described = [tree_map(_describe, result) for result in results] if self.holds_loss else None
        held: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(held, described, group=self.pp_group)
        source = next(rank for rank, sent in enumerate(held) if sent is not None)
        me = dist.get_group_rank(self.pp_group, dist.get_rank())
        leaves = [tree_flatten(result) for result in held[source]]
        mine = [tree_flatten(result)[0] for result in results] if self.holds_loss else None
        delivered = []
        for index, (described_leaves, spec) in enumerate(leaves):
            values = []
            for position, leaf in enumerate(described_leaves):
                own = mine[index][position] if mine is not None else None
                values.append(self._deliver(leaf, own, source, me))
            delivered.append(tree_unflatten(values, spec))
        return delivered

    def _deliver(self, leaf: Any, own: Any, source: int, me: int) -> Any:
        """One value of the last stage's results, as this rank gets it (see `_results_everywhere`)."""
        if not isinstance(leaf, _TensorLeaf):
            return own if me == source else leaf  # None, a number, a string: the gathered object is the value
        if me == source:
            tensor = _plain(own)
        elif leaf.scalar or me == 0:
            tensor = torch.empty(leaf.shape, dtype=leaf.dtype, device=self.device)
        else:
            return NOT_HERE
        if leaf.scalar:
            dist.broadcast(tensor, group=self.pp_group, group_src=source)
        elif source != 0:
            if me == source:
                dist.send(tensor.contiguous(), group=self.pp_group, group_dst=0)
            else:
                dist.recv(tensor, group=self.pp_group, group_src=source)
        return own if me == source else tensor

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: the user's function on microbatch `target`."""
        step = self._step
        index = int(target.reshape(-1)[0])
        stage = next(s for s in self.stages if s.is_last)
        stand_in = OutputsModel(step["model"], stage.rebuild(output))
        args, kwargs = step["pieces"][index]
        with step["counted"](index):
            result = call_with(step["fn"], step["model"], stand_in, args, kwargs)
        # Metadata inference calls this once more for microbatch 0 on the first step; the later call wins.
        step["results"][index] = result
        if stand_in.loss is not None:
            return stand_in.loss
        if step["train"]:
            raise RuntimeError("a training @step function must call model.backward(loss) for every microbatch "
                               "(run evaluation steps under torch.no_grad())")
        return torch.zeros((), device=output[0].device if isinstance(output, tuple) else output.device)

    def clip_grad_norm_(self, max_norm: float, device: torch.device) -> torch.Tensor:
        """Clip by the norm over every stage's gradients, each tied weight counted once."""
        skip = self.ties.duplicates()
        return clip_grad_norm_(self.inner.parameters(), max_norm, device, across=self.pp_group,
                               counted=lambda p: id(p) not in skip)

    def tied_copies(self) -> set[int]:
        return self.ties.duplicates()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model on every rank: this rank's stages joined with every other stage's."""
        return self.gather_stages(super().full_state_dict())

    def held(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's stages' entries (names as in the unsplit model)."""
        mine = self.inner.state_dict().keys()
        return {name: value for name, value in state.items() if name in mine}

    @torch.no_grad()
    def gather_stages(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (this rank's stages) joined with every other stage's, on every rank of the pp group.

        Each tensor comes from the first pp rank holding it (buffers of modules every stage runs are alike).
        """
        group = self.pp_group
        me = dist.get_group_rank(group, dist.get_rank())
        held: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(held, {name: (t.shape, t.dtype) for name, t in state.items()}, group=group)
        device = next(iter(state.values())).device
        merged: dict[str, torch.Tensor] = {}
        for source, names in enumerate(held):
            for name, (shape, dtype) in names.items():
                if name not in merged:
                    merged[name] = state[name] if source == me else torch.empty(shape, dtype=dtype, device=device)
                    dist.broadcast(merged[name], group=group, group_src=source)
        return merged
