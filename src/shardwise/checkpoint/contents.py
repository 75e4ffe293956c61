"""What a checkpoint holds, as one nested dict whose names are those of the user's unparallelised module.

    {"model":     {parameter or buffer name: tensor},
     "optimizer": {"state": {parameter name: {"exp_avg": tensor, "step": tensor, ...}},
                   "groups": {"0": {"lr": ..., "betas": ...}, ...}},
     "meta":      {"steps": ..., "loss_scaler": ..., "loaders": {...}, ...},
     "rng":       {"rank0": {...}, "rank1": {...}, ...}}

Tensors stay as each rank holds them: DTensors where sharded (ZeRO-2/3, MiCS) or
split (tensor parallelism), so torch.distributed.checkpoint records their global
shape and any layout can load them. A rank writes only what it holds: a pipeline
stage its own layers, a ZeRO-1 owner the optimizer state (and, in bf16/fp16, the
exact fp32 value) of its share; copies every rank holds alike are written once.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..parallel.strategy import OptimizerUpdate
from ..torch_internals import strided

MODEL, OPTIMIZER, META, RNG = "model", "optimizer", "meta", "rng"


def numbered(items: list) -> dict[str, Any]:
    """A list as a dict keyed "0", "1", ...: DCP flattens dicts but stores lists of dicts opaquely."""
    return {str(index): item for index, item in enumerate(items)}


def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter (tied weights have several), by the parameter's id."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def as_held(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A plain local piece of a DTensor parameter's shape, as a DTensor laid out like it (so it reshards on
    load); anything else unchanged."""
    if (isinstance(param, DTensor) and not isinstance(value, DTensor) and value.dim() > 0
            and value.shape == param.to_local().shape):
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


def stored(value: torch.Tensor) -> torch.Tensor:
    """A tensor as DCP can record it: a strided DTensor (packed Q/K/V) whole, since DCP cannot map its pieces."""
    return value.full_tensor() if strided(value) else value


def target_like(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty target for a stored value of `like`'s shape: laid out as `like`, or whole where it is strided."""
    if strided(like):
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    return torch.empty_like(like, dtype=dtype)


def held_as(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A loaded value laid out as `like` again (a whole tensor cut locally into a strided DTensor's piece)."""
    if strided(like) and not isinstance(value, DTensor):
        return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    return value


def model_state(model: Any, updates: list[OptimizerUpdate]) -> dict[str, torch.Tensor]:
    """The model's entries: as held, with a ZeRO-1 owner's fp32 masters in place of the rounded bf16/fp16
    parameters (and the parameters it does not own left to their owners)."""
    state = model.sharded_state_dict()
    names = parameter_names(model.get_module())
    for update in updates:
        for param, master in update.master_values().items():
            for name in names.get(id(param), []):
                state[name] = as_held(master, param)
        for param in update.masters_elsewhere():
            for name in names.get(id(param), []):
                state.pop(name, None)
    return {name: stored(value) for name, value in state.items()}


def optimizer_state(update: OptimizerUpdate, names: dict[int, list[str]]) -> dict[str, Any]:
    """The optimizer's state by parameter name (this rank's share under ZeRO-1) and its groups' settings."""
    state = {}
    for stepped, param in update.stepped_params():
        entry = update.optimizer.state.get(stepped)
        if entry and id(param) in names:
            values = {key: stored(as_held(value, param)) if torch.is_tensor(value) else value
                      for key, value in entry.items()}
            for name in names[id(param)]:  # under every name of a tied weight: a pipeline holds it under one
                state[name] = values
    groups = [{key: value for key, value in group.items() if key != "params"}
              for group in update.optimizer.param_groups]
    return {"state": state, "groups": numbered(groups)}


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's random number generators: torch's, the device's, Python's and NumPy's."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device.type).get_rng_state(device)
    numpy = _numpy()
    if numpy is not None:
        name, keys, position, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = (name, keys.tolist(), int(position), int(has_gauss), float(cached))
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    if "device" in state and device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state["device"], device)
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        name, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), position, has_gauss, cached))


def _as_tuples(value: Any) -> Any:
    """Python's RNG state with its tuples back (a round trip may have made them lists)."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _numpy() -> Optional[Any]:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def subjects(runtime: Any, model: Any, optimizer: Any) -> tuple[Any, Any]:
    """The model a checkpoint call means (the only live one when not given) and its optimizer (if any)."""
    if model is None:
        models = list(runtime.models)
        if len(models) != 1:
            raise ValueError(f"{len(models)} DistributedModels are live; pass model= (and optimizer=) to say which "
                             "one the checkpoint is of" if models else "no sw.DistributedModel exists yet; "
                             "create the model (and its optimizer) before saving or resuming")
        model = models[0]
    if optimizer is None:
        bound = [opt for opt in runtime.optimizers if opt.model is model]
        if len(bound) > 1:
            raise ValueError(f"{len(bound)} DistributedOptimizers step this model; pass optimizer= to say which one")
        optimizer = bound[0] if bound else None
    elif optimizer.model is not model:
        raise ValueError("the optimizer passed steps another DistributedModel than the one being checkpointed")
    return model, optimizer


def training_state(runtime: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    """Everything a checkpoint holds for `model` and `optimizer`, as this rank holds it."""
    if optimizer is not None:
        optimizer.synchronize()
    model.wait_for_parameters()
    updates = [optimizer.update] if optimizer is not None else []
    state: dict[str, Any] = {MODEL: model_state(model, updates)}
    if optimizer is not None:
        state[OPTIMIZER] = optimizer_state(optimizer.update, parameter_names(model.get_module()))
    scaler = model.loss_scaler
    state[META] = {"steps": optimizer.steps if optimizer is not None else 0,
                   "loss_scaler": scaler.state_dict() if scaler is not None else None,
                   "loaders": numbered(runtime.loader_states())}
    state[RNG] = {f"rank{runtime.rank}": rng_state(runtime.device)}
    return state
