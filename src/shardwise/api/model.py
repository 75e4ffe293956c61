"""`DistributedModel`: the user's module with the configured parallelism applied, SMP v1's arguments and methods.

Names are those of the user's module outside (no "module." prefix). As in SMP,
`state_dict()` is the whole model and `local_state_dict()` this rank's pieces;
`load_state_dict` takes either. shardwise partitions the model in the
constructor; `partitioned` still turns True, and the post-partition hooks run,
at the first @step, as SMP scripts expect.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any, Callable, ContextManager, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.hooks import RemovableHandle

from ..checkpoint.contents import as_held
from ..checkpoint.legacy import local_tensors
from ..parallel.compose import (OriginalNames, PlanLike, ineffective_for_model, is_stand_in, loss_scaler,
                                parallelize, replace_registered)
from ..parallel.strategy import OptimizerUpdate
from ..runtime.init import warn_ineffective
from ..runtime.state import current
from ..config.decisions import Decisions

# What SMP's local_state_dict() holds besides tensors; loading skips them.
SMP_MARKERS = ("_smp_is_partial", "_smp_load_info")
Hook = Callable[["DistributedModel", Any], None]  # SMP's hooks take (model, optimizer)


def _use_cache_position(module: nn.Module) -> Optional[int]:
    """Where `module`'s forward takes `use_cache` among its arguments, or None where it takes none."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("use_cache") if "use_cache" in names else None


@dataclass(frozen=True)
class ModelOptions:
    """SMP v1's `DistributedModel` arguments, with the defaults its documentation gives."""

    trace_device: str = "gpu"
    trace_execution_times: bool = False
    trace_memory_usage: bool = False
    overlapping_allreduce: bool = True
    backward_passes_per_step: int = 1
    average_grads_across_microbatches: bool = True
    bucket_cap_mb: float = 25
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = False

    def check(self) -> None:
        if self.trace_device not in ("cpu", "gpu"):
            raise ValueError(f"DistributedModel: trace_device must be 'cpu' or 'gpu', got {self.trace_device!r}")
        steps = self.backward_passes_per_step
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"DistributedModel: backward_passes_per_step must be a positive int, got {steps!r}")

    def notes(self, ddp: bool, pipelined: bool) -> list[tuple[str, str]]:
        """(argument, what shardwise does instead) for each argument set away from its default that changes
        nothing here. `ddp`: the model's replicas are torch's DistributedDataParallel."""
        untraced = ("shardwise cuts pipeline stages along the block list, or from the module graph traced once on "
                    "fake meta tensors, on no device")
        no_buckets = "no DDP buckets in this layout"
        why = {
            "trace_device": untraced, "trace_execution_times": untraced, "trace_memory_usage": untraced,
            "overlapping_allreduce": "gradients are always reduced while backward runs; they come out the same",
        }
        if not ddp:  # torch's DDP takes these (ddp_options); elsewhere no buckets, searches or broadcasts exist
            why.update(bucket_cap_mb=no_buckets, gradient_as_bucket_view=no_buckets)
        if pipelined:
            why["backward_passes_per_step"] = "a pipeline reduces gradients in every @step; summed they are the same"
        return [(f"DistributedModel({f.name}=...)", why[f.name]) for f in fields(self)
                if f.name in why and getattr(self, f.name) != f.default]

    def ddp_options(self) -> dict[str, Any]:
        """The arguments torch's DistributedDataParallel takes, where the composition chooses it."""
        return {"bucket_cap_mb": self.bucket_cap_mb, "find_unused_parameters": self.find_unused_parameters,
                "broadcast_buffers": self.broadcast_buffers, "gradient_as_bucket_view": self.gradient_as_bucket_view}


def _split_over_tp(tensor: torch.Tensor) -> bool:
    """Split over the tensor-parallel axis: a DTensor sharded along "tp" (ZeRO's sharding is along dp axes)."""
    if not isinstance(tensor, DTensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    return "tp" in names and tensor.placements[names.index("tp")].is_shard()


def _as_held(name: str, value: Any, held: torch.Tensor) -> Any:
    """`value` laid out as the tensor this rank holds under `name`: a whole tensor (a `state_dict()` entry) is
    cut to this rank's piece, a piece (a `local_state_dict()` entry) wrapped as it. Decided by shape."""
    if not isinstance(held, DTensor) or not torch.is_tensor(value) or isinstance(value, DTensor):
        return value
    if value.shape == held.shape:  # whole, alike on every rank: each keeps its piece, nothing is sent
        return distribute_tensor(value.to(held.device), held.device_mesh, held.placements, src_data_rank=None)
    piece = held.to_local().shape
    if value.shape == piece:
        return as_held(value, held)
    raise ValueError(f"load_state_dict: {name} has shape {tuple(value.shape)}, but this model holds it whole as "
                     f"{tuple(held.shape)} and this rank's piece as {tuple(piece)}; load a state_dict() of this "
                     "model, or a local_state_dict() saved on this layout")


class DistributedModel(nn.Module):
    """Wraps `module` per the config given to `init`; `get_module()` returns the module as the user built it.

    The other arguments are SMP v1's, in its order (see `ModelOptions`):
    `average_grads_across_microbatches=False` sums the microbatches' gradients;
    `backward_passes_per_step=k` synchronises gradients in every k-th training
    @step only (the ones between accumulate locally); the rest only concern
    SMP's tracing or DDP's internals, and a one-line notice names each one set
    that changes nothing here. `tensor_parallel_plan` splits a model that has
    no built-in plan (module-path pattern → style, see docs/tensor_parallel.md);
    it is used only when tensor_parallel_degree > 1. Every call acts on this
    model's own strategy (parallel/strategy.py), so several models live side
    by side in one process.
    """

    def __init__(self, module: nn.Module, trace_device: str = "gpu", trace_execution_times: bool = False,
                 trace_memory_usage: bool = False, overlapping_allreduce: bool = True,
                 backward_passes_per_step: int = 1, average_grads_across_microbatches: bool = True,
                 bucket_cap_mb: float = 25, find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False, *, tensor_parallel_plan: PlanLike = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedModel expects a torch.nn.Module, got {type(module).__name__}")
        options = ModelOptions(trace_device, trace_execution_times, trace_memory_usage, overlapping_allreduce,
                               backward_passes_per_step, average_grads_across_microbatches, bucket_cap_mb,
                               find_unused_parameters, broadcast_buffers, gradient_as_bucket_view)
        options.check()
        self.options = options
        runtime = current("shardwise.DistributedModel")
        self._runtime = runtime
        self.replaced_class = type(module)  # what the user built; a built-in stand-in may replace it
        self.model_config = getattr(module, "config", None)  # a Hugging Face model's, kept for checkpoints
        # tp_register's stand-ins first (the model itself may be one): they are the model every rank places and splits.
        module = replace_registered(module)
        # Before parallelizing replaces them: an optimizer built from `module` is mapped by these names.
        self.original_names = OriginalNames(module)
        # The whole model's state dict names, which a checkpoint of it may hold (a pipeline stage holds fewer).
        self.state_keys = frozenset(module.state_dict(keep_vars=True))  # keep_vars: no new tensors
        self.module_class = type(module)  # before FSDP2 swaps in a subclass of its own
        self._cache_position = _use_cache_position(module)
        ineffective = ineffective_for_model(module, runtime.config)
        self._strategy = parallelize(module, runtime.mesh, runtime.config, tensor_parallel_plan,
                                     ddp_options=options.ddp_options())
        decisions = Decisions(runtime.config, runtime.layout)
        self._tensor_parallel = decisions.tensor_parallel
        warn_ineffective(ineffective + options.notes(self._strategy.reduces_in_forward, decisions.pipelining))
        self.module = self._strategy.module
        self.loss_scaler = loss_scaler(runtime.config, runtime.device)
        self._partitioned = False
        self._stepped = False
        self._passes = 0  # training @steps since gradients were last synchronised
        self._microbatch: Optional[tuple[int, int]] = None  # while @step runs one: (index, microbatches)
        self._hook_reduces = False  # a comm hook registered: it averages over microbatches, as SMP has it
        self._partition_hooks: OrderedDict[int, Hook] = OrderedDict()
        self._post_step_hooks: OrderedDict[int, Hook] = OrderedDict()
        self.forward_calls = 0  # compared across ranks at the @step boundary (runtime/control_flow.py)
        runtime.models.add(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.forward_calls += 1
        if (torch.is_grad_enabled() and self._cache_position is not None and "use_cache" not in kwargs
                and len(args) <= self._cache_position):
            # A training forward needs no key/value cache, and a Hugging Face model building one hands it to its
            # blocks: it would keep every block's keys and values to backward, and a checkpointed block's
            # recomputation would append to it again (as HF's own gradient checkpointing, shardwise turns it off).
            kwargs["use_cache"] = False
        return self._strategy.forward(*args, **kwargs)

    def get_module(self) -> nn.Module:
        return self._strategy.inner

    @property
    def partitioned(self) -> bool:
        """False until the first @step starts, as in SMP (shardwise has partitioned the model already)."""
        return self._partitioned

    @property
    def reduces_in_forward(self) -> bool:
        """Gradient reduction is armed by this wrapper's forward (DDP's replicas): a forward of the module itself
        would leave its gradients unreduced."""
        return self._strategy.reduces_in_forward

    @property
    def runs_whole_step(self) -> bool:
        """A pipelined model: its schedule runs a whole @step, which then takes no other DistributedModel."""
        return self._strategy.runs_whole_step

    def stage_modules(self) -> Optional[list[nn.Module]]:
        """The stage modules a pipeline schedule calls on this rank (None where this model itself runs)."""
        return self._strategy.stage_modules()

    @property
    def holds_loss(self) -> bool:
        """False on pipeline ranks whose stages do not compute the loss."""
        return self._strategy.holds_loss

    @contextlib.contextmanager
    def microbatch_context(self, last: bool) -> Iterator[None]:
        """Around one microbatch of a @step: gradients are synchronised after the `last` microbatch of every
        `backward_passes_per_step`-th training step (an evaluation step's last one always ends it)."""
        self._begin_step()
        training = torch.is_grad_enabled()
        due = (self._passes + 1) % self.options.backward_passes_per_step == 0
        with self._strategy.microbatch_context(last and (due or not training)):
            yield
        if last:
            self._end_step(training)

    @contextlib.contextmanager
    def counting(self, index: int, microbatches: int) -> Iterator[None]:
        """While microbatch `index` of `microbatches` runs: backward divides the loss by their number."""
        self._microbatch = (index, microbatches)
        try:
            yield
        finally:
            self._microbatch = None

    def run_step(self, fn: Callable, pieces: list[tuple[tuple, dict]], around: Callable[[int], ContextManager],
                 counted: Callable[[int], ContextManager]) -> list[Any]:
        """Run a @step function's microbatches (each under `around(index)`, unless a pipeline schedules them,
        entering only `counted(index)`)."""
        self._begin_step()
        training = torch.is_grad_enabled()
        outputs = self._strategy.run_step(self, fn, pieces, around, counted)
        self._strategy = self._strategy.settled()  # the module-graph pipeline is cut at the first @step
        if self.runs_whole_step:  # its schedule ran the microbatches without microbatch_context
            if training and self.loss_scaler is not None and not self.holds_loss:
                # fp16: gradients arrive scaled; the scaler's scale exists only once it has scaled something
                self.loss_scaler.scale(torch.zeros((), device=self._runtime.device))
            self._end_step(training)
        return outputs

    def _begin_step(self) -> None:
        if not self._partitioned:
            self._partitioned = True
            for hook in list(self._partition_hooks.values()):
                hook(self, self._optimizer())

    def _end_step(self, training: bool) -> None:
        if training:
            self._passes = (self._passes + 1) % self.options.backward_passes_per_step
        if not self._stepped:
            self._stepped = True
            for hook in list(self._post_step_hooks.values()):
                hook(self, self._optimizer())

    def _optimizer(self) -> Any:
        """The DistributedOptimizer of this model, or None: SMP passes it to hooks."""
        return next((opt for opt in self._runtime.optimizers if opt.model is self), None)

    def register_post_partition_hook(self, hook: Hook) -> RemovableHandle:
        """Call `hook(model, optimizer)` at the start of the first @step, before its first forward, as SMP
        does after partitioning; right away when that has passed."""
        handle = RemovableHandle(self._partition_hooks)
        if self._partitioned:
            hook(self, self._optimizer())
        else:
            self._partition_hooks[handle.id] = hook
        return handle

    def register_post_step_hook(self, hook: Hook) -> RemovableHandle:
        """Call `hook(model, optimizer)` once, when the first @step has ended, as SMP does."""
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = hook
        return handle

    def backward(self, tensors: torch.Tensor | Sequence[torch.Tensor],
                 grad_tensors: Optional[torch.Tensor | Sequence[torch.Tensor]] = None) -> None:
        """`torch.autograd.backward(tensors, grad_tensors)` as SMP's `model.backward`: a scalar loss alone, or
        tensors with their incoming gradients; averaged over the @step's microbatches, loss-scaled in fp16."""
        if grad_tensors is None:
            self.scaled_loss(tensors).backward()
            return
        tensors = [tensors] if torch.is_tensor(tensors) else list(tensors)
        torch.autograd.backward([self._scaled(t) for t in tensors], grad_tensors)

    def scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` as backward takes it: divided by the @step's microbatches, loss-scaled in fp16."""
        if loss.dim() != 0:
            raise ValueError(f"model.backward expects a scalar loss, got shape {tuple(loss.shape)}; reduce it first "
                             "(e.g. loss.mean()) or pass its incoming gradients, model.backward(outputs, grads)")
        return self._scaled(loss)

    def _scaled(self, tensor: torch.Tensor) -> torch.Tensor:
        microbatch = self._microbatch
        if microbatch is not None and self.options.average_grads_across_microbatches and not self._hook_reduces:
            tensor = tensor / microbatch[1]
        if self.loss_scaler is not None:
            tensor = self.loss_scaler.scale(tensor)
        return tensor

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over every shard of every gradient; returns the norm before clipping."""
        if self._runtime.config.sharded_master_weights:
            raise RuntimeError("under ZeRO-1 in bf16/fp16 backward sends the gradients to fp32 master copies, "
                               "which optimizer.step() clips; set gradient_clipping in the config instead")
        return self._strategy.clip_grad_norm_(max_norm, self._runtime.device)

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerUpdate:
        """How `optimizer`, over this model's parameters, steps under its strategy (DistributedOptimizer's)."""
        return self._strategy.bind(optimizer, self.loss_scaler, self._runtime.device)

    def holds_any(self, params: list[torch.Tensor]) -> bool:
        """Some of `params` are this model's parameters."""
        held = {id(p) for p in self.get_module().parameters()}
        return any(id(p) in held for p in params)

    def replaced_any(self, params: list[torch.Tensor]) -> bool:
        """Some of `params` look like ones this model replaced when parallelizing (by id, shape and dtype: a
        tensor made later may reuse a freed original's id, so `holds_any` is asked first)."""
        return any(self.original_names.names_of(p) is not None for p in params)

    def wait_for_parameters(self) -> None:
        """Wait for parameter updates still in flight (ZeRO-1 overlaps them with the next forward)."""
        self._strategy.wait_for_parameters()

    # ----- DDP's methods, as SMP forwards them to its DistributedDataParallel -----

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True) -> ContextManager:
        """DDP's `join` context, for replicas with uneven numbers of batches; where the replicas are no DDP, a
        context that does nothing (sw.data_loader gives every replica as many batches)."""
        joined = self._strategy.join(divide_by_initial_world_size, enable)
        if joined is None:
            warn_ineffective([("DistributedModel.join()", ("uneven inputs need the replicas of plain data "
                               "parallelism (DDP); sw.data_loader gives every rank the same number of batches"))])
            return contextlib.nullcontext()
        return joined

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """DDP's communication hook: `hook(state, bucket)` reduces each gradient bucket, once per @step (after its
        last microbatch), and as in SMP averages over replicas and microbatches itself. Only with DDP replicas."""
        if not self._strategy.register_comm_hook(state, hook):
            warn_ineffective([("DistributedModel.register_comm_hook()", ("needs the replicas of plain data "
                               "parallelism (DDP); gradients are reduced as this layout does, without the hook"))])
            return
        self._hook_reduces = True

    def cpu(self) -> "DistributedModel":
        """Returns the model: its pieces stay where its parallelism placed them; `state_dict()` gathers every
        tensor whole onto the CPU, which is what SMP's `cpu()` did."""
        if self._runtime.device.type != "cpu":
            warn_ineffective([("DistributedModel.cpu()", ("the pieces stay on this rank's device; state_dict() "
                               "gathers every tensor whole onto the CPU"))])
        return self

    # ----- parameters, buffers and modules: this rank's, named as in the user's module -----

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        self.wait_for_parameters()
        return self.get_module().named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        self.wait_for_parameters()
        return self.get_module().parameters(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.get_module().named_buffers(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.get_module().buffers(recurse)

    def local_named_parameters(self, recurse: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters as held (DTensors where split or sharded; under a pipeline, its stages')."""
        return self.named_parameters(recurse=recurse)

    def local_parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.parameters(recurse)

    def local_named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.named_buffers(prefix, recurse)

    def local_buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.buffers(recurse)

    def local_named_modules(self, memo: Optional[set[nn.Module]] = None,
                            prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
        """This rank's modules (under a pipeline, without the stand-ins for other stages' modules)."""
        return ((name, module) for name, module in self.get_module().named_modules(memo, prefix)
                if not is_stand_in(module))

    def local_modules(self) -> Iterator[nn.Module]:
        return (module for _, module in self.local_named_modules())

    # ----- SMP's tensor-parallel queries -----

    def distributed_modules(self) -> Iterator[nn.Module]:
        """The modules tensor parallelism split: those holding a parameter or buffer split over "tp"."""
        return (module for module in self.local_modules()
                if any(_split_over_tp(t) for t in [*module.parameters(False), *module.buffers(False)]))

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """Split over the tensor-parallel ranks (a ZeRO shard is not)."""
        return _split_over_tp(param)

    def is_distributed_buffer(self, buf: torch.Tensor) -> bool:
        return _split_over_tp(buf)

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        """Computes on the tensor-parallel group's whole batch: under shardwise, with tensor_parallel_degree > 1
        every module does (the batch is gathered before the model), not only the split ones as in SMP."""
        return self._tensor_parallel and any(param is p for p in self.parameters())

    def is_scaled_batch_buffer(self, buf: torch.Tensor) -> bool:
        return self._tensor_parallel and any(buf is b for b in self.buffers())

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters whose gradients are averaged over the DP group: all without tensor parallelism."""
        return iter(()) if self._tensor_parallel else self.named_parameters()

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters whose gradients are averaged over the RDP group: all with tensor parallelism."""
        return self.named_parameters() if self._tensor_parallel else iter(())

    # ----- state dicts -----

    def state_dict(self, destination: Optional[dict[str, Any]] = None, prefix: str = "", keep_vars: bool = False,
                   cast_to_cpu: bool = True, gather_to_rank0: bool = False) -> dict[str, Any]:
        """The whole model, as SMP's: every parameter and buffer as a whole tensor, named as in the user's module
        (on the CPU unless `cast_to_cpu=False`; empty but on rank 0 with `gather_to_rank0`). Ranks holding
        different pieces gather them together (tensor-parallel, sharded and pipeline ranks all call it; plain
        replicas may call it alone). `keep_vars` is accepted: gathered tensors are new either way."""
        full = self.full_state_dict()
        if gather_to_rank0 and self._runtime.rank != 0:
            full = {}
        out = destination if destination is not None else OrderedDict()
        for name, value in full.items():
            out[prefix + name] = value.cpu() if cast_to_cpu else value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, same_partition_load: bool = False,
                        assign: bool = False):
        """Load a `state_dict()` (whole tensors, as a plain PyTorch model of the same class gives them too), a
        `local_state_dict()` saved on this layout (this rank's pieces) or a mix, deciding per tensor by its shape;
        under a pipeline each rank takes its stages' entries. SMP's `same_partition_load` is accepted: pieces always
        load where they are, without gathering. `strict` and `assign` as in torch."""
        self.wait_for_parameters()
        entries = {name: value for name, value in state_dict.items() if name not in SMP_MARKERS}
        unknown = sorted(set(entries) - self.state_keys)
        if strict and unknown:
            raise RuntimeError(f"load_state_dict: {len(unknown)} names are not in {self.module_class.__name__}'s "
                               f"state dict, e.g. {unknown[:3]}; load a state dict of this model, or pass strict=False")
        held = self.get_module().state_dict(keep_vars=True)  # keep_vars: the held tensors themselves, no copies
        mine = {name: _as_held(name, value, held[name]) for name, value in entries.items() if name in held}
        result = self.get_module().load_state_dict(mine, strict=strict, assign=assign)
        return result._replace(unexpected_keys=result.unexpected_keys + unknown)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers as plain tensors (its pieces of sharded or split ones; under a
        pipeline only its stages'), with SMP's `_smp_is_partial` marker; for `sw.save(..., partial=True)`."""
        self.wait_for_parameters()
        return {**local_tensors(self.get_module().state_dict()), "_smp_is_partial": True}

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers as held (DTensors where sharded or split), named as in the user's
        module: what a partial checkpoint writes (see shardwise.save_checkpoint)."""
        self.wait_for_parameters()
        return self._strategy.sharded_state_dict()

    def load_sharded_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.wait_for_parameters()
        self._strategy.load_sharded_state_dict(state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer as a whole tensor on every rank, named as in the user's module."""
        self.wait_for_parameters()
        return self._strategy.full_state_dict()

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load whole tensors (a `full_state_dict()`, or a plain PyTorch state dict of the user's module), the
        same on every rank, into this rank's shards and stages; `strict` as in `load_state_dict`."""
        self.wait_for_parameters()
        self._strategy.load_full_state_dict(state, strict)
