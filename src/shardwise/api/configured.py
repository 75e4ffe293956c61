"""What a DeepSpeed config's `optimizer`, `scheduler` and batch keys ask for, built when the script asks.

    model = sw.DistributedModel(build_model())
    optimizer = sw.configured_optimizer(model)          # a DistributedOptimizer
    scheduler = sw.configured_scheduler(optimizer)      # torch LRScheduler, stepped once per optimizer step
    loader = sw.data_loader(dataset, batch_size=sw.configured_batch_size())

The optimizers are torch.optim's with DeepSpeed's defaults (its `Adam` decouples
weight decay, as DeepSpeed's FusedAdam does unless `adam_w_mode` is false), and
`Lamb` is DeepSpeed's rule on shardwise.optimizers' FusedLamb (`DeepSpeedLamb`). The
schedules are `torch.optim.lr_scheduler.LRScheduler`s computing DeepSpeed's
formulas, from the same step count: DeepSpeed's iteration is torch's
`last_epoch - 1`, so the learning rate after k `step()` calls is DeepSpeed's.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Iterable, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..config.blocks import OptimizerBlock, SchedulerBlock
from ..optimizers import FusedLamb, _widened, _write_back, whole_norms
from ..runtime.state import current
from ..torch_internals import foreach
from .optimizer import DistributedOptimizer

__all__ = ["configured_batch_size", "configured_optimizer", "configured_scheduler", "DeepSpeedLamb", "OneCycle",
           "WarmupDecayLR", "WarmupLR"]

# DeepSpeed's defaults, where torch's differ (torch's AdamW decays weights by 0.01, DeepSpeed's by 0).
_OPTIMIZER_DEFAULTS = {"Adam": {"lr": 1e-3, "weight_decay": 0.0}, "AdamW": {"lr": 1e-3, "weight_decay": 0.0}}
# What only DeepSpeed's kernels read: its choice between its fused Adam and torch's (torch's here), CPU Adam's state
# dtype (fp32 here), and the bias correction torch's Adam always makes (validation refuses false).
_DEEPSPEED_ONLY = ("torch_adam", "fp32_optimizer_states", "bias_correction", "adam_w_mode")


def _torch_optimizer(block: OptimizerBlock, params: Iterable[Any]) -> torch.optim.Optimizer:
    """The optimizer `block` names, as DeepSpeed builds it without its CUDA kernels: Adam decouples weight decay
    (torch's AdamW) unless `adam_w_mode` is false (torch's Adam, decay added to the gradient), as DeepSpeed's
    FusedAdam does, with its default decay 0 (0.01 with `torch_adam`, torch's AdamW's own default, which is what
    DeepSpeed then builds); Lamb is DeepSpeedLamb; SGD and Adagrad are torch's, as DeepSpeed builds them."""
    if block.type == "Lamb":
        return DeepSpeedLamb(params, **block.params)
    if block.type in ("SGD", "Adagrad"):
        return getattr(torch.optim, block.type)(params, **block.params)
    args = {**_OPTIMIZER_DEFAULTS[block.type], **block.params}
    decoupled = args.get("adam_w_mode", True) or block.type == "AdamW"
    if args.get("torch_adam") and decoupled and "weight_decay" not in block.params:
        args["weight_decay"] = 0.01  # with torch_adam DeepSpeed builds torch's AdamW, whose default this is
    for name in _DEEPSPEED_ONLY:
        args.pop(name, None)
    return (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, **args)


class DeepSpeedLamb(FusedLamb):
    """DeepSpeed's `Lamb` (its FusedLamb's CUDA kernel, `fused_lamb_cuda_kernel.cu`) on FusedLamb's foreach
    machinery, so it runs on any device and on sharded (DTensor) parameters: with Adam's raw moments m and v,
    update = m / (sqrt(v) + eps) + weight_decay × p (eps inside the root with `eps_inside_sqrt`); each tensor moves
    by lr × sqrt(1 - beta2^t) / (1 - beta1^t) × clamp(‖p‖ / ‖update‖, min_coeff, max_coeff) × update (the ratio 1
    where either norm is 0; without `bias_correction` the step is lr). apex's rule (FusedLamb) corrects the moments
    inside the update, applies the ratio only with weight decay, and clamps nothing."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False):
        if amsgrad:
            raise RuntimeError("DeepSpeed's Lamb does not support the AMSGrad variant; fix: pass amsgrad=False")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        eps_inside_sqrt=eps_inside_sqrt, max_coeff=max_coeff, min_coeff=min_coeff,
                        max_grad_norm=0.0)  # FusedLamb.step's global clip: off, as DeepSpeed's default 0.0 has it
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.set_grad_none = True

    def _step_alike(self, group: dict[str, Any], params: list[torch.Tensor], step: int, divisor: float) -> None:
        beta1, beta2 = group["betas"]
        states = [self._state(p) for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        values, grads = _widened(params), _widened([p.grad for p in params])
        foreach.mul_(exp_avgs, beta1)
        foreach.add_(exp_avgs, grads, alpha=1 - beta1)
        foreach.mul_(exp_avg_sqs, beta2)
        foreach.addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        if group["eps_inside_sqrt"]:
            denominators = foreach.add(exp_avg_sqs, group["eps"])
            foreach.sqrt_(denominators)
        else:
            denominators = foreach.sqrt(exp_avg_sqs)
            foreach.add_(denominators, group["eps"])
        updates = foreach.div(exp_avgs, denominators)
        if group["weight_decay"]:
            foreach.add_(updates, values, alpha=group["weight_decay"])
        step_size = group["lr"]
        if group["bias_correction"]:  # the kernel corrects the step, not the moments
            step_size *= math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        param_norms, update_norms = whole_norms(values), whole_norms(updates)
        ratios = (param_norms / update_norms).clamp(group["min_coeff"], group["max_coeff"])
        ratios = torch.where((param_norms != 0) & (update_norms != 0), ratios, 1.0)
        foreach.mul_(updates, (step_size * ratios).tolist())
        foreach.sub_(values, updates)
        _write_back(params, values)


def _config(name: str):
    """The runtime's config, with a one-line error naming the key when the block is missing."""
    return current(f"shardwise.{name}").config


def configured_optimizer(model_or_params: Union[torch.nn.Module, Iterable[Any]]) -> DistributedOptimizer:
    """The config's `optimizer` over a DistributedModel's parameters (or given ones), wrapped in a
    DistributedOptimizer (which takes the config's fp16 loss scaling, `loss_scale` or `dynamic_loss_args`)."""
    config = _config("configured_optimizer")
    if config.optimizer is None:
        raise ValueError("sw.configured_optimizer: the config has no optimizer block; fix: add e.g. "
                         '"optimizer": {"type": "AdamW", "params": {"lr": 0.001}} to the config')
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    return DistributedOptimizer(_torch_optimizer(config.optimizer, params))


def configured_scheduler(optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The config's `scheduler` on `optimizer`; call its `step()` after every optimizer step, as DeepSpeed does."""
    config = _config("configured_scheduler")
    if config.scheduler is None:
        raise ValueError("sw.configured_scheduler: the config has no scheduler block; fix: add e.g. "
                         '"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}} to the config')
    return build_scheduler(config.scheduler, optimizer)


def build_scheduler(block: SchedulerBlock, optimizer: torch.optim.Optimizer) -> LRScheduler:
    params = dict(block.params)
    start = params.pop("last_batch_iteration", -1)
    schedule = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "OneCycle": OneCycle}[block.type]
    return schedule(optimizer, **params, last_epoch=start)


def configured_batch_size() -> int:
    """Each data-parallel rank's @step batch: train_micro_batch_size_per_gpu x microbatches (`init` worked out
    the one of DeepSpeed's batch triple left unset)."""
    config = _config("configured_batch_size")
    if config.train_micro_batch_size_per_gpu is None:
        raise ValueError("sw.configured_batch_size: the config sets neither train_batch_size nor "
                         "train_micro_batch_size_per_gpu; fix: set one of them")
    return config.train_micro_batch_size_per_gpu * config.microbatches


class _DeepSpeedSchedule(LRScheduler, metaclass=abc.ABCMeta):
    """A schedule of absolute learning rates at DeepSpeed's iteration (`last_epoch - 1`: torch's constructor
    takes the first step, DeepSpeed's does not); each schedule says its rate by `lr_at`."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_epoch: int = -1):
        for group in optimizer.param_groups:  # torch's resume (last_epoch >= 0) asks for it; these rates are absolute
            group.setdefault("initial_lr", group["lr"])
        super().__init__(optimizer, last_epoch)

    @property
    def iteration(self) -> int:
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.iteration)] * len(self.optimizer.param_groups)

    @abc.abstractmethod
    def lr_at(self, iteration: int) -> float:
        """The learning rate at DeepSpeed's `iteration`."""


class WarmupLR(_DeepSpeedSchedule):
    """DeepSpeed's WarmupLR: from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then
    warmup_max_lr. Unset, warmup_max_lr is the optimizer's learning rate."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1):
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"scheduler warmup_type={warmup_type!r} must be 'log' or 'linear'")
        self.min_lr = warmup_min_lr
        self.max_lr = optimizer.param_groups[0]["lr"] if warmup_max_lr is None else warmup_max_lr
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(iteration + 1) / math.log(self.warmup_num_steps)
            return iteration / self.warmup_num_steps
        return 1.0

    def lr_at(self, iteration: int) -> float:
        return self.min_lr + (self.max_lr - self.min_lr) * self.gamma(max(iteration, 0))


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR's warm-up, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_epoch: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super().gamma(iteration)
        return max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class OneCycle(_DeepSpeedSchedule):
    """DeepSpeed's OneCycle: a triangle from cycle_min_lr up to cycle_max_lr and back, then cycle_min_lr divided by
    (1 + decay_lr_rate x decay steps / decay_step_size); with an optimizer that has `betas`, the first beta
    cycles inversely between cycle_max_mom and cycle_min_mom (the second is 0.99, as DeepSpeed sets it).
    DeepSpeed's stair counts change nothing in DeepSpeed's own schedule either."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000, cycle_second_step_size: int = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                 decay_mom_rate: float = 0.0, last_epoch: int = -1):
        second = cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size
        self.total_size = float(cycle_first_step_size + second)
        self.step_ratio = cycle_first_step_size / self.total_size
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.decay_step_size = decay_step_size
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        super().__init__(optimizer, last_epoch)

    def _scale(self, iteration: int) -> float:
        x = (iteration + 1) / self.total_size
        x -= math.floor(x)
        return x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)

    def _decay(self, iteration: int, rate: float) -> float:
        if not self.decay_step_size or not rate:
            return 1.0
        return 1 + rate * (iteration - self.total_size + 1) / self.decay_step_size

    def lr_at(self, iteration: int) -> float:
        if iteration < 0:
            return self.min_lr
        if iteration < self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self._scale(iteration)
        return self.min_lr / self._decay(iteration, self.decay_lr_rate)

    def momentum_at(self, iteration: int) -> float:
        if iteration < 0:
            return self.min_mom
        if iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale(iteration)
        return self.max_mom * self._decay(iteration, self.decay_mom_rate)

    def get_lr(self) -> list[float]:
        if self.cycle_momentum:  # DeepSpeed moves the momentum with the learning rate, in the same call
            for group in self.optimizer.param_groups:
                group["betas"] = (self.momentum_at(self.iteration), 0.99)
        return super().get_lr()
