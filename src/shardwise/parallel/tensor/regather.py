"""Sequence parallelism's gathered inputs kept as this rank's shard and gathered again in backward (Megatron-LM's
way, `sequence_parallel_regather`).

A column-parallel layer in the sequence-parallel region computes on its input all-gathered over the sequence, and
autograd keeps what it computed on for the weight gradient: under torch's styles that is the gathered input, whole
on every rank of the group, so the norms' outputs cost no less than under plain tensor parallelism. Here each block's
forward runs under a saved-tensors hook that keeps, in place of a gathered input (or a view of it), the shard it was
gathered from, and gathers it again when backward first needs it: once per gathered input, shared by the projections
that read it (q, k and v; gate and up), for one more all-gather per column-parallel input in backward.

Those gathers overlap backward's compute, as Megatron-LM overlaps its own with the input-gradient GEMM: when
backward first needs a gathered input, the all-gather of the one forward gathered before it (in the same block, or
the block before it in the same forward) starts asynchronously, so it runs while backward computes up to where that
one is needed. At most two gathered inputs are alive at once; only the first backward reaches waits for its gather.

Other saved tensors go to the hooks that were active before (an outer measurement, an activation offload). Inside a
checkpointed region, and in its recomputation, the hook stands aside: the region keeps only its input already.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...torch_internals import active_saved_tensors_hooks, in_checkpointed_region, tree_leaves
from ..local import local_tensor


def _start_gather(shard: torch.Tensor, mesh: DeviceMesh, dim: int) -> Callable[[], torch.Tensor]:
    """Start all-gathering `shard` over `mesh` along `dim`; the call returned waits for it and gives the whole
    tensor, contiguous as forward's gather left it (the saved views index it so)."""
    moved = shard.movedim(dim, 0).contiguous()
    out = moved.new_empty((mesh.size() * moved.shape[0], *moved.shape[1:]))
    work = dist.all_gather_single(out, moved, group=mesh.get_group(), async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return out.movedim(0, dim).contiguous()
    return wait


@dataclass(eq=False)
class _Gathered:
    """One gathered input: the shard it came from (as the outer hooks packed it) and, in backward, the gathered
    tensor while projections that kept it have yet to use it; `previous`, the one forward gathered before it, which
    backward needs next."""

    shard: Any
    mesh: DeviceMesh
    dim: int
    unpack_shard: Callable[[Any], torch.Tensor]
    previous: Optional["_Gathered"] = None
    pending: int = 0
    full: Optional[torch.Tensor] = None
    arriving: Optional[Callable[[], torch.Tensor]] = None

    def start(self) -> None:
        """Start gathering the shard again, unless it is here or on its way."""
        if self.full is None and self.arriving is None:
            self.arriving = _start_gather(self.unpack_shard(self.shard), self.mesh, self.dim)

    def gathered(self) -> torch.Tensor:
        """The gathered tensor for one saved view; the one before it starts gathering while views of it wait."""
        if self.full is None:
            self.start()
            self.full, self.arriving = self.arriving(), None
            if self.previous is not None:
                if self.previous.pending > 0:
                    self.previous.start()  # overlaps backward from here to where it is needed
                self.previous = None
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
    last: Optional[_Gathered] = None  # the block's latest gathered input (or the block before's, to start)
    gathered: dict[int, tuple[_Gathered, torch.Tensor]] = field(default_factory=dict)

    def note(self, shard: torch.Tensor, gathered: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        full = local_tensor(gathered)
        self.last = _Gathered(self.outer[0](local_tensor(shard).detach()), mesh, dim, self.outer[1], self.last)
        self.gathered[full.untyped_storage().data_ptr()] = (self.last, full)

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


def _first_tensor(tree: Any) -> Optional[torch.Tensor]:
    return next((t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)), None)


class Regather:
    """The blocks' scopes, entered around each block's forward (none inside a checkpointed region, or without
    grad) and told of each gathered input by the region's column-parallel styles. A block whose input is the
    output of the block that ran just before it continues that block's chain of gathered inputs."""

    def __init__(self) -> None:
        self._scopes: list[Optional[tuple[_BlockScope, saved_tensors_hooks]]] = []
        # the output of the block that ran last and its latest gathered input, both weakly held (the graph holds
        # what backward will need)
        self._handed_on: Optional[tuple[weakref.ref, weakref.ref]] = None

    def attach(self, block: nn.Module) -> None:
        block.register_forward_pre_hook(lambda _, args, kwargs: self._enter((args, kwargs)), with_kwargs=True)
        block.register_forward_hook(lambda _, args, output: self._exit(output), always_call=True)

    def _enter(self, inputs: Any) -> None:
        handed_on, self._handed_on = self._handed_on, None
        if not torch.is_grad_enabled() or in_checkpointed_region():
            self._scopes.append(None)   # nothing kept here: gathered inputs stay untracked
            return
        scope = _BlockScope(active_saved_tensors_hooks() or (_as_is, _as_is))
        first = _first_tensor(inputs)
        if handed_on is not None and first is not None and handed_on[0]() is first:
            scope.last = handed_on[1]()
        hooks = saved_tensors_hooks(scope.pack, scope.unpack)
        hooks.__enter__()
        self._scopes.append((scope, hooks))

    def _exit(self, output: Any) -> None:
        entered = self._scopes.pop()
        if entered is not None:
            scope, hooks = entered
            hooks.__exit__(None, None, None)
            scope.gathered.clear()
            handed = _first_tensor(output)
            if scope.last is not None and handed is not None:
                self._handed_on = (weakref.ref(handed), weakref.ref(scope.last))

    def note(self, shard: torch.Tensor, gathered: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
        """`gathered` (a DTensor or its local tensor) was all-gathered over `mesh` from this rank's `shard`."""
        if self._scopes and self._scopes[-1] is not None:
            self._scopes[-1][0].note(shard, gathered, mesh, dim)
