"""Mixed precision: low-precision compute, fp32 master weights and fp32 gradient reduction.

Which mode a model gets is decided once, in `config/decisions.py`
(`precision_mode`): FSDP2's per-module casting for sharded and `replicate`d models
(the bf16/fp16 copies are what gets gathered, halving traffic); autocast around
forward for DDP and a lone replica, which keep fp32 parameters; ZeRO-1's replicas
stored in the compute dtype, computing as FSDP2 does (`store_in_compute_dtype`),
with fp32 masters of each rank's share kept by the optimizer (zero1/master_weights.py).
Pure bf16 stores every wrapping's parameters in bf16 the same way, with no masters:
gradients, their reduction and the optimizer's states follow the stored dtype.
fp16 adds loss scaling whose overflow check agrees across every rank: torch's
dynamic rule, or the one SMP's DistributedOptimizer arguments ask for (`ScalingRule`).
"""

from __future__ import annotations

import gc
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..torch_internals import grad_scaler_state, tree_map_only, unscale_and_check_
from .local import local_tensor


def sharded_policy(dtype: Optional[torch.dtype], root: bool) -> MixedPrecisionPolicy:
    """FSDP2 policy computing in `dtype` (None: as stored); the root returns fp32 outputs so the user's loss
    is computed in full precision."""
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


@torch.no_grad()
def store_in_compute_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """ZeRO-1 in bf16/fp16: keep `module`'s parameters in the compute dtype and compute in it as FSDP2's
    policy does for ZeRO-2/3 (floating inputs cast to it, outputs returned in fp32 for the loss), so every
    sharding mode does the same arithmetic.

    The cast values are swapped into the existing Parameter objects, so every reference
    stays valid (tied weights, a pipeline's tie map; tensor-parallel DTensors stay
    DTensors). `swap_tensors` refuses a tensor something else still holds, and a
    finished collective's work can hold one from a reference cycle until the garbage
    collector runs: collect first. Buffers keep their dtype: rotary frequencies would
    lose accuracy in bf16.
    """
    gc.collect()
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            torch.utils.swap_tensors(param, nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad))
    module.register_forward_pre_hook(lambda _, args, kwargs: _cast_floating((args, kwargs), dtype), with_kwargs=True)
    module.register_forward_hook(lambda _, args, output: in_fp32(output))


def in_fp32(outputs: Any) -> Any:
    """Floating tensors of `outputs` in fp32: the user's loss sees full-precision logits in every mode."""
    return _cast_floating(outputs, torch.float32)


def autocast(dtype: torch.dtype, device: torch.device) -> ContextManager:
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass(frozen=True)
class ScalingRule:
    """How the fp16 loss scale moves. torch's GradScaler rule (grow by `growth_factor` after `growth_interval`
    finite steps, back off by `backoff_factor` on an overflow), plus what SMP's DistributedOptimizer adds
    from DeepSpeed's scaler: a floor (`min_scale`), `hysteresis` overflows absorbed before backing off (given
    back when the scale grows, or after every finite step with `consecutive_hysteresis`), and a `static`
    scale that never moves (an overflow still skips its step)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 0.0
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    static: bool = False

    @property
    def beyond_torch(self) -> bool:
        """True when torch's own update rule is not the whole rule."""
        return self.static or self.min_scale > 0 or self.hysteresis > 1


class LossScaler(ShardedGradScaler):
    """FSDP's scaler (inf/nan found on any rank skips the step on all) following a `ScalingRule`, unscaling
    each gradient through its local tensor: tensor parallelism mixes DTensor gradients with the plain ones
    of replicated norms, which one foreach call cannot take, and the overflow flag is all-reduced over every
    rank anyway."""

    def __init__(self, device: str, process_group: Optional[dist.ProcessGroup], rule: ScalingRule = ScalingRule(),
                 enabled: bool = True):
        super().__init__(device, init_scale=rule.init_scale, backoff_factor=rule.backoff_factor,
                         growth_factor=rule.growth_factor, growth_interval=rule.growth_interval, enabled=enabled,
                         process_group=process_group)
        self.rule = rule
        self._hysteresis_left = rule.hysteresis
        self._configured = False
        self.overflowed = False  # whether the steps the last `update` concluded were skipped for an inf/nan
        self._flags: dict[torch.device, torch.Tensor] = {}  # the last unscale's overflow flags, one per device

    def configure(self, rule: ScalingRule) -> None:
        """Follow `rule` from its initial scale on. A model has one loss scale, shared by its backward and
        every optimizer of it: the same rule again changes nothing, another is refused."""
        if self._configured:
            if rule != self.rule:
                raise ValueError(f"this model's loss scale already follows {self.rule}, set by another optimizer; "
                                 "pass the same loss-scale arguments to every DistributedOptimizer of one model")
            return
        self._configured = True
        self.load_state_dict({**grad_scaler_state(rule.init_scale, rule.growth_factor, rule.backoff_factor,
                                                  rule.growth_interval),
                              "rule": asdict(rule), "hysteresis_left": rule.hysteresis})

    def update(self, new_scale: Optional[float | torch.Tensor] = None) -> None:
        """torch's update, then the rule's floor, hysteresis or static scale on top of it. torch backs off
        exactly when a step overflowed (its backoff factor is below 1), which is how `overflowed` is told."""
        if not self.is_enabled() or new_scale is not None:
            super().update(new_scale)
            return
        before = self.get_scale()
        super().update()
        after, rule = self.get_scale(), self.rule
        self.overflowed = after < before
        if not rule.beyond_torch:
            return
        if rule.static:
            kept = before
        elif self.overflowed:
            if self._hysteresis_left > 1:  # absorbed: one fewer left before the scale backs off
                self._hysteresis_left -= 1
                kept = before
            else:
                kept = max(after, rule.min_scale)
        else:
            if rule.consecutive_hysteresis or after > before:
                self._hysteresis_left = rule.hysteresis
            return
        if kept != after:
            super().update(float(kept))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state:
            state.update(rule=asdict(self.rule), hysteresis_left=self._hysteresis_left)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's state, and the rule with its hysteresis where the state has them (a checkpoint's do)."""
        super().load_state_dict(state_dict)
        if self.is_enabled() and "rule" in state_dict:
            self.rule = ScalingRule(**state_dict["rule"])
            self._hysteresis_left = state_dict["hysteresis_left"]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's unscale, each overflow flag then put back to 0 or 1: torch sums them over the ranks, and a fused
        optimizer's step (AdamW(fused=True), the Hugging Face Trainer's default) skips only on exactly 1."""
        self._flags = {}
        super().unscale_(optimizer)
        for flag in self._flags.values():
            flag.clamp_(max=1.0)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    local = local_tensor(param.grad)
                    grads[local.device, local.dtype].append(local)
        # 0-dim flags, as torch's GradScaler makes them: a fused optimizer's step subtracts the flag from its 0-dim
        # step counts and takes no other shape
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), tensors in grads.items():
                flag = found.setdefault(device, found_inf.to(device, copy=True).reshape(()))
                unscale_and_check_(tensors, flag, inv_scale.to(device))
        self._flags = found or {self._scale.device: found_inf.to(self._scale.device, copy=True).reshape(())}
        return self._flags
