"""`DistributedOptimizer`: the user's optimizer, sharded for ZeRO-1, with loss scaling and clipping in `step`."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..parallel.optimizer_state import OptimizerStateSharding
from ..runtime.state import current


class DistributedOptimizer:
    """Steps the wrapped optimizer the way the configured parallelism needs.

    With ZeRO-1 the wrapped optimizer holds only this rank's share of the
    parameters (see parallel/optimizer_state.py); `zero_grad` still clears every
    parameter's gradient.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        runtime = current("shardwise.DistributedOptimizer")
        if runtime.model is None:
            raise RuntimeError("create sw.DistributedModel(...) before sw.DistributedOptimizer(...), and build the "
                               "optimizer from model.parameters()")
        self._runtime = runtime
        self._model = runtime.model
        self._sharding: Optional[OptimizerStateSharding] = None
        if runtime.config.effective_zero_stage == 1 and runtime.mesh["rdp"].size() > 1:
            self._sharding = OptimizerStateSharding(optimizer, runtime.mesh["rdp"].get_group())
        self.optimizer = optimizer

    def step(self, closure: Any = None) -> Any:
        """Unscale (fp16), clip (`gradient_clipping`), step; an fp16 overflow on any rank skips it on all."""
        scaler = self._model.loss_scaler
        clip = self._runtime.config.gradient_clipping
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            self._unscale_unowned(scaler)
        if clip is not None:
            self._model.clip_grad_norm_(clip)
        if scaler is None:
            result = self.optimizer.step(closure)
        else:
            result = scaler.step(self.optimizer)
            scaler.update()
        if self._sharding is not None:
            self._sharding.broadcast_parameters()
        return result

    @torch.no_grad()
    def _unscale_unowned(self, scaler: Any) -> None:
        """With ZeRO-1 the scaler only unscales this rank's share; clipping takes the norm over every
        gradient, so unscale the others too (an inf among them is found by its owner and skips the step)."""
        if self._sharding is None:
            return
        owned = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        inverse = 1.0 / scaler.get_scale()
        for param in self._sharding.owner_of:
            if id(param) not in owned and param.grad is not None:
                param.grad.mul_(inverse)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._sharding is not None:  # the optimizer only knows its own share
            self._model.get_module().zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
