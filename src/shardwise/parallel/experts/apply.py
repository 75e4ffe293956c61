"""`apply_expert_parallel`: every experts module of a model split over the `ep` mesh."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .layer import ExpertParallel
from .load_balancing import use_global_load_balancing
from .registration import experts_modules, has_experts


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, data_group: dist.ProcessGroup | None) -> list[str]:
    """Replace each experts module of `model` (registration.py) by its `ExpertParallel` share over `ep_mesh`
    (1-D); returns their paths. `data_group`: the ranks whose batches make up the global batch, over which the
    load-balancing loss is then computed (load_balancing.py); None leaves the model's own."""
    require_experts(model)
    found = list(experts_modules(model))
    for path, experts, attribute in found:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, name, ExpertParallel(experts, ep_mesh, attribute))
    if data_group is not None:
        use_global_load_balancing(model, data_group)
    return [path for path, _, _ in found]


def require_experts(model: nn.Module) -> None:
    """Refuse expert parallelism for a model without an experts module, naming it."""
    if not has_experts(model):
        raise ValueError(f"expert parallelism: {type(model).__name__} has no experts module (none of Mixtral's, "
                         "Qwen2-MoE's, Qwen3-MoE's, OLMoE's or a registered class); fix: set "
                         "expert_parallel_degree to 1, or register the experts class with sw.register_experts")


def expert_parallel_modules(model: nn.Module) -> list[ExpertParallel]:
    """The `ExpertParallel` modules of `model`, in module order."""
    return [module for module in model.modules() if isinstance(module, ExpertParallel)]
