"""`deepspeed.ops.adam`: DeepSpeed's Adam classes as torch's Adam, with DeepSpeed's arguments and defaults.

DeepSpeed's fused GPU kernel and its C++ CPU kernel compute Adam's update; torch's own (foreach or fused)
implementation computes the same update here, on any device. `adam_w_mode` (default True) decouples
weight decay as AdamW does; False adds it to the gradient (L2), as DeepSpeed's kernels do.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's `FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
    set_grad_none)` on torch's Adam (`decoupled_weight_decay=adam_w_mode`)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        if not bias_correction:
            raise ValueError(f"{type(self).__name__}(bias_correction=False): torch's Adam always corrects the "
                             "moments' bias; pass bias_correction=True")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode)


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's `DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)`: the same update; where the optimizer state lives is the config's
    `offload_optimizer` (`offload_optimizer_state`), not the class's."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adamw_mode, weight_decay=weight_decay, amsgrad=amsgrad)
