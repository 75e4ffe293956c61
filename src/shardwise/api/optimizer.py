"""`DistributedOptimizer`: the user's optimizer bound to the model that owns its parameters, stepped the way
that model's parallelism needs (ZeRO-1's share, loss scaling, clipping, the replica check)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from ..checkpoint.contents import as_held
from ..checkpoint.legacy import local_tensors
from ..checkpoint.save import save_checkpoint
from ..observe.recorder import recorder_for
from ..parallel.compose import ScalingRule, adopt_model_parameters
from ..runtime import preemption, step_limit
from ..runtime.init import warn_ineffective
from ..runtime.non_finite import NonFiniteCheck
from ..runtime.replica_check import check_replicas
from ..runtime.state import current

# SMP's `dynamic_loss_args` and their defaults (those of the Megatron/DeepSpeed scaler SMP's FP16_Optimizer uses).
DYNAMIC_LOSS_DEFAULTS = {"init_scale": 2.0 ** 32, "scale_factor": 2.0, "scale_window": 1000, "min_scale": 1.0,
                         "delayed_shift": 1, "consecutive_hysteresis": False}


def _owner(optimizer: torch.optim.Optimizer, models: list) -> Any:
    """The one DistributedModel that owns the optimizer's parameters: the model holding them, else (an optimizer
    built before the model) the one that replaced them. Holding is asked first: a model from an earlier build
    that is not yet collected may take a parameter made since, of the same shape, for one it replaced."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owners = ([model for model in models if model.holds_any(params)]
              or [model for model in models if model.replaced_any(params)])
    if not owners:
        raise ValueError("DistributedOptimizer: none of the optimizer's parameters belongs to a sw.DistributedModel; "
                         "create the DistributedModel first and build the optimizer from its parameters")
    if len(owners) > 1:
        raise ValueError(f"DistributedOptimizer: the optimizer's parameters belong to {len(owners)} "
                         "DistributedModels; give each model an optimizer of its own")
    return owners[0]


def _checked(key: str, value: Any, rule: str, holds: Callable[[float], bool], integer: bool = False,
             example: Any = None) -> Any:
    """`value` as a float (an int where `integer`), if it is a number for which `holds` is true."""
    number = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    if not number or not holds(value):
        example = DYNAMIC_LOSS_DEFAULTS.get(key, 128.0) if example is None else example
        raise ValueError(f"DistributedOptimizer: {key}={value!r} must be {rule}; fix: pass e.g. {key}={example!r}")
    return int(value) if integer else float(value)


def _dynamic_rule(args: dict[str, Any]) -> ScalingRule:
    """SMP's dynamic loss scaling as a `ScalingRule`: the scale grows by `scale_factor` after `scale_window`
    finite steps and is divided by it on an overflow, down to `min_scale`, once `delayed_shift` overflows."""
    unknown = sorted(set(args) - set(DYNAMIC_LOSS_DEFAULTS))
    if unknown:
        raise ValueError(f"DistributedOptimizer: unknown dynamic_loss_args key {unknown[0]!r}; fix: use only "
                         f"{', '.join(DYNAMIC_LOSS_DEFAULTS)}")
    args = {**DYNAMIC_LOSS_DEFAULTS, **args}
    if not isinstance(args["consecutive_hysteresis"], bool):
        raise TypeError(f"DistributedOptimizer: consecutive_hysteresis={args['consecutive_hysteresis']!r} must be "
                        "True or False")
    factor = _checked("scale_factor", args["scale_factor"], "a number > 1", lambda v: v > 1)
    return ScalingRule(init_scale=_checked("init_scale", args["init_scale"], "a number > 0", lambda v: v > 0),
                       growth_factor=factor, backoff_factor=1.0 / factor,
                       growth_interval=_checked("scale_window", args["scale_window"], "an integer >= 1",
                                                lambda v: v >= 1, integer=True),
                       min_scale=_checked("min_scale", args["min_scale"], "a number >= 0", lambda v: v >= 0),
                       hysteresis=_checked("delayed_shift", args["delayed_shift"], "an integer >= 1",
                                           lambda v: v >= 1, integer=True),
                       consecutive_hysteresis=args["consecutive_hysteresis"])


def _loss_scaling(static_loss_scale: Optional[float], dynamic_loss_scale: bool,
                  dynamic_loss_args: dict[str, Any]) -> tuple[Optional[ScalingRule], list[tuple[str, str]]]:
    """The rule SMP's arguments ask for (None: keep the model's) and the arguments that change nothing.

    SMP's defaults (a static scale of 1.0, i.e. none) keep shardwise's dynamic scaling instead."""
    if not isinstance(dynamic_loss_scale, bool):
        raise TypeError(f"DistributedOptimizer: dynamic_loss_scale={dynamic_loss_scale!r} must be True or False")
    static = (None if static_loss_scale is None
              else _checked("static_loss_scale", static_loss_scale, "a number > 0", lambda v: v > 0))
    if dynamic_loss_scale:
        ignored = [] if static in (None, 1.0) else [("static_loss_scale", "dynamic_loss_scale=True replaces it")]
        return _dynamic_rule(dynamic_loss_args), ignored
    _dynamic_rule(dynamic_loss_args)  # checked all the same: a typo should not wait for dynamic_loss_scale=True
    ignored = [("dynamic_loss_args", "needs dynamic_loss_scale=True")] if dynamic_loss_args else []
    if static in (None, 1.0):
        return None, ignored
    return ScalingRule(init_scale=static, static=True), ignored


def _given(static_loss_scale: Optional[float], dynamic_loss_scale: bool,
           dynamic_loss_args: dict[str, Any]) -> list[str]:
    """The loss-scale arguments given other values than SMP's defaults."""
    away = {"static_loss_scale": static_loss_scale not in (None, 1.0), "dynamic_loss_scale": dynamic_loss_scale,
            "dynamic_loss_args": bool(dynamic_loss_args)}
    return [name for name, changed in away.items() if changed]


def _configured_loss_scaling(config: Any) -> dict[str, Any]:
    """The config's `loss_scale` / `dynamic_loss_args` (DeepSpeed's fp16 section) as SMP's arguments."""
    if config.loss_scale:
        return {"static_loss_scale": config.loss_scale}
    if config.dynamic_loss_args is not None:
        return {"dynamic_loss_scale": True,
                "dynamic_loss_args": config.dynamic_loss_args.model_dump(exclude_none=True)}
    return {}


def _delegated(name: str) -> Callable[..., Any]:
    def call(self: DistributedOptimizer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.optimizer, name)(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"The wrapped optimizer's `{name}`: it is the one that steps and keeps the state."
    return call


class DistributedOptimizer(torch.optim.Optimizer):
    """Steps the wrapped optimizer the way its model's parallelism needs.

    It binds to the DistributedModel that owns its parameters. The optimizer may be
    built before that model, from the user's module, as SMP scripts do: its param
    groups get the model's parameters in place of those parallelizing replaced, and
    lose other pipeline stages' (parallel/param_mapping.py).

    It is a `torch.optim.Optimizer` over the wrapped one's own `param_groups`,
    `state` and `defaults` (the same objects, never copies), so learning-rate
    schedulers and anything else that edits the groups act on the optimizer that
    steps; hooks registered here go to it too. `torch.optim.Optimizer.__init__` is
    not called: it would build groups of its own.

    With ZeRO-1 the wrapped optimizer holds only this rank's share of the
    parameters (parallel/zero1/); `zero_grad` still clears every parameter's
    gradient. In bf16/fp16 that share is fp32 master copies of the half-precision
    parameters, and `state_dict` carries them too. `step` leaves the broadcasts of
    the updated parameters in flight for the next forward to wait on;
    `synchronize` waits for them all.

    SMP's loss-scale arguments configure the model's one loss scaler (`loss_scaler`,
    shared with `model.backward`), in fp16 only: `dynamic_loss_scale=True` scales
    dynamically by `dynamic_loss_args` (init_scale 2**32, scale_factor 2,
    scale_window 1000, min_scale 1, delayed_shift 1, consecutive_hysteresis False
    unless given, as a dict or as keywords); a `static_loss_scale` other than 1.0
    keeps that scale fixed (an overflow still skips its step on every rank). A
    script that leaves all three at SMP's defaults gets the config's `loss_scale`
    or `dynamic_loss_args` (DeepSpeed's fp16 section), as `sw.configured_optimizer`
    does; with neither, shardwise keeps torch's dynamic scaling.

    SMP's FP16_Optimizer members its scripts call: `clip_master_grads` (the next
    step clips), `overflow` (the last step was skipped) and `_global_grad_norm`.

    In fp32 and bf16, `non_finite_gradients` checks the gradients each step is about
    to use for inf/nan, and skips or stops (runtime/non_finite.py); `skipped_steps`
    counts the steps skipped for inf/nan, fp16's overflows included.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, static_loss_scale: Optional[float] = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: Optional[dict[str, Any]] = None,
                 **more_dynamic_loss_args: Any):
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("DistributedOptimizer: the optimizer is a DistributedOptimizer already; wrap the torch "
                            "optimizer once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        loss_args = {**(dynamic_loss_args or {}), **more_dynamic_loss_args}
        given = _given(static_loss_scale, dynamic_loss_scale, loss_args)
        runtime = current("shardwise.DistributedOptimizer")
        scaling = {"static_loss_scale": static_loss_scale, "dynamic_loss_scale": dynamic_loss_scale,
                   "dynamic_loss_args": loss_args}
        configured = _configured_loss_scaling(runtime.config)
        if not given:  # the config's fp16 loss scale (DeepSpeed's fp16 section), as sw.configured_optimizer's
            scaling.update(configured)
        rule, ignored = _loss_scaling(**scaling)
        if given and configured:
            key = "loss_scale" if runtime.config.loss_scale else "dynamic_loss_args"
            ignored.append((key, f"the script's DistributedOptimizer arguments ({', '.join(given)}) replace it"))
        self._runtime = runtime
        self._model = _owner(optimizer, list(runtime.models))
        # Built before the model, the optimizer holds the user's parameters: swap in the model's, before ZeRO-1
        # deals them out.
        adopt_model_parameters(optimizer, self._model.original_names,
                               dict(self._model.named_parameters(remove_duplicate=False)))
        scaler = self._model.loss_scaler
        if scaler is None:
            ignored = [(name, "needs fp16") for name in given]  # the config's keys: init named them
        elif rule is not None:
            scaler.configure(rule)  # before binding: a refused rule leaves the model as it was
        self._update = self._model.bind_optimizer(optimizer)
        self.optimizer = optimizer
        self.grad_norm: Optional[torch.Tensor] = None  # before clipping, from the last step that clipped
        self.steps = 0  # taken by `step`; every `replica_check_interval` of them, the replica check runs
        self._next_step_clip: Optional[float] = None  # `clip_master_grads`'s limit, for the next step only
        self._overflow = False
        self.skipped_steps = 0  # for inf/nan gradients: fp16 overflows, or non_finite_gradients: skip
        policy = runtime.config.non_finite_gradients
        self._non_finite = (NonFiniteCheck(optimizer, policy, runtime.config.non_finite_stop_after, runtime.device,
                                           self._name_of) if policy != "off" and scaler is None else None)
        warn_ineffective(ignored)
        runtime.optimizers.add(self)

    # The wrapped optimizer's own objects, so that whatever edits them (a scheduler setting `lr`) edits it.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    register_step_pre_hook = _delegated("register_step_pre_hook")
    register_step_post_hook = _delegated("register_step_post_hook")
    register_state_dict_pre_hook = _delegated("register_state_dict_pre_hook")
    register_state_dict_post_hook = _delegated("register_state_dict_post_hook")
    register_load_state_dict_pre_hook = _delegated("register_load_state_dict_pre_hook")
    register_load_state_dict_post_hook = _delegated("register_load_state_dict_post_hook")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("DistributedOptimizer.add_param_group: the model's parallelism placed the optimizer's "
                           "parameters when it was wrapped (ZeRO-1 shares, pipeline stages); add every param group "
                           "to the torch optimizer before wrapping it")

    def step(self, closure: Any = None) -> Any:
        """Unscale (fp16), clip, step; an fp16 overflow on any rank skips it on all (`overflow`). Clipping is
        by the global norm of every gradient of the model (kept in `grad_norm` for logs), to `gradient_clipping`,
        to a `clip_master_grads` limit given since the last step and to the optimizer's own
        `defaults["max_grad_norm"]` (LAMB's), since the optimizer itself sees only this rank's share under
        ZeRO-1 or a pipeline. Under ZeRO-1 each owner then starts broadcasting what it updated, and returns
        without waiting, unless the replica check is due (`replica_check_interval`)."""
        with recorder_for(self._runtime).optimizer_step(self._runtime, self):
            clip, self._next_step_clip = self._clip(), None
            checking = (contextlib.nullcontext() if self._non_finite is None
                        else self._non_finite.checking(self.steps + 1))
            with checking:
                result, norm = self._update.step(closure, clip)
            if norm is not None:
                self.grad_norm = norm
            self._overflow = ((self.loss_scaler is not None and self.loss_scaler.overflowed)
                              or (self._non_finite is not None and self._non_finite.skipped))
            self.skipped_steps += self._overflow
            self.steps += 1
            interval = self._runtime.config.replica_check_interval
            if interval is not None and self.steps % interval == 0:
                check_replicas(self._model.named_parameters(), self._runtime.mesh, self._runtime.device, self.steps)
        preemption.at_step_boundary(self._runtime, self.steps, lambda path, tag: save_checkpoint(
            path, tag, model=self._model, optimizer=self))
        step_limit.at_step_boundary(self.steps)
        return result

    def _name_of(self, stepped: torch.Tensor) -> str:
        """The model's name of a tensor the wrapped optimizer steps (ZeRO-1's fp32 master stands for one)."""
        param = {id(s): p for s, p in self._update.stepped_params()}.get(id(stepped), stepped)
        names = {id(p): name for name, p in self._model.named_parameters(remove_duplicate=False)}
        return names.get(id(param), "a parameter without a name")

    def _clip(self) -> Optional[float]:
        """The global-norm limit the step clips to, if any: the tightest of the config's, the optimizer's and
        `clip_master_grads`'s."""
        limits = (self._runtime.config.gradient_clipping, self.optimizer.defaults.get("max_grad_norm"),
                  self._next_step_clip)
        limits = [limit for limit in limits if limit]
        return min(limits) if limits else None

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> None:
        """SMP's FP16_Optimizer member: clip the gradients to a global norm of `max_norm`. `step` unscales
        and clips in one pass over the gradients, so this makes the next `step` (only) clip to `max_norm`, or
        tighter where `gradient_clipping` or the optimizer's `max_grad_norm` say so; the last call before a
        step counts. Returns None, not FP16_Optimizer's norm: the step takes it, into `_global_grad_norm`."""
        if norm_type != 2:
            raise ValueError(f"DistributedOptimizer.clip_master_grads: norm_type={norm_type!r} is not supported "
                             "(shardwise clips by the global L2 norm); fix: pass norm_type=2")
        self._next_step_clip = _checked("max_norm", max_norm, "a number > 0", lambda v: v > 0, example=1.0)

    @property
    def overflow(self) -> bool:
        """True when the last `step` was skipped because the fp16 gradients overflowed on some rank (as SMP's
        FP16_Optimizer says, for scripts that then skip their lr scheduler), or, in fp32 and bf16, because
        gradients held inf/nan under `non_finite_gradients: skip`."""
        return self._overflow

    @property
    def _global_grad_norm(self) -> Optional[torch.Tensor]:
        """SMP's name for `grad_norm`: the global gradient norm the last clipping step took before clipping
        (inf or nan if that step overflowed); None before any."""
        return self.grad_norm

    def synchronize(self) -> None:
        """Wait until every replica holds the parameters the last step updated (ZeRO-1). Forward waits for
        those each module uses; the next step, both state dicts and loads, and the model's `parameters()`,
        `named_parameters()` and state dicts wait for all. Call it before reading parameters any other way,
        e.g. through `model.get_module()` or a tensor kept from before the step."""
        self._update.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._update.zero_grad(set_to_none)

    @property
    def model(self) -> Any:
        """The DistributedModel whose parameters this optimizer steps."""
        return self._model

    @property
    def update(self) -> Any:
        """How this optimizer steps under its model's parallelism (parallel/strategy.py's OptimizerUpdate)."""
        return self._update

    @property
    def loss_scaler(self) -> Any:
        """The model's fp16 loss scaler (parallel/precision.py's LossScaler), shared with `model.backward`;
        None in fp32 and bf16."""
        return self._model.loss_scaler

    @property
    def loss_scale(self) -> float:
        """The loss scale the next backward multiplies by (1.0 without fp16)."""
        return 1.0 if self.loss_scaler is None else float(self.loss_scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state (this rank's share under ZeRO-1), with the fp32 masters in bf16/fp16."""
        self.synchronize()
        return self._update.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict()` or `local_state_dict()` of this optimizer on the same layout (plain pieces of
        sharded state are laid out as their parameters again)."""
        self.synchronize()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {index: {key: as_held(value, params[index]) if torch.is_tensor(value) else value
                         for key, value in entry.items()}
                 for index, entry in state_dict.get("state", {}).items()}
        self._update.load_state_dict({**state_dict, "state": state})

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state as plain tensors, for SMP's `sw.save(..., partial=True)`."""
        return local_tensors(self.state_dict())
