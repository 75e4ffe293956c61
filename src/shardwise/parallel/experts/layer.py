"""`ExpertParallel`: an experts module whose experts are split over the ranks of an `ep` mesh.

It stands in for the experts module in its parent, under the same parameter names
(`gate_up_proj`, `down_proj`, ...), each now a DTensor sharded by expert
(`Shard(0)` over `ep`), so state dicts, `full_state_dict` and distributed
checkpoints see the whole stacked tensors and reshard them to any EP degree. The
original module, told it holds only this rank's experts, still computes them (in
whichever kernel its model chose): each call runs it on the rows the dispatch brought.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ...torch_internals import tensor_tables
from ..tensor.batch import ScaleGrad
from .dispatch import Traffic, dispatch_combine


class ExpertParallel(nn.Module):
    """This rank's share of `experts` (an experts module holding `num_experts` stacked experts)."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh, count_attribute: str):
        super().__init__()
        total, size, rank = getattr(experts, count_attribute), mesh.size(), mesh.get_local_rank()
        if total % size:
            raise ValueError(f"expert parallelism: {type(experts).__name__} has {total} experts, which "
                             f"expert_parallel_degree {size} does not divide; fix: choose a degree dividing {total}")
        self.mesh, self.num_experts, self.local = mesh, total, total // size
        self.traffic: Optional[list[Traffic]] = None  # a list to record each dispatch's rows in, when set
        for name, parameter in list(experts.named_parameters(recurse=False)):
            if parameter.dim() == 0 or parameter.shape[0] != total:
                raise ValueError(f"expert parallelism: {type(experts).__name__}.{name} has shape "
                                 f"{tuple(parameter.shape)}, not {total} experts stacked along dim 0; fix: stack "
                                 "every expert parameter along dim 0 or leave the module out of expert parallelism")
            share = parameter.detach()[rank * self.local:(rank + 1) * self.local].clone()
            self.register_parameter(name, nn.Parameter(DTensor.from_local(share, mesh, [Shard(0)], run_check=False),
                                                       requires_grad=parameter.requires_grad))
            # the original keeps only a shape: each call hands it this rank's tensors
            setattr(experts, name, nn.Parameter(torch.empty(share.shape, dtype=share.dtype, device="meta"),
                                                requires_grad=parameter.requires_grad))
        setattr(experts, count_attribute, self.local)
        object.__setattr__(self, "compute_module", experts)  # not a submodule: its tensors are ours

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        # Each expert's gradient sums the losses of every rank of `ep` (the dispatch's backward brings them), and
        # data parallelism then averages it over the expert's replicas only: 1/ep makes that the mean of all ranks.
        scale = 1.0 / self.mesh.size()
        tensors = {name: ScaleGrad.apply(_local(parameter), scale)
                   for name, parameter in self.named_parameters(recurse=False)}

        def compute(rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
            index = local_expert.unsqueeze(-1)
            ones = torch.ones(index.shape, dtype=top_k_weights.dtype, device=rows.device)
            return _run_with(self.compute_module, tensors, rows, index, ones)

        record = None if self.traffic is None else self.traffic.append
        return dispatch_combine(hidden, top_k_index, top_k_weights, self.num_experts, self.mesh.get_group(),
                                compute, record)

    def extra_repr(self) -> str:
        return f"{type(self.compute_module).__name__}, experts={self.num_experts}, here={self.local}"


def _run_with(module: nn.Module, tensors: dict[str, torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """`module`'s forward on `args` with `tensors` as its parameters. Its forward alone, not a module call: the
    `ExpertParallel` around it is the module hooks and trackers see (torch's MemTracker would take these
    tensors, computed from the parameters, for parameters of its own)."""
    table = tensor_tables(module)[0]
    kept = dict(table)
    table.update(tensors)
    try:
        return type(module).forward(module, *args)
    finally:
        table.update(kept)


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's experts (a DTensor's local tensor; as is once a wrapper has made it a plain tensor)."""
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter
