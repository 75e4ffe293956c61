"""`resume_from_checkpoint`: SMP's call; any layout reads any partial checkpoint.

Before reading anything, every rank checks the files it was dealt against the
manifest's checksums and the checkpoint's names and shapes against its model,
and the ranks agree on the outcome; then each rank allocates its own pieces
(DTensors where it holds shards) and DCP fills them from whichever files hold
them, so the world size, sharding, tensor and pipeline degrees may all differ
from the run that saved.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..runtime.state import Runtime, current
from ..torch_internals import strided
from .contents import META, MODEL, OPTIMIZER, RNG, held_as, parameter_names, restore_rng_state, subjects, target_like
from .coordination import agree, checkpoint_group
from .directory import USER_CONTENT, CheckpointError, read_manifest, resolve
from .sources import FullSource, PartialSource, Stored, put, under
from .storage import plain_data_globals, verify


def resume_from_checkpoint(path: str, tag: Optional[str] = None, partial: bool = True, strict: bool = True,
                           load_optimizer: bool = True, load_sharded_optimizer_state: bool = True,
                           translate_function: Optional[Callable[[dict], dict]] = None,
                           trusted_user_content: bool = False, model: Any = None, optimizer: Any = None,
                           restore_positions: bool = True) -> Any:
    """Load the checkpoint `path/tag` (the newest complete one when `tag` is None) into the DistributedModel
    and DistributedOptimizer, and return the `user_content` it was saved with.

    Called by every rank, after the model and optimizer exist and before the next step. `strict` as in
    `load_state_dict`. `load_optimizer=False` loads the weights only (fine-tuning: no optimizer state, step
    counter, loss scale, data positions or RNG states). Optimizer state always reshards, so
    `load_sharded_optimizer_state` is accepted for SMP scripts and changes nothing. `translate_function`
    maps a full checkpoint's model state dict to this model's names before loading (`partial=False` only).
    `trusted_user_content=True` unpickles a `user_content` holding arbitrary objects (it runs code).
    `model` and `optimizer` say which ones to load when several DistributedModels are live.
    `restore_positions=False` leaves the data loaders' positions and the RNG streams as the script set them
    (DeepSpeed's `load_checkpoint` restores neither, and its scripts skip batches themselves)."""
    runtime = current("shardwise.resume_from_checkpoint")
    runtime.wait_for_pending_save()
    model, optimizer = subjects(runtime, model, optimizer)
    if translate_function is not None and partial:
        raise ValueError("translate_function applies to full checkpoints: pass partial=False with it")
    group = checkpoint_group(runtime)
    directory = agree(group, lambda: _checked(Path(path), tag, partial, group))
    source = agree(group, lambda: PartialSource(directory, group) if partial else FullSource(directory))
    if translate_function is not None:
        source.nested[MODEL] = translate_function(dict(source.nested[MODEL]))
        source.entries = {**{p: s for p, s in source.entries.items() if p[0] != MODEL},
                          **{(MODEL, name): Stored(t.shape, t.dtype) for name, t in source.nested[MODEL].items()}}
    load_optimizer = load_optimizer and optimizer is not None
    plan = agree(group, lambda: _Plan(runtime, model, optimizer if load_optimizer else None, source.entries, strict,
                                      restore_positions))
    plan.apply(source.read(plan.targets))
    content = agree(group, lambda: _user_content(directory, trusted_user_content))
    dist.barrier(group=group)
    return content


def _checked(root: Path, tag: Optional[str], partial: bool, group: dist.ProcessGroup) -> Path:
    """The checkpoint's directory, after this rank's share of its files passed their checksums."""
    directory = resolve(root, tag)
    manifest = read_manifest(directory)
    if manifest["partial"] != partial:
        saved = "partial (sharded)" if manifest["partial"] else "full"
        raise CheckpointError(f"{directory} is a {saved} checkpoint; pass partial={manifest['partial']}")
    files = sorted(manifest["checksums"])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    verify(directory, {name: manifest["checksums"][name] for name in files[rank::world]})
    return directory


def _user_content(directory: Path, trusted: bool) -> Any:
    file = directory / USER_CONTENT
    if not file.is_file():
        raise CheckpointError(f"{file} is missing from the checkpoint")
    try:
        with torch.serialization.safe_globals(plain_data_globals(file)):
            return torch.load(file, map_location="cpu", weights_only=not trusted)
    except Exception as error:
        raise CheckpointError(f"{file} holds objects weights-only loading refuses "
                              f"({str(error).strip().splitlines()[0][:160]}); pass trusted_user_content=True "
                              "to resume_from_checkpoint if you trust this checkpoint") from None


def _allocate(item: Stored, like: Optional[torch.Tensor], device: torch.device) -> Any:
    """A target for one stored entry: laid out as `like` (a parameter) when it has its shape, else plain."""
    if item.shape is None:
        return None
    if like is not None and tuple(item.shape) == tuple(like.shape):
        return target_like(like, item.dtype)
    return torch.empty(item.shape, dtype=item.dtype, device="cpu" if len(item.shape) == 0 else device)


class _Plan:
    """This rank's targets for one checkpoint, checked against what it holds, and how to apply them."""

    def __init__(self, runtime: Runtime, model: Any, optimizer: Any, entries: dict[tuple, Stored], strict: bool,
                 restore_positions: bool):
        self.runtime, self.model, self.optimizer = runtime, model, optimizer
        self.restore_positions = restore_positions
        self.updates = [optimizer.update] if optimizer is not None else []
        self.names = parameter_names(model.get_module())
        self.targets: dict = {MODEL: self._model_targets(under(entries, (MODEL,)), strict)}
        if optimizer is not None:
            self.targets[OPTIMIZER] = self._optimizer_targets(under(entries, (OPTIMIZER,)))
            for path in under(entries, (META,)):
                put(self.targets, (META,) + path, None)
            self.rng_ranks = len({path[0] for path in under(entries, (RNG,))})
            own = under(entries, (RNG, f"rank{runtime.rank}"))
            for path, item in own.items():
                put(self.targets, (RNG, f"rank{runtime.rank}") + path, _allocate(item, None, torch.device("cpu")))

    def _model_targets(self, stored: dict[tuple, Stored], strict: bool) -> dict[str, torch.Tensor]:
        held = self.model.sharded_state_dict()
        stored_names = {path[0] for path in stored}
        exact = {name: param for update in self.updates
                 for param in [*update.master_values(), *update.masters_elsewhere()]
                 for name in self.names.get(id(param), [])}
        self.exact = exact
        self.like: dict[str, torch.Tensor] = {}
        missing = sorted(name for name in [*held, *exact] if name not in stored_names)
        unexpected = sorted(stored_names - self.model.state_keys)
        if strict and (missing or unexpected):
            raise CheckpointError(_mismatch(missing, unexpected))
        targets = {}
        for name in sorted(set(held) | set(exact)):
            if name not in stored_names:
                continue
            item = stored[(name,)]
            tensor = exact[name] if name in exact else held[name]
            if tuple(item.shape) != tuple(tensor.shape):
                raise CheckpointError(f"model entry {name!r} has shape {tuple(item.shape)} in the checkpoint but "
                                      f"{tuple(tensor.shape)} in this model; it was saved from another model")
            self.like[name] = tensor
            targets[name] = target_like(tensor, torch.float32) if name in exact or strided(tensor) else tensor
        return targets

    def _optimizer_targets(self, stored: dict[tuple, Stored]) -> dict[str, Any]:
        groups = {path[1] for path in stored if path[0] == "groups"}
        present = len(self.optimizer.param_groups)
        if len(groups) != present:
            raise CheckpointError(f"the optimizer has {present} param groups but the checkpoint's had {len(groups)}; "
                                  "build it as when it was saved, or pass load_optimizer=False")
        by_name: dict[str, dict[str, Stored]] = {}
        for path, item in stored.items():
            if path[0] == "state":
                by_name.setdefault(path[1], {})[path[2]] = item
        state: dict[str, dict[str, Any]] = {}
        self.state_names: dict[int, str] = {}  # the name each parameter's optimizer state is read under
        for stepped, param in self.optimizer.update.stepped_params():
            name = next((n for n in self.names[id(param)] if n in by_name), None)
            if name is None:
                continue
            self.state_names[id(stepped)] = name
            state[name] = {key: _allocate(item, param, stepped.device) for key, item in by_name[name].items()}
        targets = {"state": state, "groups": {}}
        for path, item in under(stored, ("groups",)).items():
            put(targets["groups"], path, _allocate(item, None, torch.device("cpu")))
        return targets

    def apply(self, loaded: dict) -> None:
        model_values = {name: held_as(value, self.like[name]) for name, value in loaded[MODEL].items()}
        self.model.load_sharded_state_dict({k: v for k, v in model_values.items() if k not in self.exact})
        exact_values = {self.exact[name]: value for name, value in model_values.items() if name in self.exact}
        for update in self.updates:
            update.load_master_values(exact_values)
        if self.optimizer is None:
            return
        self._load_optimizer(loaded[OPTIMIZER])
        meta = loaded.get(META, {})
        self.optimizer.steps = int(meta.get("steps", 0))
        if self.model.loss_scaler is not None and meta.get("loss_scaler") is not None:
            self.model.loss_scaler.load_state_dict(meta["loss_scaler"])
        if not self.restore_positions:
            return
        loaders = meta.get("loaders") or {}
        self.runtime.restore_loader_states([loaders[str(i)] for i in range(len(loaders))])
        own = loaded.get(RNG, {}).get(f"rank{self.runtime.rank}")
        if own is not None:
            restore_rng_state(own, self.runtime.device)
        saved_world = self.rng_ranks
        if self.runtime.rank == 0 and saved_world and saved_world < dist.get_world_size():
            warnings.warn(f"the checkpoint holds RNG states for {saved_world} ranks, this world has "
                          f"{dist.get_world_size()}: the others keep the random streams the script seeded",
                          stacklevel=3)

    def _load_optimizer(self, loaded: dict) -> None:
        optimizer = self.optimizer.update.optimizer
        param_of = {id(stepped): param for stepped, param in self.optimizer.update.stepped_params()}
        state, groups, index = {}, [], 0
        for number, group in enumerate(optimizer.param_groups):
            ids = []
            for stepped in group["params"]:
                values = loaded["state"].get(self.state_names.get(id(stepped)))
                if values:
                    state[index] = {key: _like(value, stepped, param_of[id(stepped)]) for key, value in values.items()}
                ids.append(index)
                index += 1
            groups.append({**loaded["groups"][str(number)], "params": ids})
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def _like(value: Any, stepped: torch.Tensor, param: torch.Tensor) -> Any:
    """A loaded value as the optimizer keeps it: cut like its (strided) parameter, local for a ZeRO-1 master
    (`stepped`, the tensor the optimizer steps, stands for the model's `param`)."""
    if torch.is_tensor(value) and value.shape == param.shape:
        value = held_as(value, param)
    if isinstance(value, DTensor) and not isinstance(stepped, DTensor):
        return value.to_local()
    return value


def _mismatch(missing: list[str], unexpected: list[str]) -> str:
    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    parts = ([f"missing {few(missing)}"] if missing else []) + ([f"unexpected {few(unexpected)}"] if unexpected else [])
    return ("the checkpoint does not match this model (" + "; ".join(parts) + "); it was saved from another model, "
            "or pass strict=False to load what matches")
