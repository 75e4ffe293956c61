"""Every private torch internal shardwise relies on, in one place.

torch promises nothing about these names, so each is imported or wrapped only
here, with why shardwise needs it and what public API would replace it, and
`tests/test_torch_internals.py` checks each one does what shardwise assumes:
a torch upgrade that moves one fails there, by name. CI tests torch 2.13.0
only, so pyproject.toml declares `torch>=2.13` and nothing older. On torch 2.11
(the GPU check's machine) every name here exists and works, `_unflatten` given
an index; two torch behaviours differ there, so GPT-2's packed q/k/v under tensor
parallelism and the V-shaped pipeline schedule need 2.13 (docs/torch.md).

Members of torch classes that shardwise subclasses override or read on `self`
(an override cannot be wrapped; the smoke tests check each still exists and is
still called):

- `ParallelStyle._apply` — the one method a tensor-parallel style implements
  (`parallel/tensor/styles.py`, `parallel/tensor/sequence.py`).
- `ShardedGradScaler._unscale_grads_` and `._scale` — `parallel/precision.py`'s
  `LossScaler` unscales each gradient through its local tensor.
- `PipelineStage.get_local_bwd_output`, `.set_local_bwd_input` and `.has_backward`
  — `parallel/pipeline/schedule.py`'s `EvalSafeStage` skips the V-shaped
  schedules' backward hand-over in evaluation.

Used by tests and `bench/` only, and checked by the smoke tests all the same:
`torch.distributed._tools.mem_tracker.MemTracker` (memory per category).
"""

from __future__ import annotations

import contextlib
import pickle
from datetime import timedelta
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable, Iterator, MutableMapping, Optional

import torch
import torch.distributed as dist
from torch import nn

# FSDP2's replication, DTensor-aware; a pipeline stage's piecewise backward is beyond DDP's reducer.
# Public candidate: fully_shard(..., dp_mesh_dims=DataParallelMeshDims(replicate=...)) (new in 2.13, untried here).
from torch.distributed import _functional_collectives as functional_collectives
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard import _fully_shard as _fully_shard_module
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo
from torch.distributed.tensor import DTensor, _redistribute
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard

# The classes of torch.ops' entries: selective recompute tells an op overload (what its policy lists) from its
# packet. torch.ops hands them out but names no class publicly; a public torch.ops type module would replace them.
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

# Tensors without data that models treat as while torch traces them (Hugging Face skips data-dependent checks on
# them), for the pipeline's module-graph cut (parallel/pipeline/graph_cut.py). No public equivalent in 2.13.
from torch._subclasses.fake_tensor import FakeTensorMode

# The ops a step runs, c10d collectives included, as they dispatch: observe/comms.py's log of every collective.
# Public candidate: torch.distributed's CommDebugMode (counts only, no bytes or times per op, no groups).
from torch.utils._python_dispatch import TorchDispatchMode

# Nested containers (a Hugging Face ModelOutput included, which transformers registers here).
# No public pytree module in torch 2.13, though torch's own distributed code uses this one throughout.
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_map_only, tree_unflatten

__all__ = [
    "all_gather_base_op", "all_reduce_sum", "all_to_all_autograd", "at_backward_end", "ATTENTION_KERNELS",
    "children_table", "clear_dtensor_caches", "drop_forward_hooks", "FakeTensorMode", "flash_attention_cpu",
    "flash_attention_cpu_backward", "flatten_mesh", "flight_recorder_trace", "foreach", "functional_collective_ops",
    "grad_scaler_state", "HigherOrderOperator", "layout_unpickler", "OpOverload", "OpOverloadPacket",
    "process_groups", "reduce_scatter_base_op", "replicate", "reshard_after_forward_over", "ring_attention",
    "ring_attention_backward", "set_group_timeout", "storage_id", "strided", "strided_shard", "style_input_fn",
    "style_output_fn", "tensor_tables", "TorchDispatchMode", "tree_flatten", "tree_leaves", "tree_map",
    "tree_map_only", "tree_unflatten", "unflatten_mesh", "unscale_and_check_", "use_tensor_tables", "version",
    "view_base",
]


# torch's multi-tensor ops: one call runs an op over a whole list of tensors (DTensors included), as torch.optim's
# foreach path does; SMP's FusedLamb and FusedNovoGrad, and DeepSpeed's Lamb, step with them. No public equivalent
# in 2.13 (only torch.optim's built-in optimizers reach them); a public torch.foreach module would replace them.
foreach = SimpleNamespace(
    norm=torch._foreach_norm, sqrt_=torch._foreach_sqrt_, copy_=torch._foreach_copy_,
    add_=torch._foreach_add_, sub_=torch._foreach_sub_, mul_=torch._foreach_mul_, div_=torch._foreach_div_,
    add=torch._foreach_add, sqrt=torch._foreach_sqrt, div=torch._foreach_div, addcmul_=torch._foreach_addcmul_,
)


# The ops torch's functional collectives dispatch to (DTensor's redistributions, all_to_all_autograd), whose
# namespace is private; selective recompute keeps their outputs, observe/comms.py logs them. No public namespace.
functional_collective_ops = torch.ops._c10d_functional

# c10d's ops behind all_gather_into_tensor and reduce_scatter_tensor, under their private names as they dispatch:
# observe/comms.py tells collectives by op name. Public only as the functions that call them.
all_gather_base_op = torch.ops.c10d._allgather_base_
reduce_scatter_base_op = torch.ops.c10d._reduce_scatter_base_

# The attention kernels scaled_dot_product_attention dispatches to (one per backend), whose outputs selective
# recompute keeps: private aten ops, public only through the function that picks one.
_aten = torch.ops.aten
ATTENTION_KERNELS = (
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
)

# The function torch pickles a layout (torch.strided) through, by name: checkpoint/storage.py's metadata unpickler
# allows it and nothing else of torch.serialization. Public replacement: none (copyreg registers it privately).
layout_unpickler = torch.serialization._get_layout


def storage_id(tensor: torch.Tensor) -> int:
    """One number per block of memory, the same for every view into it: tells whether two tensors share memory."""
    # The storage's C object's address (UntypedStorage._cdata), distinct for meta and fake tensors too, where the
    # public data_ptr() is 0 for all of them.
    return tensor.untyped_storage()._cdata


def view_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor `tensor` is a view of (a parameter, for a view of one), or `tensor` itself if it is no view."""
    # Tensor._base, autograd's own link from a view to its base; no public equivalent.
    return tensor if tensor._base is None else tensor._base


def grad_scaler_state(scale: float, growth_factor: float, backoff_factor: float, growth_interval: int) -> dict:
    """A GradScaler state dict that starts from `scale` and grows after `growth_interval` finite steps."""
    # The state dict's private key, the count of finite steps since the scale last grew; public only through
    # GradScaler's constructor, which a scaler already made cannot rerun.
    return {"scale": scale, "growth_factor": growth_factor, "backoff_factor": backoff_factor,
            "growth_interval": growth_interval, "_growth_tracker": 0}


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run `callback` once the backward pass now running has finished (call it from a backward hook)."""
    # The autograd engine's end-of-backward queue, as DDP and FSDP use it; no public equivalent.
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def version(tensor: torch.Tensor) -> int:
    """The tensor's in-place write counter (shared with its views): tells whether it changed since a read.

    A write through a DTensor (`load_state_dict` into a tensor-parallel parameter) counts on the DTensor
    only, not on its local tensor: ask the parameter itself.
    """
    # Tensor._version: autograd's own counter; public would be a write hook, which torch lacks.
    return tensor._version


def all_to_all_autograd(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int],
                        group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all along dim 0 with uneven splits, whose backward is the reverse all-to-all (expert dispatch)."""
    # torch.distributed._functional_collectives: the public torch.distributed.nn.functional.all_to_all_single is
    # deprecated in its favour; a public functional collectives module would replace it.
    sent = functional_collectives.all_to_all_single_autograd(tensor, output_splits, input_splits, group)
    return functional_collectives.wait_tensor(sent)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A new tensor: the sum of `tensor` over `group` (out of place, no autograd)."""
    # torch.distributed._functional_collectives, as above.
    return functional_collectives.wait_tensor(functional_collectives.all_reduce(tensor, "sum", group))


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over all of `mesh`'s axes (one process group across them), named `name`."""
    # DeviceMesh._flatten, as torchtitan uses it; a public DeviceMesh.flatten would replace it.
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, axis: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """`mesh` with `axis` split into axes of `sizes` named `names` (the last fastest), their groups made for every
    rank at once."""
    # DeviceMesh._unflatten; a public DeviceMesh.unflatten would replace it. Given the axis's index, not its name:
    # torch 2.11 refuses every name (its check is inverted), 2.13 takes both.
    return mesh._unflatten(mesh.mesh_dim_names.index(axis), sizes, names)


@contextlib.contextmanager
def reshard_after_forward_over(secondary: DeviceMesh) -> Iterator[None]:
    """Inside, `fully_shard(..., reshard_after_forward=n)` with n the size of `secondary`'s second axis keeps each
    unit's parameters between forward and backward sharded over that axis (ZeRO++ hpZ), the first one naming the
    other secondary groups of the sharding group.

    FSDP2 would build a new DeviceMesh per `fully_shard` call from the rank's own sharding group: new process
    groups for every unit, and where ranks hold different sharding groups (MiCS's partition groups) they create
    different groups in the same order and hang. Here every unit shares the groups the mesh made once for every
    rank. Public replacement: none in torch 2.13 (a mesh argument for the post-forward group would be one).
    """
    # fully_shard's module imports the helper by name: that is the binding its calls read.
    original = _fully_shard_module._get_post_forward_mesh_info
    info = HSDPMeshInfo(secondary, shard_mesh_dim=1, replicate_mesh_dim=0)

    def post_forward_mesh_info(reshard_after_forward: Any, mesh_info: Any) -> Any:
        if isinstance(reshard_after_forward, bool) or reshard_after_forward != info.shard_mesh_size:
            return original(reshard_after_forward, mesh_info)
        if mesh_info.shard_mesh_size != info.shard_mesh_size * info.replicate_mesh_size:
            raise ValueError(f"secondary groups of {info.shard_mesh_size} x {info.replicate_mesh_size} ranks do not "
                             f"make up the sharding group of {mesh_info.shard_mesh_size}")
        return info

    _fully_shard_module._get_post_forward_mesh_info = post_forward_mesh_info
    try:
        yield
    finally:
        _fully_shard_module._get_post_forward_mesh_info = original


def strided_shard(dim: int, chunks: int) -> Placement:
    """The placement of a packed tensor cut chunk by chunk along `dim` (each rank holds its part of every chunk)."""
    # _StridedShard: the only DTensor layout for it, so full_tensor() and checkpoints keep the packed order.
    return _StridedShard(dim, split_factor=chunks)


def clear_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation, redistribution and mesh-topology caches (they hold DeviceMeshes,
    and a DeviceMesh holds its process groups)."""
    # Private caches with no public reset; nothing public replaces them. What torch.distributed.tensor.debug's
    # private _clear_sharding_prop_cache clears, without importing that module (it loads torch's runtime estimator
    # and inductor: most of a rank's shutdown): the Python propagator's cache and the C++ fast path's, on a torch
    # that has that fast path.
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()  # redistribution's cost model, per mesh


def unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply `grads` by `inv_scale` in place; set `found_inf` to 1 if any holds an inf or a nan."""
    # The fused op GradScaler runs; public only through GradScaler.unscale_, which takes a whole optimizer.
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def style_input_fn(style: ParallelStyle) -> Callable[..., Any]:
    """A Colwise/RowwiseParallel style's own input hook, `(module, inputs, mesh)`, bound to its current layouts."""
    # Their private static methods; a public ParallelStyle hook API would replace them.
    return partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts)


def style_output_fn(style: ParallelStyle) -> Callable[..., Any]:
    """A Colwise/RowwiseParallel style's own output hook, `(module, outputs, mesh)`, bound to its current layouts."""
    return partial(style._prepare_output_fn, style.output_layouts, style.use_local_output)


def children_table(module: nn.Module) -> dict[str, nn.Module | None]:
    """The module's own table of children, to edit in place (e.g. drop blocks without renumbering the rest)."""
    # nn.Module._modules; setattr / del cover single changes, but no public API edits the table as a whole.
    return module._modules


def tensor_tables(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any], set[str]]:
    """The module's own tables of parameters and buffers, and the names of its non-persistent buffers."""
    # nn.Module._parameters, ._buffers, ._non_persistent_buffers_set: what named_parameters, state_dict and
    # attribute access read; no public API hands them over as tables.
    return module._parameters, module._buffers, module._non_persistent_buffers_set


def use_tensor_tables(module: nn.Module, parameters: MutableMapping[str, Any], buffers: MutableMapping[str, Any],
                      non_persistent: set[str]) -> None:
    """Make `module` read and write these tables as its own (e.g. views joining other modules' tables)."""
    module.__dict__.update(_parameters=parameters, _buffers=buffers, _non_persistent_buffers_set=non_persistent)


def drop_forward_hooks(module: nn.Module) -> None:
    """Remove every forward (pre-)hook of `module`: DTensor's parallel styles register theirs and keep no handle."""
    # nn.Module's hook tables; the public API removes a hook only through the handle its registration returned.
    for hooks in (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs, module._forward_hooks,
                  module._forward_hooks_with_kwargs, module._forward_hooks_always_called):
        hooks.clear()


def strided(tensor: torch.Tensor) -> bool:
    """A DTensor with a `_StridedShard` placement (packed Q/K/V under tensor parallelism)."""
    # DCP records a DTensor's piece by one offset, which a strided piece (a slice of every chunk) has not:
    # torch 2.13 writes overlapping chunks for it. There is no public placement to test against.
    return isinstance(tensor, DTensor) and any(isinstance(p, _StridedShard) for p in tensor.placements)


def flight_recorder_trace() -> dict[str, Any]:
    """This process's recent collectives, each with its group, sequence number and Python stack, and how far
    each group got (`pg_status`); empty unless TORCH_FR_BUFFER_SIZE was set before the first process group."""
    # c10d's flight recorder, which NCCL's watchdog dumps to files; on gloo only this binding reads it in 2.13.
    # A public in-process dump API would replace it.
    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace())


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Change how long `group`'s collectives wait (groups made after the world keep torch's 30-minute default)."""
    # Public only as new_group(timeout=...), at creation; DeviceMesh makes its groups without one.
    dist.distributed_c10d._set_pg_timeout(timeout, group)


def process_groups() -> dict[str, tuple[dist.ProcessGroup, str, list[int]]]:
    """Every process group of this process by name (as the flight recorder names them): group, description, ranks."""
    # c10d's registry of groups; public API lists the ranks of a group one holds, but no groups.
    return {name: (group, group.group_desc, dist.get_process_group_ranks(group))
            for group, name in dist.distributed_c10d._world.pg_names.items()}


def _ring_module() -> Any:
    """torch's context-parallel attention module, imported on first use (it loads half a second of torch that
    runs without context parallelism never need)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


@contextlib.contextmanager
def _ring_options(load_balanced: bool) -> Iterator[None]:
    """torch's ring attention reads two module-level options: set them for one call, then put them back."""
    _context_parallel_attention = _ring_module()
    options = _context_parallel_attention._cp_options
    saved = options.enable_load_balance, options.rotate_method
    # Each step sends the key/value block to the next rank (a ring, overlapping the block's attention), where the
    # default gathers every block at once; load balancing is the mirrored-chunk layout, meaningful only when causal.
    options.enable_load_balance, options.rotate_method = load_balanced, _context_parallel_attention._RotateMethod.ALL_TO_ALL
    try:
        yield
    finally:
        options.enable_load_balance, options.rotate_method = saved


def ring_attention(group: dist.ProcessGroup, block: Callable[..., tuple[torch.Tensor, ...]], query: torch.Tensor,
                   key: torch.Tensor, value: torch.Tensor, is_causal: bool, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """Attention of the local queries over every rank's keys/values, passed around `group` in a ring: `block(q, k, v,
    is_causal=..., **kwargs)` gives each block's (out, logsumexp), merged by their logsumexps. Returns (out, lse).

    Causal calls expect the load-balanced layout (rank r holds chunks r and 2n-1-r of 2n)."""
    # _templated_ring_attention: what torch's context_parallel() runs for the CUDA kernels; public only through
    # context_parallel(), whose sharding rules cover no CPU kernel and no document mask in torch 2.13.
    with _ring_options(is_causal):
        out, lse, *_ = _ring_module()._templated_ring_attention(
            group, 2, block, query=query, key=key, value=value, is_causal=is_causal, **kwargs)
    return out, lse


def ring_attention_backward(group: dist.ProcessGroup, block: Callable[..., tuple[torch.Tensor, ...]],
                            grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool,
                            **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `ring_attention`'s inputs: keys/values pass the ring again, their gradients follow them back;
    `block(query=, key=, value=, out=, logsumexp=, grad_out=, is_causal=, **kwargs)` gives each block's."""
    with _ring_options(is_causal):
        grad_query, grad_key, grad_value, *_ = _ring_module()._templated_ring_attention_backward(
            group, 2, block, grad_out, "grad_out", query, key, value, out, logsumexp, is_causal, **kwargs)
    return grad_query, grad_key, grad_value


def flash_attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool,
                        attn_mask: torch.Tensor | None, scale: float, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash-attention kernel SDPA dispatches to, returning (out, logsumexp) as ring attention merges them.

    A fully masked row comes back as out 0 and logsumexp 0 (not -inf): callers that mask whole rows fix that."""
    # aten op behind F.scaled_dot_product_attention on CPU; the public function hides the logsumexp.
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)


def flash_attention_cpu_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 out: torch.Tensor, logsumexp: torch.Tensor, *, is_causal: bool,
                                 attn_mask: torch.Tensor | None, scale: float,
                                 **_: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flash_attention_cpu`'s gradients for (query, key, value), given the merged out and logsumexp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, attn_mask=attn_mask, scale=scale)


def active_saved_tensors_hooks() -> Optional[tuple[Callable, Callable]]:
    """The (pack, unpack) pair of the innermost saved-tensors hooks now active, or None."""
    # torch keeps the stack in C++; `saved_tensors_hooks` exposes no way to read it.
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def in_checkpointed_region() -> bool:
    """Whether the innermost saved-tensors hooks are torch.utils.checkpoint's (a region's forward, or its
    recomputation in backward)."""
    hooks = active_saved_tensors_hooks()
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(
        ("_checkpoint_hook.", "_recomputation_hook."))
