"""DeepSpeed's `PipelineModule` over shardwise's pipeline: its layers become the block list the core cuts.

    net = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 16), nn.ReLU(), lambda x: x * 2,
                                 LayerSpec(nn.Linear, 16, 4)], num_stages=2, loss_fn=nn.MSELoss())
    sw.init({**net.shardwise_config(), "microbatches": 4})   # pipeline_parallel_degree 2, placement PDT
    model = sw.DistributedModel(net)      # each rank keeps its stage's layers

Each entry of `layers` (a LayerSpec, a TiedLayerSpec, a module or a plain
callable) is built in order and held by a `PipelineModuleLayer` in the
`nn.ModuleList` `layers`: blocks of one type, which the core's block-list cut
(parallel/pipeline/partition.py) takes as the list to cut. `forward` runs them in
turn, as DeepSpeed's does. The stage boundaries are DeepSpeed's for the same
layers, `partition_method` and stages (partition.py here), handed to the core as
placements by hand (`set_partition` on every layer), so the core keeps them
rather than balancing by its own rule. Every layer is built on every rank (so its
initial values are those of one process, whatever the layout); the cut drops
the other stages' layers. A model built under `sw.delay_param_initialization()`
(or `torch.device("meta")`) is built without memory and each rank materialises
its own stage only.

What DeepSpeed does and shardwise does otherwise:

- TiedLayerSpecs of one key share one module; where its uses land on different
  stages the core keeps a copy per stage, equal at the start, their gradients
  summed after every step (parallel/pipeline/ties.py). The whole module is tied,
  every parameter of it, as in one process; DeepSpeed ties only `tied_weight_attr`
  across stages (it is checked here: each must name a parameter of the module).
- `activation_checkpoint_interval=k` recomputes every run of k consecutive layers
  of a stage as one region (the runs DeepSpeed forms: from each stage's first
  layer; `checkpointable_layers` and DeepSpeed's default rule, "a run holding a
  layer with parameters", choose which runs), through `activation_checkpoint_func`
  called as DeepSpeed calls it, `func(function, *inputs)`; the default is
  shardwise's checkpoint (`deepspeed.checkpointing.checkpoint`: torch's non-reentrant one, with
  shardwise's activation offloading), not DeepSpeed's reentrant one.
- What a stage's last layer returns goes to the next stage's first layer whole, a
  tensor or a tuple of tensors (as DeepSpeed sends it); other values cannot cross.
- `dynamic_shape` is accepted and changes nothing: torch's schedule learns the
  shapes stages send at the first step.
- Not provided: `mpu()` (DeepSpeed's PipelineParallelGrid; shardwise's mesh holds
  the groups: `sw.get_pp_process_group()` and friends), `allreduce_tied_weight_gradients`
  and `_synchronize_tied_weights` (the core does both), the per-layer checkpoint files
  (`save_state_dict`, `load_state_dir`, `ckpt_*`: shardwise checkpoints whole models).
"""

from __future__ import annotations

import functools
import os
import random
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...parallel.pipeline.placement import set_partition
from ...parallel.pipeline.stage import SENDS_WHOLE_OUTPUT
from ..checkpointing import checkpoint
from .partition import method_weights, partition_layers
from .spec import LayerSpec, TiedLayerSpec
from .topology import PipeDataParallelTopology, ProcessTopology, layout_problem


class PipelineModuleLayer(nn.Module):
    """Layer `index` of a PipelineModule: a module (`module`), a tied module's use (`forward_fn(module, x)`), or
    a plain callable (`function`). The pipeline cut places these as blocks; hooks on them (the stage's, data
    parallelism's) run around `forward`, whose `run`, when given, computes the output instead (the module's
    forward passes a checkpointed run of layers starting at this one)."""

    def __init__(self, index: int, name: str, module: Optional[nn.Module] = None,
                 forward_fn: Optional[Callable] = None, function: Optional[Callable] = None, tied: Any = None):
        super().__init__()
        self.index = index
        self.name = name  # the class or function name DeepSpeed prints
        if module is not None:
            self.module = module
        self.forward_fn = forward_fn
        self.function = function
        self.tied = tied  # the TiedLayerSpec key, or None

    @property
    def func(self) -> Callable:
        """What DeepSpeed keeps in `forward_funcs` for this layer."""
        if self.function is not None:
            return self.function
        return self.module if self.forward_fn is None else functools.partial(self.forward_fn, self.module)

    def compute(self, x: Any) -> Any:
        if self.function is not None:
            return self.function(x)
        return self.module(x) if self.forward_fn is None else self.forward_fn(self.module, x)

    def forward(self, x: Any, run: Optional[Callable[[Any], Any]] = None) -> Any:
        return self.compute(x) if run is None else run(x)

    def extra_repr(self) -> str:
        if self.function is not None:
            return f"{self.index}: {self.name}"
        return f"{self.index}" + (f", tied {self.tied!r}" if self.tied is not None else "")


# A stage's last layer sends the next stage its whole output, a tuple of tensors too, as DeepSpeed's stages do.
setattr(PipelineModuleLayer, SENDS_WHOLE_OUTPUT, True)


def _world() -> tuple[int, int]:
    """(rank, world size): the process group's, else the launcher's environment, else one process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _set_random_seed(seed: int) -> None:
    """DeepSpeed's `set_random_seed`: Python's, numpy's and torch's generators."""
    random.seed(seed)
    try:
        import numpy
        numpy.random.seed(seed % (2 ** 32))
    except ImportError:
        pass
    torch.manual_seed(seed)


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _tied_attr(module: nn.Module, attr: str) -> Any:
    value = module
    for part in attr.split("."):
        value = getattr(value, part, None)
    return value


def _counted(specs: list[Any]) -> list[int]:
    """Each layer's trainable parameters as DeepSpeed's `_count_layer_params` finds them: a LayerSpec (tied ones
    too) built once and dropped, a module's own, 0 for a callable."""
    counts = []
    for layer in specs:
        if isinstance(layer, LayerSpec):
            counts.append(_trainable(layer.build()))
        else:
            counts.append(_trainable(layer) if isinstance(layer, nn.Module) else 0)
    return counts


class PipelineModule(nn.Module):
    """A sequence of layers run in order, cut into `num_stages` pipeline stages where DeepSpeed cuts it.

    `forward(x)` is `for layer in layers: x = layer(x)` over the layers this rank
    holds (all of them on one process). `loss_fn(outputs, labels)` is what the
    engine computes the loss with. See the module docstring for what shardwise
    does where DeepSpeed does otherwise.
    """

    _no_split_modules = ["PipelineModuleLayer"]  # the core's cut and sharding units take these as the blocks

    def __init__(self, layers: Iterable[Any], num_stages: Optional[int] = None,
                 topology: Optional[ProcessTopology] = None, loss_fn: Optional[Callable] = None,
                 seed_layers: bool = False, seed_fn: Optional[Callable[[int], Any]] = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = checkpoint, checkpointable_layers: Optional[list] = None,
                 dynamic_shape: bool = False):
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("PipelineModule: must provide num_stages or topology; fix: pass num_stages=<the "
                               "pipeline degree>")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError("PipelineModule: checkpointable_layers must be a list of layer class names, got "
                            f"{type(checkpointable_layers).__name__}; fix: pass a list, or None")
        self.set_checkpoint_interval(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.micro_offset = 0
        self.checkpointable_layers = checkpointable_layers
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.dynamic_shape = dynamic_shape
        self.global_rank, self.world_size = _world()
        self._topo = self._topology(num_stages, topology)
        self.num_stages = self._topo.get_dim("pipe")
        specs = list(layers)
        if not specs:
            raise ValueError("PipelineModule: the layer list is empty; fix: pass the model's layers (LayerSpecs, "
                             "modules or callables) in the order the forward runs them")
        if self.num_stages > len(specs):
            raise ValueError(f"PipelineModule: {len(specs)} layers cannot fill num_stages={self.num_stages} stages "
                             f"of at least one layer each; fix: use num_stages of at most {len(specs)}")
        self._num_layers = len(specs)
        if self.global_rank == 0:
            seed_name = getattr(seed_fn, "__name__", None)
            print(f"SEED_LAYERS={seed_layers} BASE_SEED={base_seed} SEED_FN={seed_name}", flush=True)
        self.tied_weight_attrs: dict[Any, list[str]] = {}
        # DeepSpeed counts the parameters of 'parameters' partitioning by building every LayerSpec once first, which
        # draws from torch's generator: doing the same gives the model DeepSpeed's initial values.
        counts = _counted(specs) if str(partition_method).lower() == "parameters" else None
        self.layers = nn.ModuleList(self._build(specs))
        # After the layers: a loss module holding parameters is then what the core's cut keeps on the last stage.
        self.loss_fn = loss_fn
        self.parts = self._partition(specs, partition_method, counts)
        for layer in self.layers:
            set_partition(layer, self.stage_owner(layer.index))  # the core cuts here (placement by hand)
        if self.global_rank == 0:
            self._print_partition(partition_method)

    # -- construction ------------------------------------------------------------------------------------

    def _topology(self, num_stages: Optional[int], topology: Optional[ProcessTopology]) -> ProcessTopology:
        """The given topology (which wins over num_stages, as in DeepSpeed), else pipe × data over the world."""
        if topology is not None:
            if topology.get_dim("pipe") < 1:
                raise ValueError(f"PipelineModule: the topology has no 'pipe' axis (axes {topology.get_axis_names()}); "
                                 "fix: use PipeDataParallelTopology or PipeModelDataParallelTopology")
            if topology.world_size() != self.world_size:
                raise ValueError(f"PipelineModule: the topology spans {topology.world_size()} ranks "
                                 f"({dict(zip(topology.axes, topology.dims))}) but the world has {self.world_size}; "
                                 "fix: give a topology whose dims multiply to the world size")
            problem = layout_problem(topology)
            if problem:
                raise ValueError(f"PipelineModule: {problem}; fix: use PipeDataParallelTopology or "
                                 "PipeModelDataParallelTopology")
            return topology
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"PipelineModule: num_stages must be a positive int, got {num_stages!r}; fix: pass "
                             "the pipeline degree")
        if self.world_size % num_stages:
            raise RuntimeError(f"PipelineModule: num_stages ({num_stages}) must divide the world size "
                               f"({self.world_size}); fix: launch a multiple of {num_stages} processes, or pass a "
                               f"num_stages that divides {self.world_size}"
                               + (" (1 on one process)" if self.world_size == 1 else ""))
        return PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)

    def _seed(self, seed: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(seed)
        else:
            _set_random_seed(seed)

    def _build(self, specs: list[Any]) -> list[PipelineModuleLayer]:
        """One PipelineModuleLayer per entry, built in order (TiedLayerSpecs' module at the key's first use)."""
        built: list[PipelineModuleLayer] = []
        tied: dict[Any, tuple[int, TiedLayerSpec, nn.Module]] = {}
        for index, layer in enumerate(specs):
            if self.seed_layers:
                self._seed(self.base_seed + index)
            if isinstance(layer, PipelineModule):
                raise ValueError(f"PipelineModule: layer {index} is a PipelineModule, whose stages cannot nest in "
                                 "another's (DeepSpeed refuses it too); fix: pass its layers instead")
            if isinstance(layer, nn.Module):
                built.append(PipelineModuleLayer(index, type(layer).__name__, module=layer))
            elif isinstance(layer, TiedLayerSpec):
                if layer.key not in tied:
                    module = layer.build()
                    self._check_tied_attrs(layer, module)
                    tied[layer.key] = (index, layer, module)
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                first, spec, module = tied[layer.key]
                if layer.typename is not spec.typename:
                    raise ValueError(f"PipelineModule: TiedLayerSpec key {layer.key!r} is {spec.typename.__name__} at "
                                     f"layer {first} and {layer.typename.__name__} at layer {index}, but one key is "
                                     "one module; fix: give the same typename, or a different key")
                built.append(PipelineModuleLayer(index, layer.typename.__name__, module=module,
                                                 forward_fn=layer.forward_fn, tied=layer.key))
            elif isinstance(layer, LayerSpec):
                built.append(PipelineModuleLayer(index, layer.typename.__name__, module=layer.build()))
            elif callable(layer):
                built.append(PipelineModuleLayer(index, getattr(layer, "__name__", type(layer).__name__),
                                                 function=layer))
            else:
                raise TypeError(f"PipelineModule: layer {index} is a {type(layer).__name__}, which is neither a "
                                "LayerSpec, a module nor a callable; fix: pass one of those")
        return built

    @staticmethod
    def _check_tied_attrs(spec: TiedLayerSpec, module: nn.Module) -> None:
        for attr in spec.tied_weight_attr:
            if not isinstance(_tied_attr(module, attr), torch.Tensor):
                names = ", ".join(name for name, _ in module.named_parameters())
                raise ValueError(f"PipelineModule: TiedLayerSpec {spec.key!r}: tied_weight_attr {attr!r} names no "
                                 f"weight of {spec.typename.__name__} (it has {names or 'none'}); "
                                 "fix: name one of those")

    def _partition(self, specs: list[Any], method: Any, counts: Optional[list[int]]) -> list[int]:
        """DeepSpeed's boundaries for `method` (see partition.py): a layer's weight is its trainable parameters
        ('parameters', `counts`) or whether its class name matches ('type:')."""
        if counts is None:
            counts = [_trainable(layer.module) if isinstance(spec, (LayerSpec, nn.Module)) else 0
                      for spec, layer in zip(specs, self.layers)]
        names = []
        for spec in specs:
            if isinstance(spec, LayerSpec):
                names.append(spec.typename.__name__)
            elif isinstance(spec, nn.Module):
                names.append(type(spec).__name__)
            else:
                names.append(getattr(spec, "__name__", None))
        self.partition_method, weights = method_weights(method, counts, names)
        return partition_layers(weights, len(specs), self.num_stages)

    def _print_partition(self, method: str) -> None:
        """What DeepSpeed prints on rank 0: each stage's layers by class name, and the loss."""
        lines = [f"Partitioning pipeline stages with method {method}"]
        for stage in range(self.num_stages):
            start, stop = self.parts[stage], self.parts[stage + 1]
            lines.append(f"stage={stage} layers={stop - start}")
            lines += [f"    {layer.index:2d}: {layer.name}" for layer in list(self.layers)[start:stop]]
        if self.loss_fn is not None:
            lines.append(f"  loss: {getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}")
        print("\n".join(lines), flush=True)

    # -- running -----------------------------------------------------------------------------------------

    def forward(self, forward_input: Any) -> Any:
        self.micro_offset += 1
        offset = self.micro_offset + 1  # DeepSpeed's per-microbatch seed offset (seed_layers)
        layers = list(self.layers)  # this rank's: the pipeline cut keeps only its stage's layers
        x = forward_input
        for group, checkpointable in self._groups(layers):
            if not checkpointable:
                for layer in group:
                    x = layer(x, run=self._one(layer, offset))
                continue
            run = self._range(group, offset)
            # The region is entered inside the first layer's forward, after the hooks on its call: the stage's
            # hook there swaps in what the previous stage sent, which a recomputation could not swap in again.
            x = group[0](x, run=lambda v: self.activation_checkpoint_func(run, *(v if isinstance(v, tuple) else (v,))))
        return x

    def _one(self, layer: PipelineModuleLayer, offset: int) -> Callable[[Any], Any]:
        def run(x: Any) -> Any:
            if self.seed_layers:
                self._seed(self.base_seed * offset + layer.index)
            return layer.compute(x)
        return run

    def _range(self, group: list[PipelineModuleLayer], offset: int) -> Callable[..., Any]:
        """DeepSpeed's `exec_range_func` for a checkpointed run: the first layer computes inside its own forward
        (already running); the others are called, so the hooks on them (data parallelism's) run in the region."""
        def exec_func(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            x = self._one(group[0], offset)(x)
            for layer in group[1:]:
                x = layer(x, run=self._one(layer, offset))
            return x
        return exec_func

    def _groups(self, layers: list[PipelineModuleLayer]) -> list[tuple[list[PipelineModuleLayer], bool]]:
        """Runs of `activation_checkpoint_interval` layers from this stage's first, and whether each is
        checkpointed (DeepSpeed's `_is_checkpointable`); every layer alone and plain without checkpointing."""
        k = self.activation_checkpoint_interval
        if k == 0:
            return [([layer], False) for layer in layers]
        groups = [layers[i:i + k] for i in range(0, len(layers), k)]
        return [(group, self._is_checkpointable([layer.func for layer in group])) for group in groups]

    def _is_checkpointable(self, funcs: list[Callable]) -> bool:
        """DeepSpeed's rule: Megatron's GPT pipes checkpoint their transformer layers (and the listed classes);
        otherwise the classes in `checkpointable_layers` when given, else any run holding a layer with parameters."""
        if type(self).__name__ in ("GPTModelPipe", "GPT2ModelPipe"):
            return all("ParallelTransformerLayerPipe" in type(f).__name__ or (
                self.checkpointable_layers is not None and type(f).__name__ in self.checkpointable_layers)
                for f in funcs)
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, nn.Module))

    def set_checkpoint_interval(self, interval: int) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"PipelineModule: activation_checkpoint_interval must be an int of 0 or more (layers "
                             f"per recomputed run, 0 for none), got {interval!r}")
        self.activation_checkpoint_interval = interval

    # -- DeepSpeed's queries -----------------------------------------------------------------------------

    @property
    def stage_id(self) -> int:
        """This rank's pipeline stage: shardwise's pp rank once `sw.init` has run, else the topology's."""
        from ...runtime.state import is_initialized
        if is_initialized():
            from ...runtime.ranks import pp_rank
            return pp_rank()
        return self._topo.get_coord(self.global_rank).pipe

    def shardwise_config(self) -> dict[str, Any]:
        """The shardwise config keys this module implies: its stages as `pipeline_parallel_degree`, the topology's
        'model' axis as `tensor_parallel_degree`, and `placement_strategy` PDT, which numbers the ranks as
        DeepSpeed's topologies do (pipe, data, model, outermost first), so `topology()` and `stage_id` agree
        with shardwise's ranks."""
        keys: dict[str, Any] = {"pipeline_parallel_degree": self.num_stages, "placement_strategy": "PDT"}
        if self._topo.get_dim("model") > 1:
            keys["tensor_parallel_degree"] = self._topo.get_dim("model")
        return keys

    def topology(self) -> ProcessTopology:
        """The ProcessTopology that maps ranks to (pipe, data[, model]) coordinates."""
        return self._topo

    def num_pipeline_stages(self) -> int:
        return self._topo.get_dim("pipe")

    def partitions(self) -> list[int]:
        """The stage boundaries: stage s holds layers `parts[s]:parts[s + 1]`."""
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise IndexError(f"PipelineModule: layer {layer_idx} is outside 0 to {self._num_layers - 1}")
        return next(s for s in range(self.num_stages) if self.parts[s] <= layer_idx < self.parts[s + 1])

    @property
    def forward_funcs(self) -> list[Callable]:
        """The layers this rank runs, as DeepSpeed lists them (modules, tied uses as partials, callables)."""
        return [layer.func for layer in self.layers]

    @property
    def tied_modules(self) -> dict[Any, nn.Module]:
        """Each TiedLayerSpec key's module, for the keys this rank's layers use."""
        return {layer.tied: layer.module for layer in self.layers if layer.tied is not None}

    def get_additional_losses(self) -> Optional[dict]:
        """Model-specific losses to report besides the loss (DeepSpeed's hook for subclasses): none."""
        return None
