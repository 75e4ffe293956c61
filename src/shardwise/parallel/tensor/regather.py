"""Sequence parallelism's gathered inputs kept as this rank's shard and gathered again in backward (Megatron-LM's
way, `sequence_parallel_regather`).

A column-parallel layer in the sequence-parallel region computes on its input all-gathered over the sequence, and
autograd keeps what it computed on for the weight gradient: under torch's styles that is the gathered input, whole
on every rank of the group, so the norms' outputs cost no less than under plain tensor parallelism. Here each block's
forward runs under a saved-tensors hook that keeps, in place of a gathered input (or a view of it), the shard it was
gathered from, and gathers it again when backward first needs it: once per gathered input, shared by the projections
that read it (q, k and v; gate and up), for one more all-gather per column-parallel input in backward.

Other saved tensors go to the hooks that were active before (an outer measurement, an activation offload). Inside a
checkpointed region, and in its recomputation, the hook stands aside: the region keeps only its input already.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ...torch_internals import active_saved_tensors_hooks, in_checkpointed_region
from ..local import local_tensor


@dataclass(eq=False)
class _Gathered:
    """One gathered input: the shard it came from (as the outer hooks packed it) and, in backward, the gathered
    tensor while projections that kept it have yet to use it."""

    shard: Any
    mesh: DeviceMesh
    dim: int
    unpack_shard: Callable[[Any], torch.Tensor]
    pending: int = 0
    full: Optional[torch.Tensor] = None

    def gathered(self) -> torch.Tensor:
        if self.full is None:
            shard = self.unpack_shard(self.shard)
            self.full = DTensor.from_local(shard, self.mesh, [Shard(self.dim)], run_check=False).redistribute(
                self.mesh, [Replicate()]).to_local()
        self.pending -= 1
        full = self.full
        if self.pending <= 0:
            self.full = None
        return full


@dataclass(eq=False)
class _Kept:
    """A saved view of a gathered input: where in the gathered tensor it lies, and its DTensor layout if it was one."""

    source: _Gathered
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    placements: Optional[tuple] = None
    mesh: Optional[DeviceMesh] = None
    global_shape: Optional[torch.Size] = None
    global_stride: Optional[tuple[int, ...]] = None


def _as_is(t: Any) -> Any:
    return t


@dataclass(eq=False)
class _BlockScope:
    """The hooks of one block's forward: gathered inputs by their storage, the outer (pack, unpack) pair to pass
    the rest to (keeping tensors as they are when no hooks were active).

    Each gathered tensor is held until the block's forward ends, so no later tensor of the block can take its
    memory, and with it its address."""

    outer: tuple[Callable, Callable]
    gathered: dict[int, tuple[_Gathered, torch.Tensor]] = field(default_factory=dict)

    def note(self, shard: torch.Tensor, gathered: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        full = local_tensor(gathered)
        self.gathered[full.untyped_storage().data_ptr()] = (
            _Gathered(self.outer[0](local_tensor(shard).detach()), mesh, dim, self.outer[1]), full)

    def pack(self, t: torch.Tensor) -> Any:
        local = local_tensor(t)
        found = self.gathered.get(local.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if found is None:
            return self.outer[0](t)
        source = found[0]
        source.pending += 1
        kept = _Kept(source, local.size(), local.stride(), local.storage_offset())
        if isinstance(t, DTensor):
            kept.placements, kept.mesh = t.placements, t.device_mesh
            kept.global_shape, kept.global_stride = t.shape, t.stride()
        return kept

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Kept):
            return self.outer[1](packed)
        view = packed.source.gathered().as_strided(packed.size, packed.stride, packed.offset)
        if packed.mesh is None:
            return view
        return DTensor.from_local(view, packed.mesh, packed.placements, run_check=False,
                                  shape=packed.global_shape, stride=packed.global_stride)


class Regather:
    """The blocks' scopes, entered around each block's forward (none inside a checkpointed region, or without
    grad) and told of each gathered input by the region's column-parallel styles."""

    def __init__(self) -> None:
        self._scopes: list[Optional[tuple[_BlockScope, saved_tensors_hooks]]] = []

    def attach(self, block: nn.Module) -> None:
        block.register_forward_pre_hook(lambda *_: self._enter())
        block.register_forward_hook(lambda *_: self._exit(), always_call=True)

    def _enter(self) -> None:
        if not torch.is_grad_enabled() or in_checkpointed_region():
            self._scopes.append(None)   # nothing kept here: gathered inputs stay untracked
            return
        scope = _BlockScope(active_saved_tensors_hooks() or (_as_is, _as_is))
        hooks = saved_tensors_hooks(scope.pack, scope.unpack)
        hooks.__enter__()
        self._scopes.append((scope, hooks))

    def _exit(self) -> None:
        entered = self._scopes.pop()
        if entered is not None:
            scope, hooks = entered
            hooks.__exit__(None, None, None)
            scope.gathered.clear()

    def note(self, shard: torch.Tensor, gathered: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        """`gathered` (a DTensor or its local tensor) was all-gathered over `mesh` from this rank's `shard`."""
        if self._scopes and self._scopes[-1] is not None:
            self._scopes[-1][0].note(shard, gathered, mesh, dim)
