"""`apply_zero1`: the optimizer side of ZeRO-1, which the composition chooses for a replicated model.

Each optimizer bound to the model keeps only this rank's share of the param
groups (optimizer_state.py); in bf16/fp16 that share is fp32 masters of the
half-precision parameters (master_weights.py). `step` leaves the broadcasts of
the updated parameters in flight for the next forward to wait on
(parameter_broadcasts.py); `synchronize` waits for them all.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..sharding.optimizer_offload import HostOffload
from ..strategy import OptimizerBinding, OptimizerUpdate, Strategy
from .master_weights import MasterWeights
from .optimizer_state import OptimizerStateSharding
from .parameter_broadcasts import ParameterBroadcasts

MASTERS_KEY = "fp32_master_params"  # in `state_dict()` under ZeRO-1 in bf16/fp16: this rank's masters, in order


class Zero1Update(OptimizerUpdate):
    """A DistributedOptimizer's step under ZeRO-1: its share stepped here, then broadcast to the replicas."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Strategy, scaler: Optional[torch.amp.GradScaler],
                 device: torch.device, *, group: dist.ProcessGroup, masters: bool, tp_rank: int,
                 passes: Optional[int], deferred: frozenset[int], offload: Optional[HostOffload],
                 accumulate_locally: bool = False):
        super().__init__(optimizer, strategy, scaler, device)
        self.sharding = OptimizerStateSharding(optimizer, group)
        self.broadcasts = (ParameterBroadcasts(self.sharding.owner_of, group, strategy.module)
                           if dist.get_world_size(group) > 1 else None)
        # Gradients travel to the owners during every backward pass (with local accumulation, the step's last
        # microbatch's); under a pipeline, during its last microbatch's, the tied weights' once the schedule has
        # summed them (`after_backward_passes`).
        self.masters = (MasterWeights(optimizer, self.sharding, tp_rank, passes=passes, deferred=deferred,
                                      offload=offload, accumulate_locally=accumulate_locally,
                                      syncing=lambda: strategy.gradient_sync)
                        if masters else None)
        self._pipelined = passes is not None

    def step(self, closure: Any, clip: Optional[float]) -> tuple[Any, Optional[torch.Tensor]]:
        self.synchronize()
        result, norm = self._step_masters(closure, clip) if self.masters is not None else super().step(closure, clip)
        self._start_broadcasts()
        return result, norm

    def _step_masters(self, closure: Any, clip: Optional[float]) -> tuple[Any, Optional[torch.Tensor]]:
        """The owners' fp32 masters, whose gradients backward has reduced into them, are unscaled, clipped and
        stepped, then rounded back into this rank's parameters."""
        masters = self.masters
        masters.hand_over_gradients()
        masters.adopt_changed_parameters()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = None if clip is None else masters.clip_grad_norm_(clip, self.device, self.strategy.tied_copies())
        result = self.scaled_step(closure)
        masters.write_back()
        return result, norm

    def _start_broadcasts(self) -> None:
        if self.broadcasts is not None:
            self.broadcasts.start()

    def zero_grad(self, set_to_none: bool) -> None:
        super().zero_grad(set_to_none)
        self.strategy.inner.zero_grad(set_to_none=set_to_none)  # the optimizer only knows its own share
        if self.masters is not None:
            self.masters.discard_gradients()

    def synchronize(self) -> None:
        if self.broadcasts is not None:
            self.broadcasts.wait_all()

    def after_backward_passes(self) -> None:
        if self.masters is not None and self._pipelined:
            self.masters.buckets.end_round()

    def local_gradient(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        return None if self.masters is None else self.masters.buckets.local_sum(param)

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        state = super().state_dict()
        if self.masters is not None:
            state[MASTERS_KEY] = self.masters.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.synchronize()
        state = dict(state)
        masters = state.pop(MASTERS_KEY, None)
        super().load_state_dict(state)
        if masters is not None and self.masters is not None:
            self.masters.load_state_dict(masters)
            self._start_broadcasts()


    def stepped_params(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.masters is None:
            return super().stepped_params()
        param_of = self.masters.param_of
        return [(p, param_of.get(id(p), p)) for group in self.optimizer.param_groups for p in group["params"]]

    def master_values(self) -> dict[nn.Parameter, torch.Tensor]:
        return {} if self.masters is None else dict(self.masters.masters)

    def masters_elsewhere(self) -> set[nn.Parameter]:
        if self.masters is None:
            return set()
        me = dist.get_rank()
        return {p for p, owner in self.sharding.owner_of.items() if owner != me and p.requires_grad}

    def load_master_values(self, values: Mapping[nn.Parameter, torch.Tensor]) -> None:
        self.synchronize()
        if self.masters is not None:
            self.masters.load_values(values)


def apply_zero1(group: dist.ProcessGroup, *, masters: bool, tp_rank: int, passes: Optional[int] = None,
                deferred: frozenset[int] = frozenset(), offload: Optional[HostOffload] = None,
                accumulate_locally: bool = False) -> OptimizerBinding:
    """How optimizers bind under ZeRO-1 over the replicas `group`; `masters`: bf16/fp16's fp32 masters (in host
    memory with `offload`). `passes`, `deferred`: a pipeline's microbatches per step and its weights tied across
    stages. `accumulate_locally`: the masters' gradients add up in fp32 on each rank and travel once a step."""
    return functools.partial(Zero1Update, group=group, masters=masters, tp_rank=tp_rank, passes=passes,
                             deferred=deferred, offload=offload, accumulate_locally=accumulate_locally)
