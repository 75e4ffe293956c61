"""`deepspeed.zero`: `Init` (build a model without allocating it whole) and `GatheredParameters`.

`Init` is shardwise's delayed initialisation for parameters: modules built inside it keep their
parameters on the meta device (each is made, then dropped to meta, one at a time, so the host never holds
the model), while buffers stay as the module computed them (a causal mask keeps its values), as under
DeepSpeed, which partitions parameters only. `deepspeed.initialize` materialises only this rank's shards
(parallel/materialize.py); the values come from each module's own initialiser seeded by its name, so every
layout builds the same model; they are not DeepSpeed's draw from the global generator.

`GatheredParameters` gives whole parameters inside its block where the layout holds them in pieces (ZeRO-3
and MiCS shards, tensor-parallel splits): the module attributes name full tensors there, and with
`modifier_rank` set, that rank's values are broadcast and cut back into every rank's pieces on exit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..runtime import state
from ..torch_internals import tensor_tables

__all__ = ["Init", "GatheredParameters"]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block moves to the meta device; buffers are left as made."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            tensor_tables(module)[0][name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class Init(contextlib.ContextDecorator):
    """DeepSpeed's `zero.Init`: inside it, parameters are left on the meta device (buffers as made) and the
    engine materialises this rank's part. `module=` converts an already built model, which is materialised
    already: nothing to do. `enabled=False` builds normally. The remaining arguments choose where DeepSpeed
    keeps the partitions (`remote_device`, `pin_memory`) or its groups; the config's layout decides here."""

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group: Any = None, mem_efficient_linear:
                 bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None):
        self.enabled = enabled and module is None
        self.dtype = dtype
        self._context: Optional[contextlib.AbstractContextManager] = None

    def __enter__(self) -> "Init":
        self._context = _parameters_on_meta() if self.enabled else contextlib.nullcontext()
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        context, self._context = self._context, None
        return bool(context.__exit__(*exc))


def _as_list(params: Union[nn.Parameter, Iterable[nn.Parameter], None]) -> list[nn.Parameter]:
    if params is None:
        return []
    return [params] if torch.is_tensor(params) else [p for p in params if p is not None]


def _registrations(params: list[nn.Parameter]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Every (module, name) of a live DistributedModel that registers one of `params`."""
    if not state.is_initialized():
        return []
    wanted = {id(p) for p in params}
    found = []
    for model in list(state.current().models):
        for module in model.get_module().modules():
            parameters = tensor_tables(module)[0]
            found += [(module, name, p) for name, p in parameters.items() if p is not None and id(p) in wanted]
    return found


class GatheredParameters:
    """DeepSpeed's `zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)`.

    Inside the block the modules holding `params` hold whole copies of them (read them through the module,
    `module.weight`). With `modifier_rank=r`, rank r's values after the block are broadcast to every rank and
    become every rank's pieces; with None, changes are discarded, as in DeepSpeed. Parameters held whole
    already (no sharding) are left in place, and a `modifier_rank` still broadcasts them."""

    def __init__(self, params: Union[nn.Parameter, Iterable[nn.Parameter], None], modifier_rank: Optional[int] = None,
                 fwd_module: Optional[nn.Module] = None, enabled: bool = True):
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._swapped: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []

    def __enter__(self) -> "GatheredParameters":
        whole: dict[int, nn.Parameter] = {}
        for module, name, param in _registrations([p for p in self.params if isinstance(p, DTensor)]):
            if id(param) not in whole:
                whole[id(param)] = nn.Parameter(param.detach().full_tensor(), requires_grad=param.requires_grad)
            tensor_tables(module)[0][name] = whole[id(param)]
            self._swapped.append((module, name, param, whole[id(param)]))
        return self

    def __exit__(self, *exc: Any) -> None:
        written: set[int] = set()
        for module, name, sharded, full in self._swapped:
            tensor_tables(module)[0][name] = sharded
            if self.modifier_rank is not None and exc[0] is None and id(sharded) not in written:
                written.add(id(sharded))
                self._write_back(sharded, full)
        self._swapped = []
        if self.modifier_rank is not None and exc[0] is None:
            with torch.no_grad():
                for param in self.params:
                    if not isinstance(param, DTensor) and dist.is_initialized():
                        dist.broadcast(param.data, src=self.modifier_rank)

    def _write_back(self, sharded: nn.Parameter, full: nn.Parameter) -> None:
        with torch.no_grad():
            value = full.detach()
            if dist.is_initialized():
                dist.broadcast(value, src=self.modifier_rank)
            pieces = distribute_tensor(value, sharded.device_mesh, sharded.placements, src_data_rank=None)
            sharded.to_local().copy_(pieces.to_local())
