"""Mixed precision: low-precision compute, fp32 master weights and fp32 gradient reduction.

Which mode a model gets is decided once, in `topology/decisions.py`
(`precision_mode`): FSDP2's per-module casting for sharded and `replicate`d models
(the bf16/fp16 copies are what gets gathered, halving traffic); autocast around
forward for DDP and a lone replica, which keep fp32 parameters; ZeRO-1's replicas
stored in the compute dtype, computing as FSDP2 does (`store_in_compute_dtype`),
with fp32 masters of each rank's share kept by the optimizer (zero1/master_weights.py).
fp16 adds dynamic loss scaling whose overflow check agrees across every rank.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from typing import Any, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..config.schema import ShardwiseConfig
from ..torch_internals import tree_map_only, unscale_and_check_
from .local import local_tensor


def compute_dtype(config: ShardwiseConfig) -> Optional[torch.dtype]:
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


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


class LossScaler(ShardedGradScaler):
    """FSDP's scaler (inf/nan found on any rank skips the step on all), unscaling each gradient through its
    local tensor: tensor parallelism mixes DTensor gradients with the plain ones of replicated norms, which
    one foreach call cannot take, and the overflow flag is all-reduced over every rank anyway."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    local = local_tensor(param.grad)
                    grads[local.device, local.dtype].append(local)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), tensors in grads.items():
                flag = found.setdefault(device, found_inf.to(device, copy=True))
                unscale_and_check_(tensors, flag, inv_scale.to(device))
        return found or {self._scale.device: found_inf.to(self._scale.device, copy=True)}


def loss_scaler(config: ShardwiseConfig, device: torch.device) -> Optional[LossScaler]:
    """Dynamic loss scaling for fp16."""
    if not config.fp16:
        return None
    return LossScaler(device=device.type, process_group=dist.group.WORLD)
