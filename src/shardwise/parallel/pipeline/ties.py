"""Tied weights whose modules land on different stages (GPT-2's token embedding and LM head).

Every stage that uses a tied weight keeps its own copy (as Megatron-LM does for
the embedding): the copies start equal (the stage that owns the weight first
broadcasts it), their gradients are summed across the stages after every step,
so every copy takes the same optimizer step the single tied weight would.
Copies on one rank (virtual stages) are summed locally first.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...topology import Layout
from ..local import local_tensor
from ..tensor.rules import tied_parameters
from .partition import Partition


def stage_of(part: Partition, name: str) -> int:
    """The stage holding parameter `name` (a dotted name of the unsplit model)."""
    prefix = part.blocks.path + "."
    if name.startswith(prefix):
        index = int(name[len(prefix):].split(".")[0])
        return next(s for s, (start, stop) in enumerate(part.bounds) if start <= index < stop)
    if any(name.startswith(p + ".") for p in part.blocks.before):
        return 0
    return part.stages - 1


def tied_groups(model: nn.Module, part: Partition) -> list[tuple[list[str], list[int]]]:
    """The weights of `model` tied across the stages of `part`: their names, and the stage of each name."""
    found = []
    for names in tied_parameters(model):
        stages = [stage_of(part, n) for n in names]
        if len(set(stages)) > 1:
            found.append((names, stages))
    return found


class _Group:
    """One tied weight: the names, the stages they land on, and where this rank's copies are."""

    def __init__(self, names: list[str], stages: list[int]):
        self.names = names
        self.stages = stages  # stage of each name
        self.local: dict[int, str] = {}  # local stage -> a name of its copy
        self.group: Optional[dist.ProcessGroup] = None
        self.source = 0  # global rank holding the owner's copy in this rank's group


def _check_names_per_stage(group: _Group, local: list[int]) -> None:
    """A copy per local stage needs a name per local stage: the one tensor a name holds cannot be two copies."""
    users: dict[str, int] = {}
    for name, stage in zip(group.names, group.stages):
        if stage in local and users.setdefault(name, stage) != stage:
            raise ValueError(f"pipeline parallelism: {name} is used by stages {users[name]} and {stage}, which run "
                             "on one rank, so it cannot hold a copy for each; fix: use a pipeline_schedule with one "
                             "stage per rank (gpipe or 1f1b)")


class TiedWeights:
    """This rank's copies of tied weights that span stages.

    Copies are looked up by name on every use: tensor parallelism and sharding
    replace the parameter objects after the weights are untied here.
    """

    def __init__(self, model: nn.Module, groups: list[tuple[list[str], list[int]]], local: list[int]):
        """`groups`: each tied weight's names and the stage of each name (`tied_groups`); `model` holds this
        rank's `local` stages."""
        self.model = model
        self.groups = [_Group(names, stages) for names, stages in groups]
        for group in self.groups:
            _check_names_per_stage(group, local)
            copies: dict[int, nn.Parameter] = {}
            several = len({stage for stage in group.stages if stage in local}) > 1
            for name, stage in zip(group.names, group.stages):
                if stage not in local:
                    continue
                if stage not in copies:
                    # One local stage keeps the parameter object it holds. Several each get a new one, so an
                    # optimizer built on the model's tied weight is given every copy (it is found by its names).
                    first = next(iter(copies.values()), None)
                    held = model.get_parameter(name) if first is None else first
                    copies[stage] = nn.Parameter(held.detach().clone(), held.requires_grad) if several else held
                    group.local[stage] = name
                path, _, pname = name.rpartition(".")
                setattr(model.get_submodule(path), pname, copies[stage])

    def _copies(self, group: _Group) -> list[nn.Parameter]:
        return [self.model.get_parameter(name) for name in group.local.values()]

    def connect(self, layout: Layout, rank: int, stage_ranks: list[int], timeout: Optional[timedelta]) -> None:
        """Make a process group per tied weight over the pp ranks holding it (every rank must call this), with the
        collectives' `timeout`."""
        for group in self.groups:
            holders = sorted({stage_ranks[s] for s in group.stages})
            owner = stage_ranks[group.stages[0]]
            for line in layout.groups("pp"):  # one line of pp ranks per (dp, tp) coordinate
                members = [line[r] for r in holders]
                handle = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
                if rank in line:
                    group.group, group.source = handle, line[owner]

    @torch.no_grad()
    def broadcast_values(self) -> None:
        """Every copy takes the value of the owning stage's copy."""
        for group in self.groups:
            copies = self._copies(group)
            if not copies:
                continue
            if group.group is not None:
                dist.broadcast(local_tensor(copies[0]), src=group.source, group=group.group)
            for copy in copies[1:]:
                local_tensor(copy).copy_(local_tensor(copies[0]))

    def set_aside(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Take the gradients earlier @steps left in the copies out of them (`add_back` returns them), so that
        `sum_grads` sums this step's alone: those were summed already, and summing them again counts them twice
        (gradients accumulated over several @steps before an optimizer step)."""
        earlier = [(copy, copy.grad) for group in self.groups for copy in self._copies(group) if copy.grad is not None]
        for copy, _ in earlier:
            copy.grad = None
        return earlier

    @staticmethod
    @torch.no_grad()
    def add_back(earlier: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        for copy, grad in earlier:
            copy.grad = grad if copy.grad is None else grad.add_(copy.grad)

    @torch.no_grad()
    def sum_grads(self, held: Callable[[nn.Parameter], Optional[torch.Tensor]] = lambda copy: None) -> None:
        """Each copy's gradient becomes the sum over all copies: the tied weight's gradient. `held(copy)`: what
        stands for a copy's gradient where its optimizer keeps it apart (ZeRO-1's fp32 local sum), else None."""
        for group in self.groups:
            copies = self._copies(group)
            if not copies:
                continue
            grads = [held(copy) for copy in copies]
            for i, copy in enumerate(copies):
                if grads[i] is not None:
                    continue
                if copy.grad is None:
                    copy.grad = torch.zeros_like(copy)
                elif isinstance(copy.grad, DTensor) and copy.grad.placements != copy.placements:
                    # e.g. a vocabulary-parallel embedding's gradient comes back replicated
                    copy.grad = copy.grad.redistribute(copy.device_mesh, copy.placements)
                grads[i] = local_tensor(copy.grad)
            total = grads[0].clone()
            for grad in grads[1:]:
                total += grad.view_as(total)
            if group.group is not None:
                dist.all_reduce(total, group=group.group)
            for grad in grads:
                grad.copy_(total.view_as(grad))

    def held(self) -> set[int]:
        """ids of every copy on this rank (`sum_grads` rewrites their gradients)."""
        return {id(copy) for group in self.groups for copy in self._copies(group)}

    def duplicates(self) -> set[int]:
        """ids of the copies a global norm must skip, so each tied weight counts once."""
        return {id(self.model.get_parameter(name)) for g in self.groups
                for stage, name in g.local.items() if stage != g.stages[0]}
