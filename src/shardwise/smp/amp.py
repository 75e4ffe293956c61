"""SMP's `smp.amp`: a gradient scaler for torch's automatic mixed precision that works with shardwise models.

    scaler = sw.amp.GradScaler()

    @sw.step
    def train_step(model, inputs, targets):
        with torch.autocast(device_type, dtype=torch.float16):
            loss = loss_fn(model(inputs), targets)
        model.backward(scaler.scale(loss))
        return loss

    train_step(model, inputs, targets)
    scaler.step(optimizer)   # a sw.DistributedOptimizer
    scaler.update()
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.precision import LossScaler, ScalingRule
from ..runtime.init import warn_ineffective
from ..runtime.state import current

__all__ = ["GradScaler"]


class GradScaler(LossScaler):
    """`torch.amp.GradScaler` for sharded and split gradients: it unscales DTensor shards and tensor-parallel
    pieces through their local tensors, and an inf/nan on any rank skips the step on every rank.

    Arguments are SMP's (those of `torch.cuda.amp.GradScaler`); the scale lives on the
    device `shardwise.init` chose unless `device` says otherwise. With `fp16` in the
    config, the model already scales its loss in `model.backward` and unscales it in
    the optimizer's step, so this scaler stands aside (scales by 1, steps straight
    through) rather than scaling twice.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, device: str | None = None):
        runtime = current("shardwise.amp.GradScaler")
        if enabled and runtime.config.fp16:
            warn_ineffective([("shardwise.amp.GradScaler", "fp16 in the config scales the loss in model.backward "
                                                           "already; this scaler steps straight through")])
            enabled = False
        rule = ScalingRule(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                           growth_interval=growth_interval)
        super().__init__(device or runtime.device.type, dist.group.WORLD, rule, enabled=enabled)
        # The scale exists from the start on every rank, also on pipeline stages that never scale a loss
        # but step and agree on overflows all the same.
        self.scale(torch.zeros((), device=device or runtime.device))
