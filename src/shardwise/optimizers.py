"""SMP's `smp.optimizers`: apex's FusedLamb and FusedNovoGrad as plain `torch.optim.Optimizer`s.

torch has neither LAMB nor NovoGrad, and apex's need its CUDA extension. These
follow apex's update rules (its `multi_tensor_lamb` and `multi_tensor_novograd`
kernels) with torch's foreach ops, on any device, and on DTensor parameters
(FSDP2 shards, tensor-parallel pieces): the norms both rules take are of whole
tensors, reduced over the mesh by DTensor's own ops, so a sharded model steps as
an unsharded one would. Arithmetic and optimizer state are in fp32 at least (as in
apex's kernels) whatever the parameters' dtype.

The step count stays in `group["step"]`, where apex keeps it. NovoGrad's blended
gradient norms, which apex keeps in its param groups too, live per parameter in
`state[p]["exp_avg_sq"]` (a 0-dim tensor), so checkpoints name them by parameter.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor

from .torch_internals import foreach

__all__ = ["FusedLamb", "FusedNovoGrad"]


def _computing(dtype: torch.dtype) -> torch.dtype:
    """The dtype the arithmetic runs in: fp32, or the parameters' own if wider."""
    return torch.promote_types(dtype, torch.float32)


def _alike(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` split into lists of one dtype and one layout: foreach ops refuse to mix DTensors with plain
    tensors or with DTensors of other placements."""
    lists: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        layout = (param.device_mesh, param.placements) if isinstance(param, DTensor) else None
        lists.setdefault((layout, param.dtype), []).append(param)
    return list(lists.values())


def whole_norms(tensors: list[torch.Tensor], ord: float = 2.0) -> torch.Tensor:
    """The norm of each whole tensor of `tensors` (of one dtype and layout), as one plain 1-D tensor. DTensor
    norms come back partial (each rank's piece); one reduction over the mesh completes them all."""
    norms = torch.stack(foreach.norm(tensors, ord, dtype=_computing(tensors[0].dtype)))
    return norms.full_tensor() if isinstance(norms, DTensor) else norms


def _widened(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` in the dtype the arithmetic runs in: the tensors themselves where they are in it already
    (writes then land in them)."""
    return [t.to(_computing(t.dtype)) for t in tensors]


def _write_back(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Round widened working copies back into half-precision parameters (others were updated in place)."""
    for param, value in zip(params, values):
        if value is not param:
            param.copy_(value)


def _with_grads(group: dict[str, Any], name: str) -> list[torch.Tensor]:
    params = [p for p in group["params"] if p.grad is not None]
    if any(p.grad.is_sparse for p in params):
        raise RuntimeError(f"{name} does not support sparse gradients; fix: use torch.optim.SparseAdam for "
                           "sparse parameters")
    return params


def _next_step(group: dict[str, Any]) -> int:
    """Count a step of `group`: apex counts per group, whether or not each parameter had a gradient."""
    group["step"] = group.get("step", 0) + 1
    return group["step"]


class _ApexOptimizer(torch.optim.Optimizer):
    """What apex's fused optimizers share: `set_grad_none` as zero_grad's default, and a closure's loss."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], set_grad_none: bool):
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """As torch's, by default as `set_grad_none` says."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    @staticmethod
    def _loss_of(closure: Optional[Callable[[], Any]]) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


class FusedLamb(_ApexOptimizer):
    """LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes") with
    apex's `FusedLAMB` arguments, defaults and update rule.

    Gradients are divided by global-norm / `max_grad_norm` when their global norm (over
    every parameter of the optimizer) exceeds it; Adam's moments give the update
    (`adam_w_mode`: decoupled weight decay added to the update, else L2 added to the
    gradient); each parameter then moves by lr × ‖p‖/‖update‖ × update (the trust
    ratio, only where weight_decay ≠ 0 unless `use_nvlamb`; lr alone where either norm
    is 0). `max_grad_norm` of 0 or None turns the global clip off (apex would zero
    every update); `adam_w_mode` and `use_nvlamb` may differ per param group. Under
    `sw.DistributedOptimizer`, which clips by the norm of the whole model first, this
    optimizer's clip finds nothing left to do.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: Optional[float] = 1.0, use_nvlamb: bool = False):
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant; fix: pass amsgrad=False")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm, adam_w_mode=adam_w_mode,
                        use_nvlamb=use_nvlamb)
        super().__init__(params, defaults, set_grad_none)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = self._loss_of(closure)
        groups = [(group, _with_grads(group, type(self).__name__)) for group in self.param_groups]
        divisor = self._clip_divisor([p.grad for _, params in groups for p in params])
        for group, params in groups:
            step = _next_step(group)
            for alike in _alike(params):
                self._step_alike(group, alike, step, divisor)
        return loss

    def _clip_divisor(self, grads: list[torch.Tensor]) -> float:
        """What every gradient is divided by: global norm / max_grad_norm where the norm exceeds it, else 1."""
        limit = self.defaults["max_grad_norm"]
        if not limit or not grads:
            return 1.0
        squares = sum(float(whole_norms(alike).square().sum()) for alike in _alike(grads))
        norm = math.sqrt(squares)
        return norm / limit if norm > limit else 1.0

    def _step_alike(self, group: dict[str, Any], params: list[torch.Tensor], step: int, divisor: float) -> None:
        beta1, beta2 = group["betas"]
        decay, lr = group["weight_decay"], group["lr"]
        corrected = group["bias_correction"]
        correction1, correction2 = (1 - beta1 ** step, 1 - beta2 ** step) if corrected else (1.0, 1.0)
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        states = [self._state(p) for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        values = _widened(params)
        grads = foreach.div(_widened([p.grad for p in params]), divisor)  # new tensors: grads stay as they are
        if decay and not group["adam_w_mode"]:
            foreach.add_(grads, values, alpha=decay)  # L2: weight decay joins the gradient
        foreach.mul_(exp_avgs, beta1)
        foreach.add_(exp_avgs, grads, alpha=beta3)
        foreach.mul_(exp_avg_sqs, beta2)
        foreach.addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        updates = foreach.div(exp_avgs, correction1)
        denominators = foreach.div(exp_avg_sqs, correction2)
        foreach.sqrt_(denominators)
        foreach.add_(denominators, group["eps"])
        foreach.div_(updates, denominators)
        if decay and group["adam_w_mode"]:
            foreach.add_(updates, values, alpha=decay)
        ratios = [lr] * len(params)
        if decay or group["use_nvlamb"]:  # the trust ratio: each parameter's norm over its update's
            param_norms, update_norms = whole_norms(values), whole_norms(updates)
            trusted = (param_norms != 0) & (update_norms != 0)
            ratios = torch.where(trusted, lr * (param_norms / update_norms), lr).tolist()
        foreach.mul_(updates, ratios)
        foreach.sub_(values, updates)
        _write_back(params, values)

    def _state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["exp_avg"] = torch.zeros_like(param, dtype=_computing(param.dtype))
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=_computing(param.dtype))
        return state


class FusedNovoGrad(_ApexOptimizer):
    """NovoGrad (Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive Moments") with apex's
    `FusedNovoGrad` arguments, defaults and update rule.

    Each parameter keeps one second moment: a running blend of its gradient's norm
    (`norm_type` 2: sqrt(β2·v² + (1-β2)·‖g‖²); 0, the max norm: β2·v + (1-β2)·‖g‖∞),
    started at 0 (`init_zero`) or at the first gradient's norm. The gradient divided by
    v/√(1-β2ᵗ) + eps feeds the first moment; weight decay joins inside it
    (`reg_inside_moment`) or the update after it.
    """

    NORM_TYPES = {2: 2.0, 0: math.inf}  # apex's norm_type: 2 the L2 norm, 0 the max norm

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant; fix: pass amsgrad=False")
        if norm_type not in self.NORM_TYPES:
            raise ValueError(f"FusedNovoGrad: norm_type={norm_type!r} is not supported; fix: pass 2 (L2 norm) or "
                             "0 (max norm)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero,
                        reg_inside_moment=reg_inside_moment)
        super().__init__(params, defaults, set_grad_none)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = self._loss_of(closure)
        for group in self.param_groups:
            params = _with_grads(group, type(self).__name__)
            step = _next_step(group)
            for alike in _alike(params):
                self._step_alike(group, alike, step)
        return loss

    def _step_alike(self, group: dict[str, Any], params: list[torch.Tensor], step: int) -> None:
        beta1, beta2 = group["betas"]
        decay, lr = group["weight_decay"], group["lr"]
        corrected = group["bias_correction"]
        correction1, correction2 = (1 - beta1 ** step, math.sqrt(1 - beta2 ** step)) if corrected else (1.0, 1.0)
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        grads = _widened([p.grad for p in params])
        norms = whole_norms(grads, self.NORM_TYPES[group["norm_type"]])
        blended = self._blend(group, params, norms, beta2)
        denominators = (blended / correction2 + group["eps"]).tolist()
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        values = _widened(params)
        inside = group["reg_inside_moment"]  # the paper's form: normalise and decay before the moment
        if inside:
            grads = foreach.div(grads, denominators)
            if decay:
                foreach.add_(grads, values, alpha=decay)
        foreach.mul_(exp_avgs, beta1)
        foreach.add_(exp_avgs, grads, alpha=beta3)
        updates = foreach.div(exp_avgs, correction1)
        if not inside:
            foreach.div_(updates, denominators)
            if decay:
                foreach.add_(updates, values, alpha=decay)
        foreach.add_(values, updates, alpha=-lr)
        _write_back(params, values)

    def _blend(self, group: dict[str, Any], params: list[torch.Tensor], norms: torch.Tensor,
               beta2: float) -> torch.Tensor:
        """Each parameter's second moment blended with its gradient's norm this step, kept in its state."""
        seen = []
        for param, norm in zip(params, norms):
            state = self.state[param]
            if not state:
                state["exp_avg"] = torch.zeros_like(param, dtype=_computing(param.dtype))
                # From the first norm, the first blend leaves it as it is.
                state["exp_avg_sq"] = torch.zeros_like(norm) if group["init_zero"] else norm.clone()
            seen.append(state["exp_avg_sq"])
        previous = torch.stack(seen)
        if group["norm_type"] == 2:
            blended = (beta2 * previous.square() + (1 - beta2) * norms.square()).sqrt()
        else:
            blended = beta2 * previous + (1 - beta2) * norms
        foreach.copy_(seen, list(blended.unbind()))
        return blended
