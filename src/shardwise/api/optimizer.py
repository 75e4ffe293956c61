"""`DistributedOptimizer`: the user's optimizer, sharded for ZeRO-1, with loss scaling and clipping in `step`."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..runtime.state import current


def _shard_optimizer_state(optimizer: torch.optim.Optimizer, process_group) -> ZeroRedundancyOptimizer:
    """ZeRO-1: rebuild the same optimizer class and groups, each rank keeping state for its share only."""
    if optimizer.state:
        raise ValueError("DistributedOptimizer must wrap a fresh optimizer (it already has state); "
                         "create it right after DistributedModel and before the first step")
    accepted = inspect.signature(type(optimizer).__init__).parameters
    # Some classes record derived defaults their constructor does not take (AdamW: decoupled_weight_decay).
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{k: v for k, v in group.items() if k in accepted or k == "params"} for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=process_group, **defaults)


class DistributedOptimizer:
    """Steps the wrapped optimizer the way the configured parallelism needs."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        runtime = current("shardwise.DistributedOptimizer")
        if runtime.model is None:
            raise RuntimeError("create sw.DistributedModel(...) before sw.DistributedOptimizer(...), and build the "
                               "optimizer from model.parameters()")
        self._runtime = runtime
        self._model = runtime.model
        if runtime.config.effective_zero_stage == 1 and runtime.layout.dp > 1:
            optimizer = _shard_optimizer_state(optimizer, runtime.mesh["rdp"].get_group())
        self.optimizer = optimizer

    def step(self, closure: Any = None) -> Any:
        """Unscale (fp16), clip (`gradient_clipping`), step; an fp16 overflow on any rank skips it on all."""
        scaler = self._model.loss_scaler
        clip = self._runtime.config.gradient_clipping
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        if clip is not None:
            self._model.clip_grad_norm_(clip)
        if scaler is None:
            return self.optimizer.step(closure)
        result = scaler.step(self.optimizer)
        scaler.update()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
