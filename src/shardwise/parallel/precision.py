"""Mixed precision: low-precision compute, fp32 master weights and fp32 gradient reduction.

Sharded models get FSDP2's per-module casting (the bf16/fp16 copies are what
gets gathered, halving traffic); replicated models use autocast. fp16 adds
dynamic loss scaling whose overflow check agrees across every rank.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..config.schema import ShardwiseConfig


def compute_dtype(config: ShardwiseConfig) -> Optional[torch.dtype]:
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


def sharded_policy(config: ShardwiseConfig, root: bool) -> MixedPrecisionPolicy:
    """FSDP2 policy; the root returns fp32 outputs so the user's loss is computed in full precision."""
    dtype = compute_dtype(config)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def autocast(config: ShardwiseConfig, device: torch.device) -> ContextManager:
    dtype = compute_dtype(config)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def loss_scaler(config: ShardwiseConfig, device: torch.device) -> Optional[ShardedGradScaler]:
    """Dynamic loss scaling for fp16; inf/nan found on any rank skips the step on all ranks."""
    if not config.fp16:
        return None
    return ShardedGradScaler(device=device.type, process_group=dist.group.WORLD)
