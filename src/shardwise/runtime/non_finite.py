"""The check of non-finite gradients at `optimizer.step()`, for fp32 and bf16 (fp16's loss scaler has its own).

A nan or inf loss, or an overflow in backward, leaves inf/nan gradients; stepped,
they turn every parameter they reach into nan and training goes on, silently
lost. The check runs as the wrapped optimizer's step pre-hook, so it sees the
gradients the optimizer is about to use (unscaled, clipped, ZeRO-1's masters),
and every rank decides the same:

- when the step clipped, the global norm clipping took is already agreed by every
  rank: inf/nan in it is the verdict, at no extra cost;
- otherwise each rank takes the max-abs of its local gradients and one scalar
  all-reduce over the world agrees.

A bad step is skipped by dropping the optimizer's gradients (it leaves parameters
and state alone) or, per `non_finite_gradients`, stops every rank with one line
naming the step and the first parameter whose gradient went non-finite.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..parallel.clipping import recording_norms
from ..parallel.local import local_tensor


class NonFiniteGradientError(RuntimeError):
    """Gradients held inf or nan at an optimizer step and the config says to stop."""


class NonFiniteGradientWarning(UserWarning):
    """An optimizer step was skipped for inf/nan gradients (non_finite_gradients: skip)."""


def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _first_non_finite(params: list[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """The first of `params` whose local gradient holds inf or nan (max-abs propagates nan)."""
    if not params:
        return None
    peaks = torch.stack([torch.linalg.vector_norm(local_tensor(p.grad), math.inf).to(device, torch.float32)
                         for p in params])
    bad = torch.nonzero(~torch.isfinite(peaks)).flatten()
    return params[int(bad[0])] if len(bad) else None


class NonFiniteCheck:
    """Skips or stops a step whose gradients hold inf/nan, for one optimizer, identically on every rank.

    `name_of`: the model's name of an optimizer parameter (ZeRO-1 steps fp32 masters in their place), asked
    only once a step went bad. `stop_after`: consecutive bad steps that stop the run under policy "stop";
    the ones before it are skipped."""

    def __init__(self, optimizer: torch.optim.Optimizer, policy: str, stop_after: int, device: torch.device,
                 name_of: Callable[[torch.Tensor], str]):
        self.policy, self.stop_after, self.device, self.name_of = policy, stop_after, device, name_of
        self.in_a_row = 0
        self.skipped = False  # whether the last step was skipped
        self._step: Optional[int] = None
        self._norms: list[torch.Tensor] = []
        optimizer.register_step_pre_hook(self._before_step)

    @contextlib.contextmanager
    def checking(self, step: int) -> Iterator[None]:
        """Around DistributedOptimizer step number `step`: the norms clipping takes inside are the verdict."""
        self._step, self.skipped = step, False
        try:
            with recording_norms() as self._norms:
                yield
        finally:
            self._step = None

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._step is None:
            return
        params = _gradients(optimizer)
        if not self._is_bad(params):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        found = self._describe(params)
        if self.policy == "stop" and self.in_a_row >= self.stop_after:
            run = f" in {self.in_a_row} steps in a row" if self.in_a_row > 1 else ""
            raise NonFiniteGradientError(
                f"{found}{run}; training stopped (non_finite_gradients: stop, non_finite_stop_after: "
                f"{self.stop_after}); fix: lower the learning rate, clip gradients (gradient_clipping), check this "
                "step's data, or set non_finite_gradients: skip")
        for param in params:
            param.grad = None  # the optimizer leaves parameters without a gradient, and their state, alone
        self.skipped = True
        if dist.get_rank() == 0:
            warnings.warn(f"{found}; step skipped", NonFiniteGradientWarning, stacklevel=2)

    def _is_bad(self, params: list[torch.Tensor]) -> bool:
        if self._norms:
            return not all(math.isfinite(float(norm)) for norm in self._norms)
        flag = torch.tensor([_first_non_finite(params, self.device) is not None], dtype=torch.int32,
                            device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _describe(self, params: list[torch.Tensor]) -> str:
        """The step and the lowest rank's first non-finite gradient, the same on every rank."""
        first = _first_non_finite(params, self.device)
        names: list[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(names, None if first is None else self.name_of(first))
        where = next((f"first in '{name}' on rank {rank}" for rank, name in enumerate(names) if name is not None),
                     "their global norm overflowed")
        return f"optimizer step {self._step}: inf/nan gradients ({where})"
