"""The optimizer step under `cross_group_overlap: forward`: each unit's shard stepped as its all-reduce lands.

MiCS's deferred cross-group reduction (mics.py) leaves the backward pass
with all-reduces still on the link. `step()` steps the shards already landed
and returns; each one landing after it is stepped on arrival, with the
hyperparameters `step()` saw (a scheduler may set the next `lr` in between),
at the latest when the next forward reaches its unit or something waits for
them all (`synchronize`: state dicts, checkpoints, `model.parameters()`). A
step that needs every gradient at once (clipping, fp16's loss scaler, the
non-finite check, a closure) waits for them all first and steps as usual.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..strategy import OptimizerUpdate, Strategy
from .mics import CrossGroupReduction


class StepAsShardsLand(OptimizerUpdate):
    """A DistributedOptimizer's step over MiCS whose cross-group all-reduces outlive backward."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Strategy, scaler: Optional[torch.amp.GradScaler],
                 device: torch.device, *, reduction: CrossGroupReduction, whole_steps_only: bool):
        """`whole_steps_only`: something reads every gradient before any is stepped (the non-finite check)."""
        super().__init__(optimizer, strategy, scaler, device)
        self.reduction = reduction
        self._whole_steps_only = scaler is not None or whole_steps_only  # fp16's scaler reads them all too
        self._options: Optional[list[dict[str, Any]]] = None  # each group's options at step(), while shards land
        reduction.listeners.append(self._landed)

    def step(self, closure: Any, clip: Optional[float]) -> tuple[Any, Optional[torch.Tensor]]:
        self.reduction.advance()
        if closure is not None or clip is not None or self._whole_steps_only or not self.reduction.landing:
            self.synchronize()
            return super().step(closure, clip)
        self._options = [{key: value for key, value in group.items() if key != "params"}
                         for group in self.optimizer.param_groups]
        return self._step_only(self.reduction.landed_params(), self.optimizer.step), None

    def _landed(self, params: list[nn.Parameter], aside: dict[nn.Parameter, Optional[torch.Tensor]]) -> None:
        """Step a unit that landed after `step()`; gradients changed since backward (zeroed) give way to the
        averages for it, and come back after."""
        if self._options is None:
            return
        kept = {param: param.grad for param in aside}
        try:
            for param, average in aside.items():
                param.grad = average
            step = type(self.optimizer).step
            self._step_only(params, lambda: getattr(step, "__wrapped__", step)(self.optimizer))  # hooks ran once
        finally:
            for param, grad in kept.items():
                param.grad = grad
        if all(unit.landed for unit in self.reduction.units):
            self._options = None

    def _step_only(self, params: list[nn.Parameter], step: Any) -> Any:
        """Run `step` with each param group narrowed to `params` and set to its options at `step()`."""
        chosen = {id(p) for p in params}
        groups = self.optimizer.param_groups
        saved = [dict(group) for group in groups]
        try:
            for group, options in zip(groups, self._options):
                group.update(options, params=[p for p in group["params"] if id(p) in chosen])
            return step()
        finally:
            for group, before in zip(groups, saved):
                group.clear()
                group.update(before)

    def zero_grad(self, set_to_none: bool) -> None:
        if not set_to_none:
            self.reduction.keep_unsent()
        super().zero_grad(set_to_none)

    def synchronize(self) -> None:
        """Land every all-reduce still on the link (stepping those the last `step()` left)."""
        self.reduction.drain()
        self._options = None


def bind_step_as_shards_land(reduction: CrossGroupReduction, whole_steps_only: bool):
    """The optimizer binding of a model whose cross-group reduction is deferred."""
    def bind(optimizer: torch.optim.Optimizer, strategy: Strategy, scaler: Optional[torch.amp.GradScaler],
             device: torch.device) -> StepAsShardsLand:
        return StepAsShardsLand(optimizer, strategy, scaler, device, reduction=reduction,
                                whole_steps_only=whole_steps_only)
    return bind
