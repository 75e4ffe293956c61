"""`DistributedOptimizer`: the user's optimizer, sharded for ZeRO-1, with loss scaling and clipping in `step`."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..parallel.master_weights import MasterWeights
from ..parallel.optimizer_state import OptimizerStateSharding
from ..parallel.parameter_broadcasts import ParameterBroadcasts
from ..runtime.replica_check import check_replicas
from ..runtime.state import current
from .param_mapping import adopt_model_parameters

MASTERS_KEY = "fp32_master_params"  # in `state_dict()` under ZeRO-1 in bf16/fp16: this rank's masters, in order


class DistributedOptimizer:
    """Steps the wrapped optimizer the way the configured parallelism needs.

    The optimizer may be built before `DistributedModel`, from the user's module, as
    SMP scripts do: its param groups get the model's parameters in place of those
    parallelizing replaced, and lose other pipeline stages' (api/param_mapping.py).

    With ZeRO-1 the wrapped optimizer holds only this rank's share of the
    parameters (see parallel/optimizer_state.py); `zero_grad` still clears every
    parameter's gradient. In bf16/fp16 that share is fp32 master copies of the
    half-precision parameters (parallel/master_weights.py), and `state_dict`
    carries them too. `step` leaves the broadcasts of the updated parameters in
    flight for the next forward to wait on (parallel/parameter_broadcasts.py);
    `synchronize` waits for them all.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        runtime = current("shardwise.DistributedOptimizer")
        if runtime.model is None:
            raise RuntimeError("create sw.DistributedModel(...) before sw.DistributedOptimizer(...)")
        self._runtime = runtime
        self._model = runtime.model
        # Built before the model, the optimizer holds the user's parameters: swap in the model's, before ZeRO-1
        # deals them out.
        adopt_model_parameters(optimizer, self._model.original_names,
                               dict(self._model.named_parameters(remove_duplicate=False)))
        self._sharding: Optional[OptimizerStateSharding] = None
        self._masters: Optional[MasterWeights] = None
        self._broadcasts: Optional[ParameterBroadcasts] = None
        self.grad_norm: Optional[torch.Tensor] = None  # before clipping, from the last step that clipped
        self.steps = 0  # taken by `step`; every `replica_check_interval` of them, the replica check runs
        config, replicas = runtime.config, runtime.mesh["rdp"]
        if config.effective_zero_stage == 1 and (replicas.size() > 1 or config.sharded_master_weights):
            self._sharding = OptimizerStateSharding(optimizer, replicas.get_group())
            if replicas.size() > 1:
                self._broadcasts = ParameterBroadcasts(self._sharding.owner_of, replicas.get_group(),
                                                       self._model.module)
                self._model.synchronize_parameters = self.synchronize
        if config.sharded_master_weights:
            self._masters = self._master_weights(optimizer)
        self.optimizer = optimizer

    def _master_weights(self, optimizer: torch.optim.Optimizer) -> MasterWeights:
        """ZeRO-1 in bf16/fp16. Gradients travel to the owners during every backward pass. A pipeline schedule
        runs a pass per microbatch: there each gradient travels during its last microbatch's pass, and the
        rest once the schedule has summed the weights tied across stages."""
        tp_rank = self._runtime.mesh["tp"].get_local_rank()
        if self._runtime.config.pipeline_parallel_degree == 1:
            return MasterWeights(optimizer, self._sharding, tp_rank)
        masters = MasterWeights(optimizer, self._sharding, tp_rank, passes=self._runtime.config.microbatches,
                                deferred=frozenset(self._model.tied_across_stages()))
        self._model.after_pipeline_step = masters.buckets.end_round
        return masters

    def step(self, closure: Any = None) -> Any:
        """Unscale (fp16), clip (`gradient_clipping`, keeping the global norm in `grad_norm` for logs), step;
        an fp16 overflow on any rank skips it on all. Under ZeRO-1 each owner then starts broadcasting what it
        updated, and returns without waiting, unless the replica check is due (`replica_check_interval`)."""
        self.synchronize()
        result = self._step_masters(closure) if self._masters is not None else self._step_replicas(closure)
        self._start_broadcasts()
        self.steps += 1
        interval = self._runtime.config.replica_check_interval
        if interval is not None and self.steps % interval == 0:
            self.synchronize()
            check_replicas(self._model.named_parameters(), self._runtime.mesh, self._runtime.device, self.steps)
        return result

    def synchronize(self) -> None:
        """Wait until every replica holds the parameters the last step updated (ZeRO-1). Forward waits for
        those each module uses; the next step, both state dicts and loads, and the model's `parameters()`,
        `named_parameters()` and state dicts wait for all. Call it before reading parameters any other way,
        e.g. through `model.get_module()` or a tensor kept from before the step."""
        if self._broadcasts is not None:
            self._broadcasts.wait_all()

    def _start_broadcasts(self) -> None:
        if self._broadcasts is not None:
            self._broadcasts.start()

    def _step_replicas(self, closure: Any) -> Any:
        """DDP, and ZeRO-1 in fp32: every replica holds the same gradients of its fp32 parameters."""
        scaler = self._model.loss_scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        clip = self._runtime.config.gradient_clipping
        if clip is not None:
            self.grad_norm = self._model.clip_grad_norm_(clip)
        return self._step_wrapped(closure)

    def _step_masters(self, closure: Any) -> Any:
        """ZeRO-1 in bf16/fp16: the owners' fp32 masters, whose gradients backward has reduced into them, are
        unscaled, clipped and stepped, then rounded back into this rank's parameters."""
        masters = self._masters
        masters.drop_absent_gradients()
        masters.adopt_changed_parameters()
        if self._model.loss_scaler is not None:
            self._model.loss_scaler.unscale_(self.optimizer)
        clip = self._runtime.config.gradient_clipping
        if clip is not None:
            self.grad_norm = masters.clip_grad_norm_(clip, self._runtime.device, self._model.tied_copies())
        result = self._step_wrapped(closure)
        masters.write_back()
        return result

    def _step_wrapped(self, closure: Any) -> Any:
        scaler = self._model.loss_scaler
        if scaler is None:
            return self.optimizer.step(closure)
        result = scaler.step(self.optimizer)
        scaler.update()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._sharding is not None:  # the optimizer only knows its own share
            self._model.get_module().zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state (this rank's share under ZeRO-1), with the fp32 masters in bf16/fp16."""
        self.synchronize()
        state = self.optimizer.state_dict()
        if self._masters is not None:
            state[MASTERS_KEY] = self._masters.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.synchronize()
        state = dict(state_dict)
        masters = state.pop(MASTERS_KEY, None)
        self.optimizer.load_state_dict(state)
        if masters is not None and self._masters is not None:
            self._masters.load_state_dict(masters)
            self._start_broadcasts()
