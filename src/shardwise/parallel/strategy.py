"""The protocol every parallel wrapping answers, so the API layer never asks which one it has.

`parallelize` returns one `Strategy` per model: data parallelism (replicated or
sharded, `sharding.py`) or a pipeline with either per stage (`pipeline/runner.py`);
ZeRO-1 is the optimizer side of a replicated one (`zero1/`). `DistributedModel`,
`DistributedOptimizer` and `@step` call only what is here: run a step's
microbatches, control gradient sync per microbatch, clip, gather whole tensors
and load them back, bind an optimizer, wait for parameter updates in flight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from .clipping import clip_grad_norm_
from .precision import in_fp32
from .tensor import loss_context

Pieces = list[tuple[tuple, dict]]  # a @step call's (args, kwargs) per microbatch


class _NotHere:
    """A step result this rank does not receive (under a pipeline, a non-scalar tensor off pp rank 0 and the last
    stage)."""

    def __repr__(self) -> str:
        return "NOT_HERE"


NOT_HERE = _NotHere()


class OptimizerUpdate:
    """How one optimizer steps under its model's strategy: unscale (fp16), clip, step. ZeRO-1 has its own."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: "Strategy",
                 scaler: Optional[torch.amp.GradScaler], device: torch.device):
        self.optimizer, self.strategy, self.scaler, self.device = optimizer, strategy, scaler, device

    def step(self, closure: Any, clip: Optional[float]) -> tuple[Any, Optional[torch.Tensor]]:
        """(the optimizer's result, the gradient norm before clipping or None)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = None if clip is None else self.strategy.clip_grad_norm_(clip, self.device)
        return self.scaled_step(closure), norm

    def scaled_step(self, closure: Any) -> Any:
        """The wrapped step; in fp16 skipped on every rank when any found an overflow."""
        if self.scaler is None:
            return self.optimizer.step(closure)
        result = self.scaler.step(self.optimizer)
        self.scaler.update()
        return result

    def zero_grad(self, set_to_none: bool) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Wait for parameter updates still in flight (none here)."""

    def after_backward_passes(self) -> None:
        """Once a pipeline's @step has run every backward pass (ZeRO-1 in bf16/fp16 sends what is left)."""

    def local_gradient(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """What stands for `param`'s gradient on this rank in place of `param.grad` until the step's backward
        passes end (ZeRO-1's fp32 sum of a tied weight accumulated locally), or None."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def stepped_params(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(the tensor the optimizer steps, the model parameter it stands for) for each of its parameters, so a
        checkpoint names optimizer state by parameter name."""
        return [(p, p) for group in self.optimizer.param_groups for p in group["params"]]

    def master_values(self) -> dict[nn.Parameter, torch.Tensor]:
        """Parameters whose exact (fp32) value lives apart from them on this rank, and that value."""
        return {}

    def masters_elsewhere(self) -> set[nn.Parameter]:
        """Parameters whose exact value lives on another rank (its owner writes it to a checkpoint)."""
        return set()

    def load_master_values(self, values: Mapping[nn.Parameter, torch.Tensor]) -> None:
        """Exact values of every parameter `master_values` or `masters_elsewhere` names: into the parameters
        (rounded) and this rank's masters."""


OptimizerBinding = Callable[[torch.optim.Optimizer, "Strategy", Optional[torch.amp.GradScaler], torch.device],
                            OptimizerUpdate]


class Strategy(ABC):
    """One model's parallel wrapping, complete when built.

    `module` is what forward calls, `inner` the user's module with the names they
    wrote (under a pipeline reduced to this rank's stages). `autocast` is the
    context forward runs under (None: as stored); `binding` makes each optimizer's
    update (ZeRO-1's when the composition chose it). Implementations say how
    gradients are synchronised per microbatch; the rest has a default here.
    """

    # A strategy that runs the whole @step itself (a pipeline schedule) takes no other model in the step.
    runs_whole_step = False

    def __init__(self, module: nn.Module, inner: nn.Module, *, autocast: Optional[Callable[[], ContextManager]] = None,
                 binding: Optional[OptimizerBinding] = None):
        self.module = module
        self.inner = inner
        self.autocast = autocast
        self.binding: OptimizerBinding = binding or OptimizerUpdate
        self.holds_loss = True
        # False inside a microbatch whose gradients are not synchronised (microbatch_context sets it where the
        # optimizer reduces gradients itself: ZeRO-1's local accumulation reads it).
        self.gradient_sync = True
        self._updates: list[OptimizerUpdate] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast is None:
            return self.module(*args, **kwargs)
        with self.autocast():
            return in_fp32(self.module(*args, **kwargs))  # as FSDP2's policy and ZeRO-1's replicas return

    @abstractmethod
    def microbatch_context(self, last: bool) -> ContextManager:
        """Around one microbatch's forward, loss and backward; gradients are synchronised on the `last`.
        Implementations enter `self.loss_context()` too."""

    def loss_context(self) -> ContextManager:
        return loss_context(self.inner)  # vocabulary-parallel logits need forward, loss and backward under it

    def settled(self) -> "Strategy":
        """The strategy to use from now on: itself, or what a first @step built (the module-graph pipeline)."""
        return self

    def stage_modules(self) -> Optional[list[nn.Module]]:
        """The modules a pipeline schedule calls on this rank (its stages), or None where the model itself runs."""
        return None

    @property
    def reduces_in_forward(self) -> bool:
        """Gradient reduction is armed by the wrapper's forward (DDP): a forward of the module itself skips it."""
        return False

    def join(self, divide_by_initial_world_size: bool, enable: bool) -> Optional[ContextManager]:
        """DDP's `join` for replicas with uneven numbers of batches; None where the replicas are no DDP."""
        return None

    def register_comm_hook(self, state: object, hook: Callable) -> bool:
        """DDP's communication hook on each gradient bucket; False (nothing registered) where there is no DDP."""
        return False

    def run_step(self, model: nn.Module, fn: Callable, pieces: Pieces, around: Callable[[int], ContextManager],
                 counted: Callable[[int], ContextManager]) -> list[Any]:
        """Run `fn` once per microbatch of a @step call on `model`, each under `around(index)`; the results.
        `around` includes `counted(index)`, which alone says which microbatch of how many runs (what backward
        divides by): a schedule that runs the microbatches itself enters only that."""
        outputs = []
        for index, (args, kwargs) in enumerate(pieces):
            with around(index):
                outputs.append(fn(*args, **kwargs))
        return outputs

    def clip_grad_norm_(self, max_norm: float, device: torch.device) -> torch.Tensor:
        """Clip by the norm over every shard of every gradient; returns the norm before clipping."""
        return clip_grad_norm_(self.inner.parameters(), max_norm, device)

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers as they are held (DTensors where sharded or split), named as in
        the user's module; under a pipeline only this rank's stages. Loading in place into these loads the model."""
        return get_model_state_dict(self.inner)

    def load_sharded_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a `sharded_state_dict` (or part of one) into this rank's pieces."""
        set_model_state_dict(self.inner, dict(state), options=StateDictOptions(strict=False))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer as a whole tensor, named as in the user's module."""
        return get_model_state_dict(self.inner, options=StateDictOptions(full_state_dict=True))

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load whole tensors, as `full_state_dict` gives them on every rank, into this rank's pieces."""
        set_model_state_dict(self.inner, self.held(state),
                             options=StateDictOptions(full_state_dict=True, strict=strict))

    def held(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of a whole-model state dict that this rank holds (all but under a pipeline)."""
        return dict(state)

    def bind(self, optimizer: torch.optim.Optimizer, scaler: Optional[torch.amp.GradScaler],
             device: torch.device) -> OptimizerUpdate:
        """The update of an optimizer over this model's parameters."""
        update = self.binding(optimizer, self, scaler, device)
        self._updates.append(update)
        return update

    def wait_for_parameters(self) -> None:
        """Wait for parameter updates still in flight (ZeRO-1 overlaps them with the next forward)."""
        for update in self._updates:
            update.synchronize()

    def tied_copies(self) -> set[int]:
        """ids of parameters that copy a weight held elsewhere too: a global norm skips them."""
        return set()

    def after_backward_passes(self) -> None:
        """Called by a pipeline once its @step's backward passes are all done and tied weights summed."""
        for update in self._updates:
            update.after_backward_passes()

    def local_gradient(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """`param`'s gradient where an optimizer's update holds it in place of `param.grad` (OptimizerUpdate's)."""
        return next((g for g in (u.local_gradient(param) for u in self._updates) if g is not None), None)
