"""Pipelines for any module torch can capture, cut at the first @step (as SMP v1 traced at its first step).

A model without a list of repeated blocks (a CNN of two sub-networks, BERT's
masked-LM head reading the word embedding) is cut from its module graph: at the
first @step the step function runs up to its `model(...)` call, which gives one
microbatch's inputs; `graph_cut.py` chooses module boundaries balanced by compute
and memory; `torch.distributed.pipelining.pipeline` captures the forward with
torch.export and splits it there; each rank keeps its stage's graph module (the
model's own parameters, under their names) and runs it under the schedule like a
block-list stage. Until then the whole model sits on every rank, so its state
dicts and a checkpoint loaded before the first step are the whole model's, and
the optimizers bound to it are bound again to this rank's stage. With several
stages per rank (the interleaved and zero-bubble schedules) a rank keeps each of
its stages, and they read as one module under the model's names.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from ...parallel.param_mapping import adopt_model_parameters
from ..mesh import ParallelMesh
from ...torch_internals import FakeTensorMode, tensor_tables, tree_map_only
from ..local import local_tensor
from ..materialize import mesh_device, place
from ..stage_split import stage_ranks
from ..strategy import OptimizerUpdate, Pieces, Strategy
from ..tensor import PlanLike
from ..recompute.apply import lift_checkpointing, restore_checkpointing
from .calls import capture
from .graph_cut import captured, cut_graph
from .graph_stage import GraphStage, Wiring, join_stages
from .graph_tensor import GraphTensorParallel
from .runner import PipelineParallel, StageModules
from .schedule import SPLIT_BACKWARD
from .settings import PipelineSettings
from .ties import TiedWeights

def _capture_copy(model: nn.Module, inputs: dict[str, Any], dtype: Optional[torch.dtype]) -> tuple[nn.Module, dict]:
    """`model` and one microbatch's `inputs` as fake tensors (no memory) on their devices, floating parameters and
    inputs in `dtype` (None: as they are), as a stage computes: torch.export bakes the capture's dtypes and devices
    into the graph (checks and casts), so it must see what the run sees. A copy, so no weight is rounded and the
    model's tensors keep no reference from the capture (ZeRO-1's `torch.utils.swap_tensors` refuses one). Each input is a tensor of its own (a tensor passed twice,
    labels=input_ids, would be captured as one)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = [(p, local_tensor(p)) for p in model.parameters()]  # a split weight: this tensor-parallel rank's shard

    def fake(value: torch.Tensor, cast: bool) -> torch.Tensor:  # made from the shape: converting leaves a weakref
        into = dtype if cast and dtype is not None and value.is_floating_point() else value.dtype
        return torch.empty_strided(value.shape, value.stride(), dtype=into, device=value.device)

    with mode:
        memo: dict[int, Any] = {id(t): fake(t, cast=False) for t in model.buffers()}  # buffers keep their dtype
        memo.update({id(p): nn.Parameter(fake(local, cast=True), p.requires_grad) for p, local in params})
        faked = tree_map_only(torch.Tensor, lambda t: fake(t, cast=True), inputs)
    return copy.deepcopy(model, memo), faked


class _DeferredUpdate:
    """An optimizer's update, bound to its model's stage once the first @step has cut the pipeline."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any, device: torch.device):
        self.optimizer, self.scaler, self.device = optimizer, scaler, device
        self.target: Optional[OptimizerUpdate] = None

    def zero_grad(self, set_to_none: bool) -> None:
        (self.target or self.optimizer).zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        if self.target is not None:
            self.target.synchronize()

    def after_backward_passes(self) -> None:
        if self.target is not None:
            self.target.after_backward_passes()

    def __getattr__(self, name: str) -> Any:
        if self.__dict__.get("target") is None:
            raise RuntimeError(f"optimizer.{name.lstrip('_')}: this model's pipeline is cut from its module graph at "
                               "the first @step, and the optimizer is bound to this rank's stage then; fix: call it "
                               "after the first @step (load checkpoints of the model before it, of the optimizer "
                               "after it)")
        return getattr(self.target, name)


class GraphPipeline(Strategy):
    """The whole model until the first @step; then `PipelineParallel` over this rank's stage of its graph."""

    runs_whole_step = True

    def __init__(self, model: nn.Module, mesh: ParallelMesh, settings: PipelineSettings, wrap_part: Callable,
                 zero1: Optional[Callable[[frozenset[int]], Any]] = None, tp_plan: PlanLike = None):
        """`wrap_part`: the composition's per-part step; `zero1`: ZeRO-1's binding given the tied copies whose
        gradients the pipeline sums itself (None without ZeRO-1); `tp_plan`: the user's tensor-parallel plan."""
        place(model, mesh)
        super().__init__(StageModules([]), model)
        self.mesh, self.settings, self.wrap_part, self.zero1 = mesh, settings, wrap_part, zero1
        self.built: Optional[PipelineParallel] = None
        self.tensor = GraphTensorParallel(mesh["tp"], tp_plan, settings.prescaled_batch)  # split at the cut
        self._deferred: list[_DeferredUpdate] = []

    def microbatch_context(self, last: bool) -> ContextManager:
        return self.loss_context()  # never entered by @step: the first one cuts the pipeline, which runs it all

    def stage_modules(self) -> Optional[list[nn.Module]]:
        return []  # none until the first @step cuts the graph

    def settled(self) -> Strategy:
        """After the first @step, the stage's pipeline, which answers for the model from then on."""
        return self.built or self

    def bind(self, optimizer: torch.optim.Optimizer, scaler: Any, device: torch.device) -> Any:
        update = _DeferredUpdate(optimizer, scaler, device)
        self._deferred.append(update)
        return update

    def run_step(self, model: nn.Module, fn: Callable, pieces: Pieces, around: Callable[[int], ContextManager],
                 counted: Callable[[int], ContextManager]) -> list[Any]:
        self._build(model, fn, pieces)  # the first @step only: later ones go to the built pipeline
        return self.built.run_step(model, fn, pieces, around, counted)

    def _build(self, model: Any, fn: Callable, pieces: Pieces) -> None:
        """Cut, capture and keep this rank's stages; bind the optimizers to them; let the whole model go."""
        whole, mesh = self.inner, self.mesh
        signature = inspect.signature(whole.forward)  # not the bound method: it would keep the whole model alive
        checkpointed = lift_checkpointing(whole)  # captured plain; set again on this rank's stage
        pipe, cut, ranks = self._captured_pipe(whole, capture(fn, model, signature, *pieces[0]))
        local = [stage for stage, rank in enumerate(ranks) if rank == mesh["pp"].get_local_rank()]
        wiring = Wiring(pipe.split_gm)
        modules = [pipe.get_stage_module(stage) for stage in local]
        _as_in_model(modules, whole)
        for module in modules:
            self.tensor.adopt(module)
            restore_checkpointing(module, checkpointed)
        inner = join_stages(modules)
        self.tensor.mark_output(inner)
        tied = _tied_groups(pipe.replicated_params, wiring.module_names)
        _refuse_copies_on_one_rank_with_replicas(tied, ranks, mesh.layout.dp, self.settings.schedule)
        ties = TiedWeights(inner, tied, local)
        ties.connect(mesh.layout, dist.get_rank(), ranks, self.settings.group_timeout)
        ties.broadcast_values()
        stages = [GraphStage(module, wiring, stage, cut) for module, stage in zip(modules, local)]
        for stage in stages:
            self.tensor.install(stage, stage.is_last)
        self.built = self._runner(inner, stages, ties, signature)
        # The whole model goes (the other stages' parameters are freed with it); until the API layer takes the
        # settled strategy after this step, this one shows the stage's modules.
        self.inner, self.module, self.holds_loss = self.built.inner, self.built.module, self.built.holds_loss
        model.module = self.built.module
        held = dict(model.named_parameters(remove_duplicate=False))
        for update in self._deferred:
            adopt_model_parameters(update.optimizer, model.original_names, held)
            update.target = self.built.bind(update.optimizer, update.scaler, update.device)

    def _captured_pipe(self, whole: nn.Module, inputs: dict[str, Any]) -> tuple[Any, Any, list[int]]:
        """torch's split of `whole` at the cut the cost model chose (printed on rank 0), the cut, and the pp rank of
        each stage."""
        settings, pp = self.settings, self.mesh["pp"].size()
        stages = pp * settings.stages_per_rank
        ranks = stage_ranks(settings.schedule, pp, stages)
        inputs = self.tensor.gathered(inputs)
        cut = cut_graph(whole, inputs, stages, settings.memory_weight, settings.auto_partition,
                        settings.default_partition, ranks)
        if dist.get_rank() == 0:
            print(cut.describe(ranks), flush=True)
        self.tensor.split(whole)
        fake_model, fake_inputs = _capture_copy(whole, inputs, settings.stage_dtype)
        self.tensor.capturable(fake_model, whole, inputs)
        pipe = captured(whole, "export", lambda: pipeline(
            fake_model, mb_args=(), mb_kwargs=fake_inputs,
            split_spec={point: SplitPoint.BEGINNING for point in cut.split_points}))
        if pipe.num_stages != stages:
            raise RuntimeError(f"torch split {type(whole).__name__} into {pipe.num_stages} stages at "
                               f"{list(cut.split_points)}, not {stages}: a split module is not called on the "
                               "forward's main path; fix: place modules by hand (sw.set_partition) at other modules")
        return pipe, cut, ranks

    def _runner(self, inner: nn.Module, stages: list[GraphStage], ties: TiedWeights,
                signature: inspect.Signature) -> PipelineParallel:
        """Each stage wrapped as the composition wraps a part, all under the configured schedule; `inner` reads
        them as one module."""
        settings, pp_mesh = self.settings, self.mesh["pp"]
        wrapped = []
        for stage in stages:
            strategy = self.wrap_part(stage, reshard_after_forward=settings.schedule not in SPLIT_BACKWARD)
            stage.precision = strategy.autocast or stage.precision
            wrapped.append(strategy.module)
        binding = self.zero1(deferred=ties.held()) if self.zero1 is not None else None
        total, device = pp_mesh.size() * settings.stages_per_rank, mesh_device(self.mesh)
        return PipelineParallel(inner, stages, wrapped, ties, pp_mesh.get_group(), settings.schedule, total,
                                settings.round, device, signature=signature, binding=binding)


def _refuse_copies_on_one_rank_with_replicas(tied: list[tuple[list[str], list[int]]], ranks: list[int], dp: int,
                                             schedule: str) -> None:
    """A weight tied across two stages of one rank trains wrong with data parallelism (its second copy's gradient
    comes back zero), so that is refused, on every rank alike, until it is fixed."""
    for names, stages in tied:
        by_rank: dict[int, set[int]] = defaultdict(set)
        for stage in stages:
            by_rank[ranks[stage]].add(stage)
        on_rank = max(by_rank.values(), key=len)
        if dp > 1 and len(on_rank) > 1:
            raise ValueError(f"pipeline parallelism: {names[0]} is tied to {', '.join(names[1:])} on stages "
                             f"{sorted(on_rank)} of one rank under pipeline_schedule {schedule}, which does not "
                             f"train with the same math under data parallelism (degree {dp}) yet; fix: use a "
                             "schedule that places those stages on different ranks (interleaved_1f1b, "
                             "interleaved_zero_bubble, 1f1b), or untie the weights")


def _tied_groups(replicated: list[dict[str, str]], stage_modules: list[str]) -> list[tuple[list[str], list[int]]]:
    """torch's record of parameters several stages use ({stage module: name there}) as TiedWeights' groups."""
    return [([uses[m] for m in stage_modules if m in uses], [k for k, m in enumerate(stage_modules) if m in uses])
            for uses in replicated]


def _as_in_model(stages: list[nn.Module], whole: nn.Module) -> None:
    """Give this rank's stages (captured from a meta copy) the model's own tensors, under every name each has in
    the model, and their buffers the model's persistence, so their state dicts read as the model's. torch keeps one
    name per tensor and turns non-persistent buffers persistent; a parameter several stages use is one tensor on
    each, under every name, as in the model, but for a name another of these stages computes with: that one is
    the other stage's (its copy of a tied weight)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, tensor in [*whole.named_parameters(remove_duplicate=False), *whole.named_buffers(remove_duplicate=False)]:
        names[id(tensor)].append(name)
    computed = [[name for name, _ in [*stage.named_parameters(remove_duplicate=False),
                                      *stage.named_buffers(remove_duplicate=False)]] for stage in stages]
    for stage, own in zip(stages, computed):
        others = {name for other in computed if other is not own for name in other} - set(own)
        _take_model_tensors(stage, whole, own, {id_: [n for n in aliases if n not in others]
                                                for id_, aliases in names.items()})


def _take_model_tensors(stage: nn.Module, whole: nn.Module, own: list[str], names: dict[int, list[str]]) -> None:
    """`_as_in_model` for one stage computing with the tensors named `own`; `names`: each model tensor's names."""
    for name in own:
        original = _tensor(whole, name)
        for alias in names[id(original)] if original is not None else []:
            path, _, leaf = alias.rpartition(".")
            owner = _module_at(stage, path)
            if isinstance(original, nn.Parameter):
                setattr(owner, leaf, original)
            else:
                persistent = leaf not in tensor_tables(whole.get_submodule(path))[2]
                owner.register_buffer(leaf, original, persistent=persistent)
    made = [name for name, t in [*stage.named_parameters(), *stage.named_buffers()] if id(t) not in names]
    if made:
        raise RuntimeError(f"pipeline parallelism captured {type(whole).__name__}'s forward with a tensor it makes "
                           f"itself ({made[0]}), which the stage cannot recompute; fix: register it as a buffer of "
                           "the module (register_buffer), or set pipeline_cut: blocks")


def _tensor(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    path, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(path)
    except AttributeError:
        return None
    parameters, buffers, _ = tensor_tables(owner)
    return parameters.get(leaf, buffers.get(leaf))


def _module_at(root: nn.Module, path: str) -> nn.Module:
    """The submodule at `path`, made (empty) where the stage has none: a name's owner in the model."""
    module = root
    for part in filter(None, path.split(".")):
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    return module

