"""Expert parallelism: a mixture-of-experts model's experts split over `ep` ranks, tokens sent to them by
all-to-all (dispatch.py), the load-balancing loss over the global batch (load_balancing.py)."""

from .apply import apply_expert_parallel, expert_parallel_modules, require_experts
from .dispatch import Traffic, dispatch_combine
from .layer import ExpertParallel
from .load_balancing import GlobalLoadBalancing, load_balancing_loss, load_balancing_of, use_global_load_balancing
from .registration import count_attribute, experts_modules, has_experts, register_experts, register_experts_with_module

__all__ = [
    "ExpertParallel", "GlobalLoadBalancing", "Traffic", "apply_expert_parallel", "count_attribute", "dispatch_combine",
    "expert_parallel_modules", "experts_modules", "has_experts", "load_balancing_loss", "load_balancing_of",
    "register_experts",
    "register_experts_with_module", "require_experts", "use_global_load_balancing",
]
